//! The records a command keeps of what happened, which its progress events carry and its
//! summary, metrics and plots are made of: one epoch of training ([`EpochRecord`]); what
//! `split: auto` planned at start-up ([`Planned`], with [`ProfilingTime`]), how it moved the
//! split ([`SplitMove`]) and probed the link ([`Probes`]); what `codec: auto` measured
//! ([`CodecChoiceReport`]).
//!
//! Data only: `training` and `planning` make these, `progress`, `report` and `plots` read
//! them, and this module uses none of them (only the planner's model, whose predictions,
//! objective and codec costs the records hold).

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize};

use crate::planner::codec_cost::CodecCost;
use crate::planner::{CutPrediction, Objective};

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

/// Reads a float that may be `null`: serde_json writes NaN and infinities as `null`, and a
/// diverged run (NaN loss) or a run without steps (NaN median) must still read back.
pub(crate) fn f64_or_nan<'de, D: Deserializer<'de>>(deserializer: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(deserializer)?.unwrap_or(f64::NAN))
}

/// What the planner chose at start-up (in `summary.json`).
#[derive(Debug, Clone, Serialize)]
pub struct Planned {
    /// The objective.
    pub objective: Objective,
    /// The cut chosen from the profiles.
    pub cut: usize,
    /// With `codec: auto`, the codec the cut was chosen with (requests choose theirs as the
    /// rate moves).
    pub codec: Option<String>,
    /// Its predicted end-to-end latency, ms.
    pub predicted_ms: f64,
    /// Its predicted pipelined throughput, requests/s.
    pub predicted_rps: f64,
    /// The probed link, Mbit/s.
    pub link_mbit_per_s: f64,
    /// The probed round trip, ms.
    pub rtt_ms: f64,
    /// How long profiling took.
    pub profiling: ProfilingTime,
    /// The prediction for every cut, `0..=N`, from the same profiles.
    pub predictions: Vec<CutPrediction>,
}

/// One move of the split while running (in `summary.json`).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct SplitMove {
    /// The request whose measurement triggered it (0 for a probe's); later requests use the new cut.
    pub after_request: u64,
    /// From this cut.
    pub from: usize,
    /// To this cut.
    pub to: usize,
    /// The bandwidth estimate that moved it, Mbit/s.
    pub mbit_per_s: f64,
}

/// The bandwidth probes of a run (in `summary.json`).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Probes {
    /// Probes sent.
    pub count: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Their time, start to answer.
    pub seconds: f64,
}

/// How long profiling took, in seconds (in `summary.json`'s `planned`).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct ProfilingTime {
    /// Loading and timing every stage on the edge, and encoding its boundaries.
    pub edge_s: f64,
    /// The server's `Profile`.
    pub server_s: f64,
    /// The link's round trip and bandwidth (`Echo`).
    pub link_s: f64,
}

/// `codec: auto` in `summary.json`.
#[derive(Debug, Clone, Serialize)]
pub struct CodecChoiceReport {
    /// The codecs it chose among (those the server accepts).
    pub candidates: Vec<String>,
    /// The rate estimated at the end, Mbit/s.
    pub mbit_per_s: f64,
    /// Each candidate's cost, by the cut it was measured at.
    pub costs: BTreeMap<usize, Vec<CodecCost>>,
}
