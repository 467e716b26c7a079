//! The profiles a fleet is planned from, as files: a model's server stages measured on a
//! whole GPU at several batch sizes (`cleave-stage-profile/1`), and an edge device's times for
//! a model's stages (`cleave-edge-profile/1`).

use std::path::Path;

use serde::{Deserialize, Serialize};

/// A model's stages as a server runs them, measured on a whole GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageProfile {
    /// `cleave-stage-profile/1`.
    pub format: String,
    /// What they were measured on.
    pub device: String,
    /// The batch sizes measured, ascending.
    pub batches: Vec<u32>,
    /// Each stage.
    pub stages: Vec<Stage>,
    /// Each cut, `0..=stages` (cut `s`: the edge runs stages `[0, s)`); the last one's bytes
    /// are the result's.
    pub cuts: Vec<Cut>,
    /// The server's own time per request besides the stages (decoding it, merging and
    /// splitting batches, answering), milliseconds: measured by `host plan --fleet-profile
    /// --measure N`, 0 when not. Counted as if it ran on the slice: true of a CPU server; on
    /// a GPU it overlaps the compute, so it overstates there.
    #[serde(default)]
    pub request_ms: f64,
}

/// One stage.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Stage {
    /// Milliseconds per batch at each of `batches`.
    pub ms: Vec<f64>,
    /// Its parameters and buffers, bytes.
    pub weight_bytes: f64,
    /// The most memory its activations take per sample while it runs, bytes.
    pub activation_bytes: f64,
}

/// One cut.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cut {
    /// Whether a split may be made here.
    pub usable: bool,
    /// Whether the server merges requests split here into batches (a batch-first boundary
    /// and output).
    pub batchable: bool,
    /// Bytes on the wire per sample (encoded with the edges' codec).
    pub wire_bytes: f64,
}

/// An edge device's times for one model's stages.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EdgeProfile {
    /// `cleave-edge-profile/1`.
    pub format: String,
    /// What they were measured on.
    pub device: String,
    /// Milliseconds of each stage for one request.
    pub stage_ms: Vec<f64>,
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
}

fn finite_non_negative(what: &str, values: impl IntoIterator<Item = f64>) -> Result<(), String> {
    match values.into_iter().find(|v| !(v.is_finite() && *v >= 0.0)) {
        Some(v) => Err(format!("{what}: {v} is not a time or size")),
        None => Ok(()),
    }
}

impl StageProfile {
    /// The format this is.
    pub const FORMAT: &str = "cleave-stage-profile/1";

    /// Reads and checks a stage profile.
    pub fn read(path: &Path) -> Result<Self, String> {
        let profile: Self = read_json(path)?;
        profile.check().map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(profile)
    }

    /// Checks the shapes and values agree.
    pub fn check(&self) -> Result<(), String> {
        if self.format != Self::FORMAT {
            return Err(format!("format {:?}: expected {:?}", self.format, Self::FORMAT));
        }
        if self.batches.first() != Some(&1) || self.batches.windows(2).any(|w| w[0] >= w[1]) {
            return Err(format!("batches {:?}: expected ascending sizes, the first 1", self.batches));
        }
        if self.stages.is_empty() || self.cuts.len() != self.stages.len() + 1 {
            return Err(format!("{} stages and {} cuts: expected stages + 1 cuts", self.stages.len(), self.cuts.len()));
        }
        for (i, stage) in self.stages.iter().enumerate() {
            if stage.ms.len() != self.batches.len() {
                return Err(format!("stages[{i}].ms: {} times for {} batch sizes", stage.ms.len(), self.batches.len()));
            }
            finite_non_negative(&format!("stages[{i}]"), stage.ms.iter().copied().chain([stage.weight_bytes, stage.activation_bytes]))?;
            // A stage that takes no time would make a model's capacity infinite.
            if stage.ms.iter().any(|&ms| ms <= 0.0) {
                return Err(format!("stages[{i}].ms: {:?}: every time must be above 0", stage.ms));
            }
        }
        finite_non_negative("cuts", self.cuts.iter().map(|c| c.wire_bytes))?;
        finite_non_negative("request_ms", [self.request_ms])
    }

    /// Milliseconds a batch of `samples` takes on a slice of `compute`: the stages `[cut, N)`
    /// (see [`Self::server_ms_at`]) and the server's own time for each request.
    pub fn batch_ms(&self, cut: usize, samples: u32, compute: f64) -> f64 {
        self.server_ms_at(cut, samples) / compute + f64::from(samples) * self.request_ms
    }

    /// Milliseconds the server's stages `[cut, N)` take for a batch at `batch` (one of
    /// `batches`), on a whole GPU.
    pub fn server_ms(&self, cut: usize, batch: usize) -> f64 {
        self.stages[cut..].iter().map(|s| s.ms[batch]).sum()
    }

    /// Milliseconds the server's stages `[cut, N)` take for a batch of `samples`, on a whole
    /// GPU: linear between the measured batch sizes, in proportion beyond the largest.
    pub fn server_ms_at(&self, cut: usize, samples: u32) -> f64 {
        let n = f64::from(samples);
        let sizes: Vec<f64> = self.batches.iter().map(|&b| f64::from(b)).collect();
        let at = |i: usize| self.server_ms(cut, i);
        match sizes.iter().position(|&b| b >= n) {
            Some(0) => at(0),
            Some(i) => at(i - 1) + (at(i) - at(i - 1)) * (n - sizes[i - 1]) / (sizes[i] - sizes[i - 1]),
            None => at(sizes.len() - 1) * n / sizes[sizes.len() - 1],
        }
    }

    /// Bytes the server's stages `[cut, N)` hold at a batch of `samples`: every weight, and the
    /// largest stage's activations.
    pub fn server_bytes(&self, cut: usize, samples: u32) -> f64 {
        let weights: f64 = self.stages[cut..].iter().map(|s| s.weight_bytes).sum();
        let activations = self.stages[cut..].iter().map(|s| s.activation_bytes).fold(0.0, f64::max);
        weights + activations * f64::from(samples)
    }

    /// The result's bytes per sample.
    pub fn result_bytes(&self) -> f64 {
        self.cuts.last().map_or(0.0, |c| c.wire_bytes)
    }
}

impl EdgeProfile {
    /// The format this is.
    pub const FORMAT: &str = "cleave-edge-profile/1";

    /// Reads and checks an edge profile.
    pub fn read(path: &Path) -> Result<Self, String> {
        let profile: Self = read_json(path)?;
        if profile.format != Self::FORMAT {
            return Err(format!("{}: format {:?}: expected {:?}", path.display(), profile.format, Self::FORMAT));
        }
        finite_non_negative(&format!("{}: stage_ms", path.display()), profile.stage_ms.iter().copied())?;
        Ok(profile)
    }

    /// Milliseconds the edge's stages `[0, cut)` take.
    pub fn prefix_ms(&self, cut: usize) -> f64 {
        self.stage_ms[..cut].iter().sum()
    }
}
