//! A discrete-event simulation of the planned servers, in virtual time, with the server's
//! own scheduling rules (`cleave_common::scheduling`: the queue, its batches and `edf` keys),
//! as each slice's `server.yaml` configures them: each model's batch limit and `max_wait`,
//! its `slo_ms` as the deadline.
//!
//! Each slice is simulated alone (its server shares nothing with the others). Requests of
//! each model on it arrive as a Poisson process at its share of the model's rate; a batch of
//! `n` takes the profile's time at `n` (linear between the measured batch sizes) over the
//! slice's compute share; a request's latency is its edges' fixed part (prefix, round trip,
//! transfers) plus its time in the server.

use std::time::{Duration, Instant};

use cleave_common::scheduling::{request_key, Entry, Group, Pick, Policy, Queue};
use cleave_common::stats::percentile;
use rand::rngs::StdRng;
use rand::SeedableRng;
use rand_distr::{Distribution, Exp};

use super::config::Fleet;
use super::solve::{Member, Placement};

/// The simulated latencies of one model, over all its slices.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Simulated {
    /// Requests answered within the simulated time.
    pub requests: usize,
    /// Their median latency, milliseconds.
    pub p50_ms: f64,
    /// Their 95th percentile, milliseconds.
    pub p95_ms: f64,
}

/// The server's `max_age` for work without a target (the planned configs' `max_age_ms`).
const MAX_AGE: Duration = Duration::from_secs(2);

/// Simulates `seconds` of every slice of `placement` from `seed`; each model's latencies.
pub fn simulate(fleet: &Fleet, placement: &Placement, seconds: f64, seed: u64) -> Vec<Option<Simulated>> {
    let mut latencies: Vec<Vec<f64>> = vec![Vec::new(); fleet.models.len()];
    for (i, slice) in placement.slices.iter().enumerate().filter(|(_, s)| !s.members.is_empty()) {
        let compute = fleet.slice_kinds[slice.kind].compute;
        let arrivals = arrivals(fleet, &slice.members, seconds, seed.wrapping_add(i as u64));
        for (m, ms) in simulate_slice(fleet, &slice.members, compute, arrivals) {
            latencies[m].extend(ms);
        }
    }
    latencies
        .iter()
        .map(|ms| {
            let p50_ms = percentile(ms, 0.5).ok()?;
            Some(Simulated { requests: ms.len(), p50_ms, p95_ms: percentile(ms, 0.95).ok()? })
        })
        .collect()
}

/// A request waiting on the simulated server: its member and when it arrived (virtual).
#[derive(Debug, Clone, Copy)]
struct Request {
    member: usize,
    arrived: Instant,
}

/// One slice's server, given its requests' members and arrivals (seconds): each member's
/// latencies, `(model, milliseconds)`, in the order they were answered.
fn simulate_slice(fleet: &Fleet, members: &[Member], compute: f64, mut arrivals: Vec<(usize, f64)>) -> Vec<(usize, Vec<f64>)> {
    let t0 = Instant::now();
    let at = |s: f64| t0 + Duration::from_secs_f64(s);
    arrivals.sort_by(|a, b| a.1.total_cmp(&b.1));
    let mut next = arrivals.into_iter().peekable();
    let mut queue: Queue<Request> = Queue::default();
    let mut latencies: Vec<Vec<f64>> = vec![Vec::new(); members.len()];
    let mut now = 0.0f64;
    loop {
        while let Some(&(member, t)) = next.peek().filter(|(_, t)| *t <= now) {
            next.next();
            queue.push(entry(fleet, members, member, at(t)));
        }
        match queue.pick(at(now), |m| i64::from(members[m].choice.batch), |_| true) {
            Pick::Run(batch) => {
                let m = &members[batch[0].item.member];
                let samples = batch.len() as u32;
                let took = fleet.models[m.model].profile.batch_ms(m.choice.cut, samples, compute) / 1000.0;
                now += took;
                for entry in batch {
                    let r = entry.item;
                    let server_s = now - r.arrived.duration_since(t0).as_secs_f64();
                    latencies[r.member].push(members[r.member].choice.fixed_ms + server_s * 1000.0);
                }
            }
            Pick::WaitUntil(ready) => {
                let ready = ready.duration_since(t0).as_secs_f64();
                now = next.peek().map_or(ready, |&(_, t)| t.min(ready)).max(now);
            }
            Pick::Idle => match next.peek() {
                Some(&(_, t)) => now = t,
                None => break,
            },
        }
    }
    members.iter().map(|m| m.model).zip(latencies).collect()
}

/// Every request's member and arrival (seconds), each member's Poisson process at its share
/// of its model's rate, for `seconds`.
fn arrivals(fleet: &Fleet, members: &[Member], seconds: f64, seed: u64) -> Vec<(usize, f64)> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut all = Vec::new();
    for (i, m) in members.iter().enumerate() {
        let rate = fleet.models[m.model].rate * m.share;
        let Ok(gap) = Exp::new(rate) else { continue };
        let mut t = gap.sample(&mut rng);
        while t < seconds {
            all.push((i, t));
            t += gap.sample(&mut rng);
        }
    }
    all
}

/// A request's place in the queue, as the planned server's config gives it: batched with its
/// model's requests (when its batch limit is above 1) up to its `max_wait`, keyed by `edf`
/// with the model's target as its `slo_ms`.
fn entry(fleet: &Fleet, members: &[Member], member: usize, arrived: Instant) -> Entry<Request> {
    let m = &members[member];
    let slo = Duration::from_millis(fleet.models[m.model].p95_ms.ceil() as u64);
    let group = (m.choice.batch > 1).then_some(Group { model: member, cut: m.choice.cut, seq: None });
    Entry {
        group,
        samples: 1,
        key: request_key(Policy::Edf, MAX_AGE, arrived, Some(slo), 1.0),
        ready_at: arrived + Duration::from_millis(m.choice.max_wait_ms),
        item: Request { member, arrived },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planning::fleet::choices::Choice;
    use crate::planning::fleet::tests::{fleet, model};

    /// Model `model` of a toy fleet at cut 0, its edges' part 2 ms, at `batch`, waiting
    /// `max_wait_ms` (the rest is the simulation's own).
    fn member(model: usize, batch: u32, max_wait_ms: u64) -> Member {
        let c = Choice { cut: 0, batch, max_wait_ms, service_ms: 0.0, fixed_ms: 2.0, load_per_rate: 0.0, max_load: 0.9, memory_bytes: 0.0 };
        Member { model, choice: c, share: 1.0 }
    }

    fn close(a: &[f64], b: &[f64]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-6)
    }

    #[test]
    fn a_request_alone_waits_its_max_wait_then_runs_alone() {
        // 10 ms a request on a whole GPU; 2 ms at the edge; batches of 4 wait 5 ms at most.
        let fleet = fleet(vec![model("a", 1.0, 10.0, 1.0)], vec![vec![0]]);
        let members = [member(0, 4, 5)];
        let latencies = simulate_slice(&fleet, &members, 1.0, vec![(0, 0.0), (0, 1.0)]);
        assert!(close(&latencies[0].1, &[2.0 + 5.0 + 10.0, 2.0 + 5.0 + 10.0]), "{latencies:?}");
        // Half the GPU: twice as long.
        let latencies = simulate_slice(&fleet, &members, 0.5, vec![(0, 0.0)]);
        assert!(close(&latencies[0].1, &[2.0 + 5.0 + 20.0]), "{latencies:?}");
        // The server's own 1.5 ms a request, on either.
        let mut fleet = fleet;
        fleet.models[0].profile.request_ms = 1.5;
        let latencies = simulate_slice(&fleet, &members, 0.5, vec![(0, 0.0)]);
        assert!(close(&latencies[0].1, &[2.0 + 5.0 + 20.0 + 1.5]), "{latencies:?}");
    }

    #[test]
    fn a_full_batch_runs_at_once_and_the_next_waits_for_it() {
        // Four requests 1 ms apart fill a batch at 3 ms, which takes 4 x 10 ms (the toy's time
        // grows with the batch); a fifth at 4 ms waits its 5 ms, then for the batch to end.
        let fleet = fleet(vec![model("a", 1.0, 10.0, 1.0)], vec![vec![0]]);
        let members = [member(0, 4, 5)];
        let arrivals = [0.0, 0.001, 0.002, 0.003, 0.004].iter().map(|&t| (0, t)).collect();
        let latencies = simulate_slice(&fleet, &members, 1.0, arrivals);
        let first: Vec<f64> = [0.0, 1.0, 2.0, 3.0].iter().map(|t| 2.0 + 3.0 + 40.0 - t).collect();
        assert!(close(&latencies[0].1[..4], &first), "{latencies:?}");
        assert!(close(&latencies[0].1[4..], &[2.0 + (43.0 + 10.0 - 4.0)]), "{latencies:?}");
    }

    #[test]
    fn edf_runs_the_nearer_deadline_first() {
        // Both arrive while a request of b runs (0 to 10 ms): a's target is 20 ms, b's 10 s, so
        // a's request, arriving later, runs first.
        let mut urgent = model("a", 1.0, 10.0, 1.0);
        urgent.p95_ms = 20.0;
        let fleet = fleet(vec![urgent, model("b", 1.0, 10.0, 1.0)], vec![vec![0]]);
        let members = [member(0, 1, 0), member(1, 1, 0)];
        let latencies = simulate_slice(&fleet, &members, 1.0, vec![(1, 0.0), (1, 0.002), (0, 0.003)]);
        assert!(close(&latencies[0].1, &[2.0 + 20.0 - 3.0]), "{latencies:?}");
        assert!(close(&latencies[1].1, &[2.0 + 10.0, 2.0 + 30.0 - 2.0]), "{latencies:?}");
    }
}
