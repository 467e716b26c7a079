//! Plots, as SVG files: shared chart helpers here, a run's plots in [`run`] (latency
//! breakdown per cut, latency CDF, predicted against measured), a training run's in
//! [`training`] (loss and accuracy per epoch), a load run's in [`load`] (latency over time).
//!
//! The text is written as SVG `<text>` elements laid out with plotters' built-in size
//! estimate, so no font needs to be installed; each plot is drawn in memory and then
//! written, so that every error names the file. Plots need no libtorch: the callers measure,
//! these modules only draw.

pub mod load;
pub mod run;
pub mod training;

use std::ops::Range;
use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::prelude::*;

/// A plot that cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// There is nothing to draw.
    #[error("cannot plot {path}: {reason}")]
    Nothing {
        /// The file it would have been.
        path: PathBuf,
        /// What is missing.
        reason: &'static str,
    },
    /// plotters failed to draw it.
    #[error("drawing {path}: {message}")]
    Draw {
        /// The file.
        path: PathBuf,
        /// plotters' message.
        message: String,
    },
    /// The file cannot be written.
    #[error("writing {path}: {error}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        error: std::io::Error,
    },
}

/// What drawing into memory can fail with.
pub(crate) type DrawResult<T> = Result<T, DrawingAreaErrorKind<std::io::Error>>;

/// Refuses to plot nothing: `Err` naming the file and `reason` when `empty`.
pub(crate) fn refuse_empty(path: &Path, empty: bool, reason: &'static str) -> Result<(), PlotError> {
    if empty {
        return Err(PlotError::Nothing { path: path.to_path_buf(), reason });
    }
    Ok(())
}

/// Draws a plot in memory, then writes it to `path`.
pub(crate) fn write_svg(path: &Path, render: impl FnOnce() -> DrawResult<String>) -> Result<(), PlotError> {
    let svg = render().map_err(|e| PlotError::Draw { path: path.to_path_buf(), message: e.to_string() })?;
    std::fs::write(path, svg).map_err(|error| PlotError::Write { path: path.to_path_buf(), error })
}

/// The canvas every plot draws on, in memory: white, the title on top.
pub(crate) fn titled_canvas<'b>(svg: &'b mut String, size: (u32, u32), title: &str) -> DrawResult<DrawingArea<SVGBackend<'b>, Shift>> {
    let root = SVGBackend::with_string(svg, size).into_drawing_area();
    root.fill(&WHITE)?;
    root.titled(title, ("sans-serif", 22))
}

/// A chart builder with the margin and the axis label areas every plot uses (`x_label_area`
/// pixels under the x axis).
pub(crate) fn chart_on<'a, 'b>(area: &'a DrawingArea<SVGBackend<'b>, Shift>, x_label_area: u32) -> ChartBuilder<'a, 'b, SVGBackend<'b>> {
    let mut builder = ChartBuilder::on(area);
    builder.margin(12).x_label_area_size(x_label_area).y_label_area_size(64);
    builder
}

/// The legend every plot of a run (and of a training run) draws: boxed, half see-through.
pub(crate) fn draw_legend<'a, 'b: 'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, SVGBackend<'b>, CT>,
    position: SeriesLabelPosition,
) -> Result<(), DrawingAreaErrorKind<std::io::Error>> {
    chart.configure_series_labels().position(position).background_style(WHITE.mix(0.8)).border_style(BLACK).draw()
}

/// A chart with integers across (cuts, epochs) and a float value up.
pub(crate) type LineChart<'a, 'b> =
    ChartContext<'a, SVGBackend<'b>, Cartesian2d<plotters::coord::types::RangedCoordi64, plotters::coord::types::RangedCoordf64>>;

/// The point marker of a series, with its size in pixels.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Marker {
    Circle(u32),
    Triangle(u32),
}

/// Draws one labelled series: a line through each run of finite points (a non-finite value
/// breaks the line rather than dragging it to the border) and a marker at every finite
/// point, so that a single cut (or epoch) still shows.
pub(crate) fn draw_marked_series(
    chart: &mut LineChart<'_, '_>,
    points: &[(i64, f64)],
    color: RGBColor,
    label: &str,
    marker: Marker,
) -> Result<(), DrawingAreaErrorKind<std::io::Error>> {
    let style = ShapeStyle::from(color).stroke_width(2);
    let mut labelled = false;
    for run in points.split(|&(_, y)| !y.is_finite()).filter(|run| !run.is_empty()) {
        let series = chart.draw_series(LineSeries::new(run.iter().copied(), style))?;
        // Only the first run carries the legend entry, so the legend lists each series once.
        if !labelled {
            labelled = true;
            series.label(label).legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        }
    }
    let finite = points.iter().filter(|&&(_, y)| y.is_finite());
    match marker {
        Marker::Circle(size) => {
            chart.draw_series(finite.map(|&(x, y)| Circle::new((x, y), size, style.filled())))?;
        }
        Marker::Triangle(size) => {
            chart.draw_series(finite.map(|&(x, y)| TriangleMarker::new((x, y), size, style.filled())))?;
        }
    }
    Ok(())
}

/// A value axis: the finite values' span with a 5% margin, clamped to `limits` when given.
/// An empty or degenerate span (one value, or all equal) is padded so the axis has height;
/// no finite value at all gives `limits`, or `0..1`.
pub(crate) fn value_range(values: impl Iterator<Item = f64>, limits: Option<Range<f64>>) -> Range<f64> {
    let (lo, hi) = values.filter(|v| v.is_finite()).fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if lo > hi {
        return limits.unwrap_or(0.0..1.0);
    }
    let span = hi - lo;
    let pad = if span > f64::EPSILON * hi.abs().max(1.0) { span * 0.05 } else { (hi.abs() * 0.1).max(0.5) };
    // Clamping keeps the axis some height: the padded span reaches past a limit by `pad` on
    // one side at most, and a value sitting at a limit (100% everywhere) keeps the other side.
    let (lo, hi) = (lo - pad, hi + pad);
    match limits {
        Some(limits) => lo.max(limits.start)..hi.min(limits.end),
        None => lo..hi,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn value_range_pads_degenerate_spans_and_respects_limits() {
        let r = value_range([0.7].into_iter(), None);
        assert!(r.start < 0.7 && r.end > 0.7);
        let r = value_range([100.0, 100.0].into_iter(), Some(0.0..100.0));
        assert!(r.start < 100.0 && r.end == 100.0, "{r:?}");
        let r = value_range([0.0].into_iter(), Some(0.0..100.0));
        assert!(r.start == 0.0 && r.end > 0.0, "{r:?}");
        assert_eq!(value_range([f64::NAN].into_iter(), None), 0.0..1.0);
        let r = value_range([1.0, 3.0].into_iter(), None);
        assert!((r.start - 0.9).abs() < 1e-12 && (r.end - 3.1).abs() < 1e-12, "{r:?}");
    }
}
