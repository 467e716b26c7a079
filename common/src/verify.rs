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

/// Largest relative error of generation logits that counts as a match on the CPU: a cached
/// decode step sums its attention in another order than transformers' (issue 40's bound).
pub const GENERATION_TOLERANCE: f64 = 1e-4;

/// A bundle's generation stages (`--generation`) run whole on one device, teacher-forced
/// over the exporter's reference: its prompt in one step, then one token a step with the
/// caches on the device, every step's logits against transformers' with its own cache.
#[derive(Debug, Clone)]
pub struct GenerationCheck {
    /// The device the stages ran on.
    pub device: String,
    /// Tokens of the prompt, run in one step.
    pub prompt: i64,
    /// Decode steps after it.
    pub steps: i64,
    /// Largest error against the reference logits, relative to their largest magnitude.
    pub relative_error: f64,
    /// Largest relative error that counts as a match on this device.
    pub tolerance: f64,
    /// The median decode step's time (the whole model, one row), in milliseconds.
    pub step_ms: f64,
}

impl GenerationCheck {
    /// Whether the logits match the reference within the device's tolerance.
    pub fn passed(&self) -> bool {
        self.relative_error <= self.tolerance
    }
}

/// Runs `bundle`'s generation stages on `device` against their reference (its first row);
/// `None` where the bundle has none.
pub fn verify_generation(bundle: &Bundle, device: DeviceSpec) -> Result<Option<GenerationCheck>> {
    use crate::generation::GenerationStages;
    use tch::{Kind, Tensor};
    let Some(info) = bundle.manifest().generation.as_ref() else { return Ok(None) };
    let reference = &info.reference;
    let bad = |message: String| crate::error::BundleError::Reference { file: reference.file.clone(), message };
    let tensors = Tensor::read_safetensors(bundle.dir().join(&reference.file)).map_err(|e| bad(e.to_string()))?;
    let get = |name: &str| tensors.iter().find(|(n, _)| n == name).map(|(_, t)| t.narrow(0, 0, 1)).ok_or_else(|| bad(format!("no {name}")));
    let (ids, want) = (get("input_ids")?, get("logits")?);
    let total = ids.size()[1];
    let stages = GenerationStages::load(bundle, StageRange::new(0, info.stages.len()), device)?;
    stages.warm_up()?;
    let mut caches = stages.new_caches(1, reference.max_len)?;
    let positions = |from: i64, tokens: i64| Tensor::arange_start(from, from + tokens, (Kind::Int64, tch::Device::Cpu)).unsqueeze(0);
    let mut logits = vec![stages.step(&ids.narrow(1, 0, reference.prompt), &positions(0, reference.prompt), &mut caches)?];
    let mut step_ms = Vec::new();
    for at in reference.prompt..total {
        let started = Instant::now();
        let step = stages.step(&ids.narrow(1, at, 1), &positions(at, 1), &mut caches)?.to_device(tch::Device::Cpu);
        step_ms.push(ms(started));
        logits.push(step);
    }
    let got = Tensor::cat(&logits.iter().map(|l| l.to_device(tch::Device::Cpu)).collect::<Vec<_>>(), 1).to_kind(Kind::Double);
    let want = want.to_kind(Kind::Double);
    let difference = got.f_sub(&want).map_err(|e| bad(format!("logits {:?} against the reference's {:?}: {e}", got.size(), want.size())))?;
    let relative_error = difference.abs().max().double_value(&[]) / want.abs().max().double_value(&[]);
    step_ms.sort_by(f64::total_cmp);
    let on_cpu = stages.device() == tch::Device::Cpu;
    Ok(Some(GenerationCheck {
        device: device_name(stages.device()),
        prompt: reference.prompt,
        steps: total - reference.prompt,
        relative_error,
        tolerance: if on_cpu { GENERATION_TOLERANCE } else { CUDA_TOLERANCE },
        step_ms: step_ms.get(step_ms.len() / 2).copied().unwrap_or(0.0),
    }))
}
