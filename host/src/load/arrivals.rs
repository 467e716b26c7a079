//! When each edge of a load run sends: closed loop (the next request as soon as the previous
//! is answered) or open loop (Poisson arrivals at a fixed rate, whatever the answers). Times
//! are offsets from the run's start; pure, and seeded, so a run's schedule can be replayed.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::SeedableRng;
use rand_distr::{Distribution, Exp};

use crate::error::RateError;

/// How a load run sends.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LoadMode {
    /// Each edge sends its next request as soon as the previous one is answered (`--closed`).
    Closed,
    /// Poisson arrivals (`--rate`): the edges together send `rate` requests per second on
    /// average, each edge an equal share, on schedule whatever the answers.
    Open {
        /// Requests per second, all edges together.
        rate: f64,
    },
}

impl LoadMode {
    /// `closed` or `open`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::Open { .. } => "open",
        }
    }

    /// The total rate of an open loop.
    pub fn rate(&self) -> Option<f64> {
        match self {
            Self::Closed => None,
            Self::Open { rate } => Some(*rate),
        }
    }
}

/// A Poisson process: exponential gaps of mean `1 / rate`, drawn from a seeded generator.
#[derive(Debug, Clone)]
pub struct PoissonArrivals {
    rng: StdRng,
    gaps: Exp<f64>,
}

impl PoissonArrivals {
    /// Arrivals at `rate` per second (finite and positive), drawn from `seed`.
    pub fn new(rate: f64, seed: u64) -> Result<Self, RateError> {
        if !(rate.is_finite() && rate > 0.0) {
            return Err(RateError { rate });
        }
        let gaps = Exp::new(rate).map_err(|_| RateError { rate })?;
        Ok(Self { rng: StdRng::seed_from_u64(seed), gaps })
    }

    /// The next gap between two arrivals.
    pub fn gap(&mut self) -> Duration {
        Duration::from_secs_f64(self.gaps.sample(&mut self.rng))
    }
}

/// One edge's schedule.
#[derive(Debug, Clone)]
pub enum Arrivals {
    /// The next request when the previous one is answered.
    Closed,
    /// On a Poisson schedule.
    Poisson(Box<PoissonArrivals>),
}

impl Arrivals {
    /// The schedule of edge `edge` of `edges` under `mode`: an open loop's edge sends at
    /// `rate / edges`, from a generator seeded by `seed` and the edge, so that edges differ and
    /// a run with the same seed repeats.
    pub fn for_edge(mode: LoadMode, edges: usize, edge: usize, seed: u64) -> Result<Self, RateError> {
        match mode {
            LoadMode::Closed => Ok(Self::Closed),
            LoadMode::Open { rate } => {
                let edge_seed = seed ^ (edge as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                Ok(Self::Poisson(Box::new(PoissonArrivals::new(rate / edges.max(1) as f64, edge_seed)?)))
            }
        }
    }

    /// The first request's time: at once in a closed loop, after a first gap in an open one.
    pub fn first(&mut self) -> Duration {
        match self {
            Self::Closed => Duration::ZERO,
            Self::Poisson(p) => p.gap(),
        }
    }

    /// The request after the one due at `scheduled`, once that one is sent: an open loop's
    /// next arrival (none in a closed loop, which waits for the answer).
    pub fn after_arrival(&mut self, scheduled: Duration) -> Option<Duration> {
        match self {
            Self::Closed => None,
            Self::Poisson(p) => Some(scheduled + p.gap()),
        }
    }

    /// The request after an answer that came at `answered`: at once in a closed loop (none in
    /// an open one, which keeps its schedule).
    pub fn after_answer(&mut self, answered: Duration) -> Option<Duration> {
        match self {
            Self::Closed => Some(answered),
            Self::Poisson(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_gaps_average_to_the_inverse_rate() {
        let mut p = PoissonArrivals::new(250.0, 7).unwrap();
        let n = 200_000;
        let total: f64 = (0..n).map(|_| p.gap().as_secs_f64()).sum();
        let mean = total / n as f64;
        assert!((mean - 1.0 / 250.0).abs() < 0.02 / 250.0, "mean gap {mean} s, expected 0.004 s");
    }

    #[test]
    fn an_edge_gets_its_share_of_the_rate_and_a_seeded_schedule() {
        let times = |edge: usize, seed: u64| {
            let mut a = Arrivals::for_edge(LoadMode::Open { rate: 400.0 }, 4, edge, seed).unwrap();
            let mut t = a.first();
            let mut out = vec![t];
            for _ in 0..50_000 {
                t = a.after_arrival(t).unwrap();
                out.push(t);
            }
            out
        };
        let edge0 = times(0, 1);
        assert_eq!(edge0, times(0, 1), "the same seed repeats the schedule");
        assert_ne!(edge0, times(1, 1), "edges draw different schedules");
        assert_ne!(edge0, times(0, 2), "seeds draw different schedules");
        assert!(edge0.windows(2).all(|w| w[0] <= w[1]));
        // 400 requests/s over 4 edges: 100 per second each.
        let rate = edge0.len() as f64 / edge0.last().unwrap().as_secs_f64();
        assert!((rate - 100.0).abs() < 2.0, "edge rate {rate}/s");
        let mut a = Arrivals::for_edge(LoadMode::Open { rate: 400.0 }, 4, 0, 1).unwrap();
        assert_eq!(a.after_answer(Duration::from_secs(1)), None, "an open loop keeps its schedule whatever the answers");
    }

    #[test]
    fn a_closed_loop_sends_at_once_and_then_on_each_answer() {
        let mut a = Arrivals::for_edge(LoadMode::Closed, 3, 2, 9).unwrap();
        assert_eq!(a.first(), Duration::ZERO);
        assert_eq!(a.after_arrival(Duration::ZERO), None, "a closed loop waits for the answer");
        let answered = Duration::from_millis(12);
        assert_eq!(a.after_answer(answered), Some(answered));
    }

    #[test]
    fn rates_that_are_not_positive_are_refused() {
        for rate in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let err = PoissonArrivals::new(rate, 0).unwrap_err();
            assert!(err.rate.to_bits() == rate.to_bits(), "rate {rate}: {err}");
        }
        assert_eq!(LoadMode::Open { rate: 5.0 }.rate(), Some(5.0));
        assert_eq!(LoadMode::Closed.name(), "closed");
    }
}
