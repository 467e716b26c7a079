//! The queueing model the planner checks targets with: one slice serves batches one at a
//! time; requests wait for their batch to fill (at most the batcher's `max_wait`), then for
//! the batches ahead of theirs, then for their own.
//!
//! The wait for the batches ahead is M/D/1's (Pollaczek-Khinchine) mean, `ρ S / 2(1 - ρ)`,
//! with an exponential tail of that mean conditioned on waiting at all (probability `ρ`), as
//! in Kingman's approximation: its 95th percentile is `S ln(20ρ) / 2(1 - ρ)` (0 below
//! `ρ = 0.05`). The batch's own time `S` is its model's; other models' batches on the same
//! slice are counted in `ρ` only. The simulation (`--simulate`) checks the plan with the
//! server's own scheduling rules instead of these formulas.

/// The 95th percentile latency, milliseconds, of a request whose fixed part (edge, link) is
/// `fixed_ms`, whose batch waits at most `wait_ms` to fill and takes `service_ms`, on a slice
/// busy `load` of the time.
pub fn p95_ms(fixed_ms: f64, wait_ms: f64, service_ms: f64, load: f64) -> f64 {
    fixed_ms + wait_ms + queue_p95_ms(service_ms, load) + service_ms
}

/// The 95th percentile of the wait for the batches ahead.
pub fn queue_p95_ms(service_ms: f64, load: f64) -> f64 {
    if load >= 1.0 {
        return f64::INFINITY;
    }
    if load <= 0.05 {
        return 0.0;
    }
    service_ms * (20.0 * load).ln() / (2.0 * (1.0 - load))
}

/// The highest load of the slice (at most `cap`) at which the p95 stays within `target_ms`;
/// `None` when even an idle slice misses it.
pub fn max_load(target_ms: f64, fixed_ms: f64, wait_ms: f64, service_ms: f64, cap: f64) -> Option<f64> {
    if p95_ms(fixed_ms, wait_ms, service_ms, 0.0) > target_ms {
        return None;
    }
    if p95_ms(fixed_ms, wait_ms, service_ms, cap) <= target_ms {
        return Some(cap);
    }
    // The p95 rises with the load: bisect.
    let (mut low, mut high) = (0.0, cap);
    for _ in 0..60 {
        let mid = 0.5 * (low + high);
        if p95_ms(fixed_ms, wait_ms, service_ms, mid) <= target_ms {
            low = mid;
        } else {
            high = mid;
        }
    }
    Some(low)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_queue_s_p95_follows_the_formula_and_grows_without_bound() {
        assert_eq!(queue_p95_ms(10.0, 0.04), 0.0);
        let expected = 10.0 * (20.0f64 * 0.5).ln() / (2.0 * 0.5);
        assert!((queue_p95_ms(10.0, 0.5) - expected).abs() < 1e-12);
        assert!(queue_p95_ms(10.0, 0.9) > queue_p95_ms(10.0, 0.5));
        assert_eq!(queue_p95_ms(10.0, 1.0), f64::INFINITY);
    }

    #[test]
    fn the_highest_load_meets_the_target_exactly_or_is_the_cap() {
        // fixed 5 + wait 2 + service 10 = 17 ms idle.
        assert_eq!(max_load(16.0, 5.0, 2.0, 10.0, 0.9), None);
        assert_eq!(max_load(1000.0, 5.0, 2.0, 10.0, 0.9), Some(0.9));
        let load = max_load(30.0, 5.0, 2.0, 10.0, 0.9).expect("an idle slice meets 30 ms");
        assert!((p95_ms(5.0, 2.0, 10.0, load) - 30.0).abs() < 1e-6, "{load}");
    }
}
