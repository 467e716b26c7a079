//! Runs a bundle split at every cut against its reference, as the host and server check it.

use std::time::Instant;

use crate::bundle::Bundle;
use crate::device::{device_name, DeviceSpec};
use crate::error::Result;
use crate::stages::{LoadedStages, StageRange};

/// Largest relative error against the reference that counts as a match on the CPU.
pub const TOLERANCE: f64 = 1e-5;

/// The same on CUDA. libtorch lets cuDNN run float32 convolutions in TF32 by default (inputs
/// rounded to 10 mantissa bits; tch exposes no switch), so outputs differ from the CPU
/// reference around 1e-3 relative (5.8e-4 measured for mobilenet_v3_small on an H100), and
/// kernels may differ from one call to the next, so splits agree closely, not bit for bit.
pub const CUDA_TOLERANCE: f64 = 5e-3;

/// The result of running one split point.
#[derive(Debug, Clone)]
pub struct SplitCheck {
    /// Cut index.
    pub split: usize,
    /// Cut name.
    pub name: String,
    /// Bytes of tensors crossing the cut (this batch).
    pub boundary_bytes: usize,
    /// Milliseconds for stages [0, split).
    pub prefix_ms: f64,
    /// Milliseconds for stages [split, N).
    pub suffix_ms: f64,
    /// Largest error against the reference, relative to its largest magnitude.
    pub relative_error: f64,
    /// Whether the output is bit-identical to the one of split 0.
    pub identical_to_first: bool,
}

/// Every split point of a bundle, run at one batch size on one device.
#[derive(Debug, Clone)]
pub struct VerifyReport {
    /// The device the stages ran on.
    pub device: String,
    /// The batch size.
    pub batch: i64,
    /// The sequence lengths of the references run (bundles with a sequence; empty otherwise).
    pub seq_lens: Vec<i64>,
    /// Milliseconds to load every stage.
    pub load_ms: f64,
    /// One row per split point.
    pub splits: Vec<SplitCheck>,
    /// Largest relative error that counts as a match on this device.
    pub tolerance: f64,
    /// Whether every split must give the same bits as split 0 (on the CPU it must).
    pub require_identical: bool,
}

impl VerifyReport {
    /// True when every split matches the reference within the device's tolerance and, on
    /// the CPU, all agree bit for bit.
    pub fn passed(&self) -> bool {
        self.splits.iter().all(|s| s.relative_error <= self.tolerance && (s.identical_to_first || !self.require_identical))
    }
}

/// Loads every stage on `device` and runs the reference input at `batch` split at each cut
/// (stages [0, s) then [s, N)), comparing the output with the reference output. With a
/// sequence, every reference at `batch` is run (one per length): a split's row holds its
/// largest error and the sum of its times over them.
pub fn verify_splits(bundle: &Bundle, device: DeviceSpec, batch: i64) -> Result<VerifyReport> {
    let references = bundle.references_at(batch);
    if references.is_empty() {
        bundle.reference(batch)?; // the error naming the batch sizes there are
    }
    let started = Instant::now();
    let stages = LoadedStages::load(bundle, StageRange::all(bundle), device)?;
    let load_ms = ms(started);
    let mut splits: Vec<SplitCheck> = Vec::new();
    for info in &references {
        let (input, reference) = bundle.load_reference(info)?;
        // A pass untimed first: the first run of a model pays for libtorch's warm-up (memory
        // pools, kernel choices), which would otherwise land on cut 0's row.
        stages.run(StageRange::all(bundle), &input)?;
        let mut first = None;
        for split in 0..=bundle.stage_count() {
            let t = Instant::now();
            let middle = stages.run(StageRange::prefix(split), &input)?;
            let prefix_ms = ms(t);
            let t = Instant::now();
            let output = stages.run(StageRange::suffix(bundle, split), &middle)?;
            let suffix_ms = ms(t);
            let check = SplitCheck {
                split,
                name: bundle.cut(split).name.clone(),
                boundary_bytes: middle.tensor_bytes(),
                prefix_ms,
                suffix_ms,
                relative_error: output.max_relative_error(&reference),
                identical_to_first: first.as_ref().is_none_or(|f: &crate::Boundary| output.bit_identical(f)),
            };
            match splits.get_mut(split) {
                Some(row) => row.merge(check),
                None => splits.push(check),
            }
            if first.is_none() {
                first = Some(output);
            }
        }
    }
    let on_cpu = stages.device() == tch::Device::Cpu;
    Ok(VerifyReport {
        device: device_name(stages.device()),
        batch,
        seq_lens: references.iter().filter_map(|r| r.seq_len).collect(),
        load_ms,
        splits,
        tolerance: if on_cpu { TOLERANCE } else { CUDA_TOLERANCE },
        require_identical: on_cpu,
    })
}

impl SplitCheck {
    /// One split's row over several references: the worst error, the summed times, bit
    /// identity only if every reference had it.
    fn merge(&mut self, other: SplitCheck) {
        self.boundary_bytes = self.boundary_bytes.max(other.boundary_bytes);
        self.prefix_ms += other.prefix_ms;
        self.suffix_ms += other.suffix_ms;
        self.relative_error = self.relative_error.max(other.relative_error);
        self.identical_to_first &= other.identical_to_first;
    }
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}
