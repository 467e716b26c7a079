//! Order statistics of measurements: the one percentile definition every median, p95 and p99
//! in cleave uses (stage profiles, run summaries, plots, benches).
//!
//! A percentile is interpolated linearly between the two closest ranks (Hyndman and Fan's
//! type 7, numpy's default), so the median of an even count is the mean of the middle two.
//! An empty sample has no percentile: asking for one is an error, never a silent zero.

use serde::Serialize;

/// A percentile was asked of no values at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("no values to take a percentile of")]
pub struct EmptySample;

/// The `p`-th quantile (`0.0..=1.0`) of `values`, which must be free of NaN.
pub fn percentile(values: &[f64], p: f64) -> Result<f64, EmptySample> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    percentile_of_sorted(&sorted, p)
}

/// The median of `values` (the mean of the middle two for an even count).
pub fn median(values: &[f64]) -> Result<f64, EmptySample> {
    percentile(values, 0.5)
}

/// [`percentile`] of values already sorted ascending.
fn percentile_of_sorted(sorted: &[f64], p: f64) -> Result<f64, EmptySample> {
    let last = sorted.len().checked_sub(1).ok_or(EmptySample)?;
    let rank = p.clamp(0.0, 1.0) * last as f64;
    let (below, above) = (rank.floor() as usize, rank.ceil() as usize);
    let weight = rank - below as f64;
    Ok(sorted[below] + (sorted[above] - sorted[below]) * weight)
}

/// p50, p95 and p99 of a measurement.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 95th percentile.
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
}

impl Percentiles {
    /// The percentiles of `values` (free of NaN).
    pub fn of(values: &[f64]) -> Result<Self, EmptySample> {
        let mut sorted = values.to_vec();
        sorted.sort_by(f64::total_cmp);
        Ok(Self { p50: percentile_of_sorted(&sorted, 0.50)?, p95: percentile_of_sorted(&sorted, 0.95)?, p99: percentile_of_sorted(&sorted, 0.99)? })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_between_ranks() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        let p = Percentiles::of(&v).unwrap();
        assert_eq!(p.p50, 50.5);
        assert!((p.p95 - 95.05).abs() < 1e-9 && (p.p99 - 99.01).abs() < 1e-9, "{p:?}");
        let p = Percentiles::of(&[3.0]).unwrap();
        assert_eq!((p.p50, p.p99), (3.0, 3.0));
        assert_eq!(Percentiles::of(&[]), Err(EmptySample));
    }

    #[test]
    fn median_cases() {
        assert_eq!(median(&[1.0, 2.0, 4.0]), Ok(2.0));
        assert_eq!(median(&[5.0, 1.0, 4.0, 2.0]), Ok(3.0));
        assert_eq!(median(&[7.5]), Ok(7.5));
        assert_eq!(median(&[4.0]), Ok(4.0));
        assert_eq!(median(&[3.0, 1.0, 2.0]), Ok(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Ok(2.5));
        assert_eq!(median(&[-1.0, 5.0]), Ok(2.0));
        assert_eq!(median(&[7.0, 7.0, 7.0, 1.0]), Ok(7.0));
        assert_eq!(median(&[]), Err(EmptySample));
        assert_eq!(percentile(&[10.0, 20.0], 0.0), Ok(10.0));
        assert_eq!(percentile(&[10.0, 20.0], 1.0), Ok(20.0));
    }
}
