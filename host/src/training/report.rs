//! The files that hold a training run's records: `metrics.csv` (one row per epoch, an
//! [`EpochRecord`], which `crate::records` holds beside the other records that progress
//! events and plots read) and `summary.json` (`training.svg` is drawn by `plots::training`).
//!
//! This module needs no libtorch: the training loop measures, this module only writes.

use std::fmt::Write as _;
use std::fs;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{HostError, Result};
use crate::records::{f64_or_nan, EpochRecord};

/// The per-epoch table's file name inside the output directory.
pub const METRICS_CSV: &str = "metrics.csv";
/// The summary's file name inside the output directory.
pub const SUMMARY_JSON: &str = "summary.json";
/// The plot's file name inside the output directory.
pub const TRAINING_SVG: &str = "training.svg";

/// The header line of `metrics.csv`, in the order of [`EpochRecord`]'s fields.
const CSV_HEADER: &str = "epoch,steps,train_loss,test_loss,test_accuracy,epoch_seconds,eval_seconds";

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

impl TrainingSummary {
    /// The run in one line, ending with where its files are.
    pub fn closing_line(&self, output: &Path) -> String {
        format!(
            "{} epochs, {} steps: final test accuracy {:.2}%, median epoch {:.2} s, median step {:.1} ms; results in {}",
            self.epochs.len(),
            self.total_steps,
            self.final_test_accuracy * 100.0,
            self.median_epoch_seconds,
            self.median_step_ms,
            output.display()
        )
    }
}

/// Writes `metrics.csv`: a header, then one row per epoch. Floats are written in Rust's
/// shortest form that reads back to the same value, so nothing is rounded away.
pub fn write_metrics_csv(path: &Path, epochs: &[EpochRecord]) -> Result<()> {
    let mut csv = String::with_capacity(CSV_HEADER.len() + 1 + 96 * epochs.len());
    csv.push_str(CSV_HEADER);
    csv.push('\n');
    for e in epochs {
        // Writing into a String cannot fail.
        let _ = writeln!(csv, "{},{},{},{},{},{},{}", e.epoch, e.steps, e.train_loss, e.test_loss, e.test_accuracy, e.epoch_seconds, e.eval_seconds);
    }
    fs::write(path, csv).map_err(|e| HostError::write(path, e))
}

/// Writes `summary` as pretty-printed JSON.
pub fn write_summary(path: &Path, summary: &TrainingSummary) -> Result<()> {
    let mut json = serde_json::to_string_pretty(summary)
        .map_err(|e| HostError::File { path: path.into(), message: format!("serialising the training summary: {e}") })?;
    json.push('\n');
    fs::write(path, json).map_err(|e| HostError::write(path, e))
}

/// Reads a summary written by [`write_summary`].
pub fn read_summary(path: &Path) -> Result<TrainingSummary> {
    let text = fs::read_to_string(path).map_err(|e| HostError::read(path, e))?;
    serde_json::from_str(&text).map_err(|e| HostError::File { path: path.into(), message: format!("not a training summary: {e}") })
}

#[cfg(test)]
pub(crate) mod fixtures {
    use super::*;

    pub(crate) fn epoch(epoch: usize, train_loss: f64, test_loss: f64, test_accuracy: f64) -> EpochRecord {
        EpochRecord { epoch, steps: 469, train_loss, test_loss, test_accuracy, epoch_seconds: 12.5, eval_seconds: 0.75 }
    }

    pub(crate) fn summary(epochs: Vec<EpochRecord>) -> TrainingSummary {
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
            median_epoch_seconds: cleave_common::stats::median(&epochs.iter().map(|e| e.epoch_seconds).collect::<Vec<_>>()).unwrap_or(f64::NAN),
            median_step_ms: 26.65,
            total_steps: epochs.iter().map(|e| e.steps).sum(),
            resumed_from_step: Some(100),
            epochs,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fixtures::{epoch, summary};
    use super::*;

    #[test]
    fn metrics_csv_has_a_header_and_one_full_precision_row_per_epoch() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(METRICS_CSV);
        let epochs = [
            epoch(1, 0.123456789012345, 0.1, 0.9876),
            EpochRecord { steps: 3, epoch_seconds: 1e-7, eval_seconds: 2.0, ..epoch(2, 1.0 / 3.0, 0.05, 1.0) },
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
}
