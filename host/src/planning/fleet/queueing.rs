//! The queueing model the planner checks targets with: one slice serves batches one at a
//! time; requests wait for their batch to fill (at most the batcher's `max_wait`), then for
//! the batches ahead of theirs, then for their own.
//!
//! The wait for the batches ahead is M/G/1's (Pollaczek-Khinchine) mean, `ρ R / 2(1 - ρ)`,
//! where `R = E[S²] / E[S]` over the batches the slice runs (the batch time `S` itself for a
//! model alone, weighted by each model's batches per second on a shared slice, so that a
//! model sharing with one of long batches waits behind them), with an exponential tail of
//! that mean conditioned on waiting at all (probability `ρ`), as in Kingman's
//! approximation: its 95th percentile is `R ln(20ρ) / 2(1 - ρ)` (0 below `ρ = 0.05`). The
//! simulation (`--simulate`) checks the plan with the server's own scheduling rules instead
//! of these formulas.

/// The 95th percentile latency, milliseconds, of a request whose fixed part (edge, link) is
/// `fixed_ms`, whose batch waits at most `wait_ms` to fill and takes `service_ms`, on a slice
/// busy `load` of the time with batches of residual time `residual_ms` (`E[S²] / E[S]`).
pub fn p95_ms(fixed_ms: f64, wait_ms: f64, service_ms: f64, residual_ms: f64, load: f64) -> f64 {
    fixed_ms + wait_ms + queue_p95_ms(residual_ms, load) + service_ms
}

/// `E[S²] / E[S]` of batches of times `service_ms` run `per_s` times a second each.
pub fn residual_ms(batches: impl IntoIterator<Item = (f64, f64)>) -> f64 {
    let (square, sum) =
        batches.into_iter().fold((0.0, 0.0), |(q, s), (service_ms, per_s)| (q + per_s * service_ms * service_ms, s + per_s * service_ms));
    if sum > 0.0 {
        square / sum
    } else {
        0.0
    }
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
pub fn max_load(target_ms: f64, fixed_ms: f64, wait_ms: f64, service_ms: f64, residual_ms: f64, cap: f64) -> Option<f64> {
    let p95 = |load: f64| p95_ms(fixed_ms, wait_ms, service_ms, residual_ms, load);
    if p95(0.0) > target_ms {
        return None;
    }
    if p95(cap) <= target_ms {
        return Some(cap);
    }
    // The p95 rises with the load: bisect.
    let (mut low, mut high) = (0.0, cap);
    for _ in 0..60 {
        let mid = 0.5 * (low + high);
        if p95(mid) <= target_ms {
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
        assert_eq!(max_load(16.0, 5.0, 2.0, 10.0, 10.0, 0.9), None);
        assert_eq!(max_load(1000.0, 5.0, 2.0, 10.0, 10.0, 0.9), Some(0.9));
        let load = max_load(30.0, 5.0, 2.0, 10.0, 10.0, 0.9).expect("an idle slice meets 30 ms");
        assert!((p95_ms(5.0, 2.0, 10.0, 10.0, load) - 30.0).abs() < 1e-6, "{load}");
        // Behind longer batches of another model, the same target allows less load.
        let shared = max_load(30.0, 5.0, 2.0, 10.0, 40.0, 0.9).expect("an idle slice meets 30 ms");
        assert!(shared < load, "{shared} {load}");
    }

    #[test]
    fn the_residual_time_weighs_each_batch_by_how_often_it_runs() {
        assert_eq!(residual_ms([(10.0, 5.0)]), 10.0);
        // 100 batches of 2 ms and 1 of 100 ms a second: (100 * 4 + 10000) / (200 + 100) = 34.67.
        assert!((residual_ms([(2.0, 100.0), (100.0, 1.0)]) - 10400.0 / 300.0).abs() < 1e-12);
    }
}
