//! `split: auto` while running: plan from measured profiles at start-up, then keep a moving
//! estimate of the link's bandwidth and let the re-planner move the split between requests.
//!
//! The estimate is fed by every request that crosses the network (its bytes over its
//! network time). A request split at the last cut runs wholly on the edge and moves nothing,
//! so while the split sits there a prober sends an upload-only `Echo` now and then: without
//! it, a link that gets faster again would never be noticed. Probes are small and rare (at
//! most 5% of the time): they compete with the requests for a weak edge's processor.
//!
//! One task owns the planner ([`AutoSplitTask`]): the result loop sends it each answer's
//! measurements, it probes from there, and the prefix thread reads the cut it publishes on a
//! `watch` channel. Nothing of it is shared under a lock.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::Instrument;

use cleave_client::ServerSession;

use crate::client::RequestMetrics;
use crate::planner::{BandwidthEstimate, CutPrediction, Objective, ProfileError, Profiles, Replanner};
use crate::records::{Planned, Probes, ProfilingTime, SplitMove};

/// How much each transfer moves the bandwidth estimate (in the logarithm: half way).
const ESTIMATE_WEIGHT: f64 = 0.5;
/// Predicted gain a move must beat (a share of the current cut's latency).
const MOVE_MARGIN: f64 = 0.1;
/// A probe is sized to take about this long at the estimated bandwidth.
const PROBE_TARGET: Duration = Duration::from_millis(200);
/// Bounds of a probe's size. Small probes measure the burst a shaper or a buffer lets
/// through at line rate, not the sustained rate: 16 KiB probes of a 5 Mbit/s link shaped
/// with a 32 KiB burst read as hundreds of Mbit/s and sent the split to the server.
const PROBE_BYTES: std::ops::RangeInclusive<usize> = (256 << 10)..=(4 << 20);
/// The shortest pause between probes.
const PROBE_EVERY: Duration = Duration::from_secs(1);
/// Probes take at most this share of the time (the link, and the edge's processor, which a
/// weak edge device cannot spare: a probe's duration sets the pause after it).
const PROBE_DUTY: f64 = 0.05;

/// Answers' measurements the planner's task may hold unread: far more than it falls behind
/// by (it does a little arithmetic per answer). One that finds them full is dropped, and the
/// count said when the run ends.
const OBSERVATIONS_QUEUED: usize = 4096;

/// The running planner: the bandwidth estimate, the re-planner, and what it did.
pub struct AutoSplit {
    /// The cut requests take, published to the prefix thread.
    cut: watch::Sender<usize>,
    replanner: Replanner,
    estimate: BandwidthEstimate,
    rtt_ms: f64,
    result_bytes: u64,
    last_cut: usize,
    last_request: u64,
    moves: Vec<SplitMove>,
    probes: Probes,
}

impl AutoSplit {
    /// Plans from `profiles` (which took `took` to measure); returns the planner and what it chose.
    pub fn plan(profiles: Profiles, took: ProfilingTime, objective: Objective) -> Result<(Self, Planned), ProfileError> {
        let rtt_ms = profiles.link.rtt_ms;
        let result_bytes = profiles.result_wire_bytes;
        let last_cut = profiles.stage_count();
        let estimate = BandwidthEstimate::new(profiles.link.bytes_per_s, ESTIMATE_WEIGHT);
        let predictions = profiles.predict(objective)?;
        let replanner = Replanner::new(profiles, objective, MOVE_MARGIN)?;
        let chosen: CutPrediction = replanner.prediction(replanner.current())?;
        let planned = Planned {
            objective,
            cut: chosen.cut,
            codec: chosen.codec.map(|c| c.to_string()),
            predicted_ms: chosen.latency_ms,
            predicted_rps: chosen.throughput_rps,
            link_mbit_per_s: estimate.bytes_per_s() * 8.0 / 1e6,
            rtt_ms,
            profiling: took,
            predictions,
        };
        let cut = watch::Sender::new(chosen.cut);
        Ok((
            Self { cut, replanner, estimate, rtt_ms, result_bytes, last_cut, last_request: 0, moves: Vec::new(), probes: Probes::default() },
            planned,
        ))
    }

    /// The cut requests read when their prefix starts, as it moves.
    pub fn cut(&self) -> watch::Receiver<usize> {
        self.cut.subscribe()
    }

    /// Whether the split sits at the last cut (every request wholly on the edge).
    fn on_edge(&self) -> bool {
        *self.cut.borrow() == self.last_cut
    }

    /// Every move so far.
    pub fn moves(&self) -> &[SplitMove] {
        &self.moves
    }

    /// The probes sent so far.
    pub fn probes(&self) -> Probes {
        self.probes
    }

    /// Feeds one answered request into the estimate (requests that stayed on the edge moved
    /// nothing and are skipped).
    pub fn observe(&mut self, request_id: u64, m: &RequestMetrics) {
        self.last_request = self.last_request.max(request_id);
        if m.split == self.last_cut || m.bytes_wire == 0 {
            return;
        }
        let network_ms = m.round_trip_ms - m.server.total_ms();
        if self.estimate.observe(m.bytes_wire + self.result_bytes, network_ms, self.rtt_ms) {
            self.replan();
        }
    }

    /// Feeds one probe: `bytes` uploaded in `elapsed_ms` (an empty reply). Returns whether it
    /// counted (one that took little more than a round trip says nothing).
    fn observe_probe(&mut self, bytes: u64, elapsed_ms: f64) -> bool {
        let counted = self.estimate.observe(bytes, elapsed_ms, self.rtt_ms);
        if counted {
            self.replan();
        }
        counted
    }

    /// Records a probe of `size` bytes that took `elapsed` and, when it was answered, feeds it
    /// and returns the size of the next one (four times larger after one too quick to count).
    fn probed(&mut self, size: usize, elapsed: Duration, answered: bool) -> Option<usize> {
        self.probes.count += 1;
        self.probes.bytes += size as u64;
        self.probes.seconds += elapsed.as_secs_f64();
        if !answered {
            return None;
        }
        Some(match self.observe_probe(size as u64, elapsed.as_secs_f64() * 1e3) {
            true => self.probe_bytes(),
            false => (size * 4).min(*PROBE_BYTES.end()),
        })
    }

    /// The size of the next probe: [`PROBE_TARGET`] at the estimated bandwidth.
    fn probe_bytes(&self) -> usize {
        ((self.estimate.bytes_per_s() * PROBE_TARGET.as_secs_f64()) as usize).clamp(*PROBE_BYTES.start(), *PROBE_BYTES.end())
    }

    fn replan(&mut self) {
        let before = self.replanner.current();
        let now = self.replanner.update(self.estimate.bytes_per_s());
        if now != before {
            let mbit_per_s = self.estimate.bytes_per_s() * 8.0 / 1e6;
            tracing::info!(from = before, to = now, mbit_per_s, "split moved");
            self.moves.push(SplitMove { after_request: self.last_request, from: before, to: now, mbit_per_s });
            self.cut.send_replace(now);
        }
    }
}

/// The planner's task, and what the run talks to it through.
pub struct AutoSplitTask {
    observations: mpsc::Sender<(u64, RequestMetrics)>,
    dropped: u64,
    task: JoinHandle<AutoSplit>,
}

impl AutoSplitTask {
    /// Starts the task that owns `auto`, probing through `session` while the split sits at the
    /// last cut.
    pub fn spawn(auto: AutoSplit, session: ServerSession) -> Self {
        let (observations, received) = mpsc::channel(OBSERVATIONS_QUEUED);
        let task = tokio::spawn(plan_while_running(auto, session, received));
        Self { observations, dropped: 0, task }
    }

    /// Hands one answered request's measurements to the planner.
    pub fn observe(&mut self, request_id: u64, metrics: &RequestMetrics) {
        if self.observations.try_send((request_id, metrics.clone())).is_err() {
            self.dropped += 1;
        }
    }

    /// Stops the task (a probe under way is abandoned) and gives the planner back, with what
    /// it did.
    pub async fn finish(self) -> Result<AutoSplit, tokio::task::JoinError> {
        drop(self.observations);
        if self.dropped > 0 {
            tracing::warn!(dropped = self.dropped, "split: auto fell behind: some answers were not counted in the bandwidth estimate");
        }
        self.task.await
    }
}

/// A probe under way: its size, how long it took, and whether it was answered.
type Probe = Pin<Box<dyn Future<Output = (usize, Duration, bool)> + Send>>;

/// The planner's task: it feeds each answer's measurements to the estimate and, while the
/// split sits at the last cut, uploads a probe through `Echo` now and then: sized to take
/// [`PROBE_TARGET`] at the estimated bandwidth (four times larger after one too quick to
/// count, so a link that became much faster is still seen), at most [`PROBE_DUTY`] of the
/// time. Ends, giving the planner back, when the run drops its sender.
async fn plan_while_running(mut auto: AutoSplit, session: ServerSession, mut observations: mpsc::Receiver<(u64, RequestMetrics)>) -> AutoSplit {
    let largest = (session.server.limits.max_message_bytes.saturating_sub(4096) as usize).max(1);
    let mut bytes = auto.probe_bytes();
    let mut next_probe = Instant::now() + PROBE_EVERY;
    let mut probe: Option<Probe> = None;
    loop {
        tokio::select! {
            observed = observations.recv() => match observed {
                Some((request_id, metrics)) => auto.observe(request_id, &metrics),
                None => return auto,
            },
            (size, elapsed, answered) = async { probe.as_mut().expect("a probe is under way").await }, if probe.is_some() => {
                probe = None;
                next_probe = Instant::now() + PROBE_EVERY.max(elapsed.div_f64(PROBE_DUTY));
                bytes = auto.probed(size, elapsed, answered).unwrap_or(bytes);
            }
            () = tokio::time::sleep_until(next_probe), if probe.is_none() => {
                next_probe = Instant::now() + PROBE_EVERY;
                if auto.on_edge() {
                    probe = Some(Box::pin(upload(session.client.clone(), bytes.min(largest))));
                }
            }
        }
    }
}

/// Uploads `size` bytes through `Echo` (an empty reply): how long it took, and whether it was
/// answered.
async fn upload(mut client: cleave_client::Client, size: usize) -> (usize, Duration, bool) {
    let started = Instant::now();
    let probe = cleave_common::pb::EchoRequest { payload: bytes::Bytes::from(vec![0u8; size]), reply_bytes: 0 };
    let answer = client.echo(probe).instrument(tracing::debug_span!("bandwidth_probe", bytes = size)).await;
    if let Err(status) = &answer {
        tracing::warn!(%status, "bandwidth probe failed");
    }
    (size, started.elapsed(), answer.is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::ServerTimes;
    use crate::planner::fixtures;

    /// The planner tests' 4-stage model over a fast link: everything goes to the server (cut 0).
    fn profiles() -> Profiles {
        fixtures::profiles(10_000.0)
    }

    /// A request at `split` that moved `bytes` up in `network_ms` (plus an 8 ms server).
    fn request(split: usize, bytes: u64, network_ms: f64) -> RequestMetrics {
        let server = ServerTimes { compute_ms: 8.0, ..Default::default() };
        RequestMetrics { split, bytes_wire: bytes, round_trip_ms: network_ms + 8.0, server, ..Default::default() }
    }

    #[test]
    fn slow_transfers_move_the_split_and_each_move_is_recorded() {
        let (mut auto, planned) = AutoSplit::plan(profiles(), ProfilingTime::default(), Objective::Latency).unwrap();
        assert_eq!((planned.cut, *auto.cut().borrow()), (0, 0));
        // The predicted latency at cut 0: 0.48 ms up, 1 ms round trip, 8 ms server, 0.0032 ms down.
        assert!((planned.predicted_ms - (0.48 + 1.0 + 8.0 + 0.0032)).abs() < 1e-9, "{planned:?}");
        // The link drops to about 2 Mbit/s: 604 kB in 2.4 s. A few requests move the estimate
        // far enough that everything runs on the edge.
        for id in 0..6 {
            auto.observe(id, &request(0, 600_000, 2417.0));
        }
        assert_eq!(*auto.cut().borrow(), 4);
        let moves = auto.moves().to_vec();
        assert!(!moves.is_empty());
        assert_eq!((moves[0].from, moves.last().unwrap().to), (0, 4));
        assert!(moves.windows(2).all(|w| w[0].to == w[1].from && w[0].after_request <= w[1].after_request));
        // Requests that ran on the edge say nothing about the link.
        let before = auto.estimate.bytes_per_s();
        auto.observe(11, &RequestMetrics { split: 4, ..Default::default() });
        assert_eq!(auto.estimate.bytes_per_s(), before);
        // Probes on a slow link are small: 200 ms at about 2 Mbit/s is under the 256 KiB floor.
        assert_eq!(auto.probe_bytes(), 256 << 10);
        // One that is mostly round trip does not count.
        assert!(!auto.observe_probe(256 << 10, 1.1));
        // Probes that find the link fast again (256 KiB in 2.1 ms: 1 Gbit/s) bring the split back.
        for _ in 0..10 {
            auto.observe_probe(256 << 10, 1.0 + 2.1);
        }
        assert_eq!(*auto.cut().borrow(), 0);
        // At about 1 Gbit/s, 200 ms is more than the 4 MiB ceiling.
        assert_eq!(auto.probe_bytes(), 4 << 20);
    }
}
