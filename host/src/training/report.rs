//! The files a training run leaves in its output directory: `metrics.csv` (one row per
//! epoch), `summary.json`, and `training.svg` (loss and accuracy per epoch).
//!
//! This module needs no libtorch: the training loop measures, this module only writes.

use std::fmt::Write as _;
use std::fs;
use std::ops::Range;
use std::path::Path;

use anyhow::{bail, Context};
use plotters::prelude::*;

use crate::pictures::{chart_on, draw_legend, draw_marked_series, titled_canvas, value_range, Marker};
use serde::{Deserialize, Deserializer, Serialize};

/// The per-epoch table's file name inside the output directory.
pub const METRICS_CSV: &str = "metrics.csv";
/// The summary's file name inside the output directory.
pub const SUMMARY_JSON: &str = "summary.json";
/// The plot's file name inside the output directory.
pub const TRAINING_SVG: &str = "training.svg";

/// The header line of `metrics.csv`, in the order of [`EpochRecord`]'s fields.
const CSV_HEADER: &str = "epoch,steps,train_loss,test_loss,test_accuracy,epoch_seconds,eval_seconds";

/// One epoch of training and its evaluation.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EpochRecord {
    /// The epoch's number, counted from 1.
    pub epoch: usize,
    /// Optimizer steps taken in this epoch.
    pub steps: u64,
    /// Mean training loss over the epoch's samples.
    #[serde(deserialize_with = "f64_or_nan")]
    pub train_loss: f64,
    /// Mean loss on the held-out split, computed in eval mode.
    #[serde(deserialize_with = "f64_or_nan")]
    pub test_loss: f64,
    /// Share of held-out rows whose arg-max is the label, in `0..=1`.
    #[serde(deserialize_with = "f64_or_nan")]
    pub test_accuracy: f64,
    /// Wall time of the epoch's training steps, in seconds.
    #[serde(deserialize_with = "f64_or_nan")]
    pub epoch_seconds: f64,
    /// Wall time of the epoch's evaluation, in seconds.
    #[serde(deserialize_with = "f64_or_nan")]
    pub eval_seconds: f64,
}

/// What `summary.json` holds.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TrainingSummary {
    /// How the model was trained: `split`, `u-shaped` or `monolithic`.
    pub mode: String,
    /// The id of the bundle that was trained.
    pub bundle_id: String,
    /// The bundle's model source (what the exporter was given).
    pub model_source: String,
    /// The cut the server's part starts at (`None` when monolithic).
    pub split: Option<usize>,
    /// The cut the host's tail starts at (U-shaped training only).
    pub tail: Option<usize>,
    /// The optimizer's configuration as it was given; this module does not interpret it.
    pub optimizer: serde_json::Value,
    /// The loss function's name.
    pub loss: String,
    /// Samples per optimizer step.
    pub batch_size: usize,
    /// The seed of the run (initialisation and shuffling).
    pub seed: u64,
    /// Every epoch of the run, in order.
    pub epochs: Vec<EpochRecord>,
    /// The test accuracy of the last epoch, in `0..=1`.
    #[serde(deserialize_with = "f64_or_nan")]
    pub final_test_accuracy: f64,
    /// The mean training loss of the last epoch.
    #[serde(deserialize_with = "f64_or_nan")]
    pub final_train_loss: f64,
    /// Median wall time of an epoch's training steps, in seconds.
    #[serde(deserialize_with = "f64_or_nan")]
    pub median_epoch_seconds: f64,
    /// Median wall time of one step, over every step of the run, in milliseconds.
    #[serde(deserialize_with = "f64_or_nan")]
    pub median_step_ms: f64,
    /// Optimizer steps over the whole run.
    pub total_steps: u64,
    /// The step a resumed run started from (`None` when it started from scratch).
    pub resumed_from_step: Option<u64>,
}

/// Reads a float that may be `null`: serde_json writes NaN and infinities as `null`, and a
/// diverged run (NaN loss) or a run without steps (NaN median) must still read back.
fn f64_or_nan<'de, D: Deserializer<'de>>(deserializer: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(deserializer)?.unwrap_or(f64::NAN))
}

/// The median of `values` (assumed free of NaN): NaN when empty, the mean of the middle two
/// when their count is even.
pub fn median(values: &[f64]) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    if sorted.len() % 2 == 1 {
        sorted[mid]
    } else {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    }
}

/// Writes `metrics.csv`: a header, then one row per epoch. Floats are written in Rust's
/// shortest form that reads back to the same value, so nothing is rounded away.
pub fn write_metrics_csv(path: &Path, epochs: &[EpochRecord]) -> anyhow::Result<()> {
    let mut csv = String::with_capacity(CSV_HEADER.len() + 1 + 96 * epochs.len());
    csv.push_str(CSV_HEADER);
    csv.push('\n');
    for e in epochs {
        // Writing into a String cannot fail.
        let _ = writeln!(
            csv,
            "{},{},{},{},{},{},{}",
            e.epoch, e.steps, e.train_loss, e.test_loss, e.test_accuracy, e.epoch_seconds, e.eval_seconds
        );
    }
    fs::write(path, csv).with_context(|| format!("writing {}", path.display()))
}

/// Writes `summary` as pretty-printed JSON.
pub fn write_summary(path: &Path, summary: &TrainingSummary) -> anyhow::Result<()> {
    let mut json = serde_json::to_string_pretty(summary)
        .with_context(|| format!("serialising the training summary for {}", path.display()))?;
    json.push('\n');
    fs::write(path, json).with_context(|| format!("writing {}", path.display()))
}

/// Reads a summary written by [`write_summary`].
pub fn read_summary(path: &Path) -> anyhow::Result<TrainingSummary> {
    let text = fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {} as a training summary", path.display()))
}

/// Plots the run into an SVG file: training and test loss per epoch on the left, test
/// accuracy (in %) per epoch on the right. Refuses an empty run.
///
/// The text is written as SVG `<text>` elements and laid out with plotters' built-in size
/// estimate, so no font needs to be installed on the machine that draws it.
pub fn plot_training(path: &Path, title: &str, epochs: &[EpochRecord]) -> anyhow::Result<()> {
    if epochs.is_empty() {
        bail!("cannot plot {}: the run has no epochs", path.display());
    }
    let svg = render_svg(title, epochs).with_context(|| format!("drawing {}", path.display()))?;
    fs::write(path, svg).with_context(|| format!("writing {}", path.display()))
}

/// Writes `metrics.csv`, `summary.json` and `training.svg` into `dir`, creating it when
/// needed. A summary without epochs is refused before anything is written.
pub fn write_all(dir: &Path, summary: &TrainingSummary) -> anyhow::Result<()> {
    if summary.epochs.is_empty() {
        bail!(
            "cannot write the training report into {}: the run has no epochs",
            dir.display()
        );
    }
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    write_metrics_csv(&dir.join(METRICS_CSV), &summary.epochs)?;
    write_summary(&dir.join(SUMMARY_JSON), summary)?;
    let cut = match (summary.split, summary.tail) {
        (Some(split), Some(tail)) => format!(", cuts {split} and {tail}"),
        (Some(split), None) => format!(", cut {split}"),
        _ => String::new(),
    };
    let title = format!("{} training of {}{cut}", summary.mode, summary.model_source);
    plot_training(&dir.join(TRAINING_SVG), &title, &summary.epochs)
}

/// Plot size in pixels: two square-ish panels side by side under a title.
const PLOT_SIZE: (u32, u32) = (1200, 520);

/// Draws both panels into an SVG document held in memory (the caller writes the file, so
/// that an I/O error names it).
fn render_svg(title: &str, epochs: &[EpochRecord]) -> anyhow::Result<String> {
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
    let accuracy: Vec<(i64, f64)> = epochs
        .iter()
        .map(|e| (e.epoch as i64, e.test_accuracy * 100.0))
        .collect();
    let loss_range = value_range(train.iter().chain(&test).map(|&(_, y)| y), None);
    let accuracy_range = value_range(accuracy.iter().map(|&(_, y)| y), Some(0.0..100.0));

    let mut svg = String::new();
    {
        let root = titled_canvas(&mut svg, PLOT_SIZE, title)?;
        let (left, right) = root.split_horizontally(PLOT_SIZE.0 / 2);

        let mut chart = chart_on(&left, 40)
            .caption("Loss per epoch", ("sans-serif", 18))
            .build_cartesian_2d(x_range.clone(), loss_range)?;
        chart
            .configure_mesh()
            .x_desc("epoch")
            .y_desc("loss")
            .x_labels(x_label_count(epochs.len()))
            .x_label_formatter(&epoch_label)
            .draw()?;
        draw_marked_series(&mut chart, &train, BLUE, "train loss", Marker::Circle(3))?;
        draw_marked_series(&mut chart, &test, RED, "test loss", Marker::Circle(3))?;
        draw_legend(&mut chart, SeriesLabelPosition::UpperRight)?;

        let mut chart = chart_on(&right, 40)
            .caption("Test accuracy per epoch", ("sans-serif", 18))
            .build_cartesian_2d(x_range, accuracy_range)?;
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
mod tests {
    use super::*;

    fn epoch(epoch: usize, train_loss: f64, test_loss: f64, test_accuracy: f64) -> EpochRecord {
        EpochRecord {
            epoch,
            steps: 469,
            train_loss,
            test_loss,
            test_accuracy,
            epoch_seconds: 12.5,
            eval_seconds: 0.75,
        }
    }

    fn summary(epochs: Vec<EpochRecord>) -> TrainingSummary {
        TrainingSummary {
            mode: "split".into(),
            bundle_id: "digits-cnn-3f2a".into(),
            model_source: "tests.models:digits_cnn".into(),
            split: Some(3),
            tail: None,
            optimizer: serde_json::json!({"kind": "sgd", "lr": 0.05, "momentum": 0.9}),
            loss: "cross_entropy".into(),
            batch_size: 128,
            seed: 7,
            final_test_accuracy: epochs.last().map_or(f64::NAN, |e| e.test_accuracy),
            final_train_loss: epochs.last().map_or(f64::NAN, |e| e.train_loss),
            median_epoch_seconds: median(&epochs.iter().map(|e| e.epoch_seconds).collect::<Vec<_>>()),
            median_step_ms: 26.65,
            total_steps: epochs.iter().map(|e| e.steps).sum(),
            resumed_from_step: Some(100),
            epochs,
        }
    }

    #[test]
    fn metrics_csv_has_a_header_and_one_full_precision_row_per_epoch() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(METRICS_CSV);
        let epochs = [
            epoch(1, 0.123456789012345, 0.1, 0.9876),
            EpochRecord {
                steps: 3,
                epoch_seconds: 1e-7,
                eval_seconds: 2.0,
                ..epoch(2, 1.0 / 3.0, 0.05, 1.0)
            },
        ];
        write_metrics_csv(&path, &epochs).unwrap();
        assert_eq!(
            fs::read_to_string(&path).unwrap(),
            "epoch,steps,train_loss,test_loss,test_accuracy,epoch_seconds,eval_seconds\n\
             1,469,0.123456789012345,0.1,0.9876,12.5,0.75\n\
             2,3,0.3333333333333333,0.05,1,0.0000001,2\n"
        );
    }

    #[test]
    fn summary_json_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(SUMMARY_JSON);
        let written = summary(vec![epoch(1, 0.5, 0.4, 0.8), epoch(2, 0.25, 0.3, 0.9)]);
        write_summary(&path, &written).unwrap();
        let text = fs::read_to_string(&path).unwrap();
        assert!(text.contains("\n  \"mode\": \"split\""), "not pretty-printed: {text}");
        assert_eq!(read_summary(&path).unwrap(), written);
    }

    #[test]
    fn summary_with_nan_reads_back_as_nan() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(SUMMARY_JSON);
        let mut written = summary(vec![epoch(1, f64::NAN, f64::INFINITY, 0.1)]);
        written.median_step_ms = f64::NAN;
        written.split = None;
        write_summary(&path, &written).unwrap();
        let read = read_summary(&path).unwrap();
        assert!(read.epochs[0].train_loss.is_nan());
        assert!(read.epochs[0].test_loss.is_nan());
        assert!(read.median_step_ms.is_nan());
        assert_eq!(read.split, None);
        assert_eq!(read.epochs[0].test_accuracy, 0.1);
    }

    #[test]
    fn read_summary_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nowhere.json");
        let err = format!("{:#}", read_summary(&missing).unwrap_err());
        assert!(err.contains("nowhere.json"), "{err}");

        let broken = dir.path().join("broken.json");
        fs::write(&broken, "{\"mode\": 3}").unwrap();
        let err = format!("{:#}", read_summary(&broken).unwrap_err());
        assert!(err.contains("broken.json"), "{err}");
    }

    fn assert_plot_looks_right(svg: &str) {
        let start = svg.trim_start();
        assert!(
            start.starts_with("<svg") || start.starts_with("<?xml"),
            "not an SVG: {}",
            &svg[..svg.len().min(80)]
        );
        assert!(svg.trim_end().ends_with("</svg>"));
        for text in [
            "epoch",
            "loss",
            "test accuracy (%)",
            "train loss",
            "test loss",
            "Loss per epoch",
        ] {
            assert!(
                svg.contains(&format!(">{text}<")) || svg.contains(&format!(">\n{text}\n<")),
                "no text {text:?} in the plot"
            );
        }
        assert!(
            svg.contains("<polyline") || svg.contains("<path"),
            "no line in the plot"
        );
        assert!(svg.contains("<circle"), "no point markers in the plot");
    }

    #[test]
    fn plot_has_both_panels_labels_legend_and_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(TRAINING_SVG);
        let epochs: Vec<_> = (1..=5)
            .map(|i| epoch(i, 2.0 / i as f64, 1.8 / i as f64, 0.5 + 0.09 * i as f64))
            .collect();
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
        let epochs = [
            epoch(1, 0.9, 0.8, 0.6),
            epoch(2, f64::NAN, f64::INFINITY, 0.1),
            epoch(3, 0.5, 0.4, 0.7),
        ];
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

    #[test]
    fn write_all_creates_the_directory_and_all_three_files() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("runs").join("split-3");
        let written = summary(vec![epoch(1, 0.5, 0.4, 0.8), epoch(2, 0.25, 0.3, 0.9)]);
        write_all(&out, &written).unwrap();
        assert_eq!(read_summary(&out.join(SUMMARY_JSON)).unwrap(), written);
        assert_eq!(fs::read_to_string(out.join(METRICS_CSV)).unwrap().lines().count(), 3);
        let svg = fs::read_to_string(out.join(TRAINING_SVG)).unwrap();
        assert_plot_looks_right(&svg);
        assert!(svg.contains("split training of tests.models:digits_cnn, cut 3"));
    }

    #[test]
    fn write_all_refuses_an_empty_run_before_writing() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("empty-run");
        let err = write_all(&out, &summary(Vec::new())).unwrap_err().to_string();
        assert!(err.contains("no epochs") && err.contains("empty-run"), "{err}");
        assert!(!out.exists());
    }

    #[test]
    fn median_cases() {
        assert!(median(&[]).is_nan());
        assert_eq!(median(&[4.0]), 4.0);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&[-1.0, 5.0]), 2.0);
        assert_eq!(median(&[7.0, 7.0, 7.0, 1.0]), 7.0);
    }
}
