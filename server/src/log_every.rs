//! A warning a peer can make the server repeat (a batch its steps make fail, a socket refused
//! at once) is logged at most once a period, the ones not logged counted in the next line: a
//! line each would flood the log.

use std::time::{Duration, Instant};

/// One kind of warning: when it was last logged, and how many came since.
#[derive(Debug)]
pub(crate) struct LogEvery {
    every: Duration,
    logged_at: Option<Instant>,
    unlogged: u64,
}

impl LogEvery {
    /// At most one line every `every`.
    pub(crate) const fn new(every: Duration) -> Self {
        Self { every, logged_at: None, unlogged: 0 }
    }

    /// The warning came at `now`: `Some(n)` when it is to be logged, `n` not logged since the
    /// last line; `None` when it is counted for the next.
    pub(crate) fn came(&mut self, now: Instant) -> Option<u64> {
        if self.logged_at.is_some_and(|at| now.duration_since(at) < self.every) {
            self.unlogged += 1;
            return None;
        }
        self.logged_at = Some(now);
        Some(std::mem::take(&mut self.unlogged))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_warning_is_logged_at_most_once_a_period_with_the_rest_counted() {
        let every = Duration::from_secs(10);
        let (t0, mut log) = (Instant::now(), LogEvery::new(every));
        assert_eq!(log.came(t0), Some(0), "the first is logged");
        for ms in [1, 500, 9_999] {
            assert_eq!(log.came(t0 + Duration::from_millis(ms)), None);
        }
        assert_eq!(log.came(t0 + every), Some(3), "the next line counts those not logged");
        assert_eq!(log.came(t0 + every + Duration::from_secs(1)), None);
    }
}
