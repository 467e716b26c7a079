//! The plot of a training run: training and test loss per epoch on the left, test
//! accuracy per epoch on the right.

use std::ops::Range;
use std::path::Path;

use plotters::prelude::*;

use super::{chart_on, draw_legend, draw_marked_series, refuse_empty, titled_canvas, value_range, write_svg, DrawResult, Marker, PlotError};
use crate::records::EpochRecord;

/// Plots the run into an SVG file: training and test loss per epoch on the left, test
/// accuracy (in %) per epoch on the right. Refuses an empty run.
///
/// The text is written as SVG `<text>` elements and laid out with plotters' built-in size
/// estimate, so no font needs to be installed on the machine that draws it.
pub fn plot_training(path: &Path, title: &str, epochs: &[EpochRecord]) -> Result<(), PlotError> {
    refuse_empty(path, epochs.is_empty(), "the run has no epochs")?;
    write_svg(path, || render_svg(title, epochs))
}

/// Plot size in pixels: two square-ish panels side by side under a title.
const PLOT_SIZE: (u32, u32) = (1200, 520);

/// Draws both panels into an SVG document held in memory (the caller writes the file, so
/// that an I/O error names it).
fn render_svg(title: &str, epochs: &[EpochRecord]) -> DrawResult<String> {
    let x_range = epoch_range(epochs.len());
    // The single-epoch axis is widened past the run; its padding gets no tick labels.
    let last_epoch = epochs.len() as i64;
    let epoch_label = |x: &i64| {
        if (1..=last_epoch).contains(x) {
            x.to_string()
        } else {
            String::new()
        }
    };
    let train: Vec<(i64, f64)> = epochs.iter().map(|e| (e.epoch as i64, e.train_loss)).collect();
    let test: Vec<(i64, f64)> = epochs.iter().map(|e| (e.epoch as i64, e.test_loss)).collect();
    let accuracy: Vec<(i64, f64)> = epochs.iter().map(|e| (e.epoch as i64, e.test_accuracy * 100.0)).collect();
    let loss_range = value_range(train.iter().chain(&test).map(|&(_, y)| y), None);
    let accuracy_range = value_range(accuracy.iter().map(|&(_, y)| y), Some(0.0..100.0));

    let mut svg = String::new();
    {
        let root = titled_canvas(&mut svg, PLOT_SIZE, title)?;
        let (left, right) = root.split_horizontally(PLOT_SIZE.0 / 2);

        let mut chart = chart_on(&left, 40).caption("Loss per epoch", ("sans-serif", 18)).build_cartesian_2d(x_range.clone(), loss_range)?;
        chart.configure_mesh().x_desc("epoch").y_desc("loss").x_labels(x_label_count(epochs.len())).x_label_formatter(&epoch_label).draw()?;
        draw_marked_series(&mut chart, &train, BLUE, "train loss", Marker::Circle(3))?;
        draw_marked_series(&mut chart, &test, RED, "test loss", Marker::Circle(3))?;
        draw_legend(&mut chart, SeriesLabelPosition::UpperRight)?;

        let mut chart = chart_on(&right, 40).caption("Test accuracy per epoch", ("sans-serif", 18)).build_cartesian_2d(x_range, accuracy_range)?;
        chart
            .configure_mesh()
            .x_desc("epoch")
            .y_desc("test accuracy (%)")
            .x_labels(x_label_count(epochs.len()))
            .x_label_formatter(&epoch_label)
            .draw()?;
        draw_marked_series(&mut chart, &accuracy, RGBColor(0, 140, 0), "test accuracy", Marker::Circle(3))?;
        draw_legend(&mut chart, SeriesLabelPosition::LowerRight)?;

        root.present()?;
    }
    Ok(svg)
}

/// The epoch axis: `1..=n`, widened to `0..=2` for a single epoch so its point sits in the
/// middle of a non-empty range.
fn epoch_range(count: usize) -> Range<i64> {
    if count <= 1 {
        0..2
    } else {
        1..count as i64
    }
}

/// How many epoch ticks to ask for: every epoch while they fit, about ten after that.
fn x_label_count(count: usize) -> usize {
    (count + 2).min(12)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::training::report::fixtures::epoch;
    use std::fs;

    const TRAINING_SVG: &str = crate::training::report::TRAINING_SVG;

    pub(crate) fn assert_plot_looks_right(svg: &str) {
        let start = svg.trim_start();
        assert!(start.starts_with("<svg") || start.starts_with("<?xml"), "not an SVG: {}", &svg[..svg.len().min(80)]);
        assert!(svg.trim_end().ends_with("</svg>"));
        for text in ["epoch", "loss", "test accuracy (%)", "train loss", "test loss", "Loss per epoch"] {
            assert!(svg.contains(&format!(">{text}<")) || svg.contains(&format!(">\n{text}\n<")), "no text {text:?} in the plot");
        }
        assert!(svg.contains("<polyline") || svg.contains("<path"), "no line in the plot");
        assert!(svg.contains("<circle"), "no point markers in the plot");
    }

    #[test]
    fn plot_has_both_panels_labels_legend_and_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(TRAINING_SVG);
        let epochs: Vec<_> = (1..=5).map(|i| epoch(i, 2.0 / i as f64, 1.8 / i as f64, 0.5 + 0.09 * i as f64)).collect();
        plot_training(&path, "split training of <digits> & co", &epochs).unwrap();
        let svg = fs::read_to_string(&path).unwrap();
        assert_plot_looks_right(&svg);
        assert!(svg.contains("&lt;digits&gt; &amp; co"), "title missing or unescaped");
        assert!(svg.contains("<polyline"), "no series line");
    }

    #[test]
    fn plot_works_with_one_epoch() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(TRAINING_SVG);
        plot_training(&path, "one epoch", &[epoch(1, 0.7, 0.7, 1.0)]).unwrap();
        let svg = fs::read_to_string(&path).unwrap();
        assert_plot_looks_right(&svg);
        // Degenerate ranges must not produce NaN coordinates.
        assert!(!svg.contains("NaN"));
    }

    #[test]
    fn plot_skips_non_finite_losses() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(TRAINING_SVG);
        let epochs = [epoch(1, 0.9, 0.8, 0.6), epoch(2, f64::NAN, f64::INFINITY, 0.1), epoch(3, 0.5, 0.4, 0.7)];
        plot_training(&path, "diverged", &epochs).unwrap();
        let svg = fs::read_to_string(&path).unwrap();
        assert_plot_looks_right(&svg);
        assert!(!svg.contains("NaN") && !svg.contains("inf"));
    }

    #[test]
    fn plot_refuses_zero_epochs_and_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("empty.svg");
        let err = plot_training(&path, "nothing", &[]).unwrap_err().to_string();
        assert!(err.contains("no epochs") && err.contains("empty.svg"), "{err}");
        assert!(!path.exists());
    }
}
