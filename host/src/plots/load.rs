//! The plot of a load run: latency over time, the p50 and p99 of each model's answered
//! requests in 1 s windows (by the time each request's latency started).

use std::path::Path;

use cleave_common::stats::Percentiles;
use plotters::prelude::*;

use super::run::SERIES_COLORS;
use super::{chart_on, draw_legend, draw_marked_series, refuse_empty, titled_canvas, value_range, write_svg, DrawResult, Marker, PlotError};

/// The file name of the plot of latency over time.
pub const LATENCY_OVER_TIME: &str = "latency.svg";

/// Plot size in pixels.
const PLOT_SIZE: (u32, u32) = (960, 560);

/// One model's requests answered with a result: `(seconds since the start, latency ms)`.
pub type TimedLatencies = Vec<(f64, f64)>;

/// One second's latency percentiles.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Window {
    /// The window's start, in whole seconds since the run's start.
    pub second: i64,
    /// Median latency (ms) of the requests that started in it; NaN when none did.
    pub p50: f64,
    /// 99th percentile latency (ms); NaN when no request started in it.
    pub p99: f64,
}

/// The p50 and p99 of `points` in each whole second from 0 to the last point's, NaN for a
/// window without a finite latency (its lines break there).
pub fn windowed_percentiles(points: &[(f64, f64)]) -> Vec<Window> {
    let finite = || points.iter().filter(|(t, ms)| t.is_finite() && *t >= 0.0 && ms.is_finite());
    let Some(last) = finite().map(|(t, _)| *t as i64).max() else {
        return Vec::new();
    };
    let mut windows = vec![Vec::new(); last as usize + 1];
    for &(t, ms) in finite() {
        windows[t as usize].push(ms);
    }
    windows
        .iter()
        .enumerate()
        .map(|(second, values)| {
            let p = Percentiles::of(values).ok();
            Window { second: second as i64, p50: p.map_or(f64::NAN, |p| p.p50), p99: p.map_or(f64::NAN, |p| p.p99) }
        })
        .collect()
}

/// Plots each model's p50 (circles) and p99 (triangles) per 1 s window against the
/// seconds since the start, a colour per model. Refuses series without a single finite
/// point.
pub fn plot_latency_over_time(path: &Path, title: &str, series: &[(String, TimedLatencies)]) -> Result<(), PlotError> {
    let windows: Vec<(&str, Vec<Window>)> = series.iter().map(|(name, points)| (name.as_str(), windowed_percentiles(points))).collect();
    refuse_empty(path, windows.iter().all(|(_, w)| w.is_empty()), "no answered request to plot")?;
    write_svg(path, || render(title, &windows))
}

fn render(title: &str, series: &[(&str, Vec<Window>)]) -> DrawResult<String> {
    let last = series.iter().flat_map(|(_, w)| w.iter().map(|w| w.second)).max().unwrap_or(0);
    let y = value_range(series.iter().flat_map(|(_, w)| w.iter().flat_map(|w| [w.p50, w.p99])), Some(0.0..f64::INFINITY));
    let mut svg = String::new();
    {
        let root = titled_canvas(&mut svg, PLOT_SIZE, title)?;
        // One second of room on each side, so that the first and last windows' markers show.
        let mut chart = chart_on(&root, 40).build_cartesian_2d(-1i64..last + 1, y)?;
        chart
            .configure_mesh()
            .x_desc("seconds since the start (1 s windows)")
            .y_desc("latency (ms)")
            .x_label_formatter(&|s: &i64| if *s < 0 { String::new() } else { s.to_string() })
            .draw()?;
        for (i, (name, windows)) in series.iter().enumerate() {
            let color = SERIES_COLORS[i % SERIES_COLORS.len()];
            let p50: Vec<(i64, f64)> = windows.iter().map(|w| (w.second, w.p50)).collect();
            let p99: Vec<(i64, f64)> = windows.iter().map(|w| (w.second, w.p99)).collect();
            draw_marked_series(&mut chart, &p50, color, &format!("{name} p50"), Marker::Circle(3))?;
            draw_marked_series(&mut chart, &p99, color, &format!("{name} p99"), Marker::Triangle(4))?;
        }
        draw_legend(&mut chart, SeriesLabelPosition::UpperRight)?;
        root.present()?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_take_the_percentiles_of_each_second() {
        let points = [(0.1, 1.0), (0.9, 3.0), (2.5, 10.0), (f64::NAN, 4.0), (0.5, f64::INFINITY)];
        let w = windowed_percentiles(&points);
        assert_eq!(w.len(), 3);
        assert_eq!((w[0].second, w[0].p50), (0, 2.0));
        assert!((w[0].p99 - 2.98).abs() < 1e-9);
        assert!(w[1].p50.is_nan() && w[1].p99.is_nan(), "an empty second breaks the lines");
        assert_eq!(w[2], Window { second: 2, p50: 10.0, p99: 10.0 });
        assert!(windowed_percentiles(&[]).is_empty());
    }

    #[test]
    fn a_plot_is_written_and_nothing_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LATENCY_OVER_TIME);
        let series = vec![("a".to_string(), vec![(0.2, 1.0), (1.4, 2.0)]), ("b".to_string(), vec![(0.3, 5.0)])];
        plot_latency_over_time(&path, "load", &series).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("a p99") && svg.contains("b p50"));
        let err = plot_latency_over_time(&path, "load", &[("a".into(), vec![])]).unwrap_err();
        assert!(matches!(err, PlotError::Nothing { .. }), "{err}");
    }
}
