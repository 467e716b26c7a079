//! Loading a range of stages onto a device and running it on a boundary.
//!
//! Stages run with gradients off and in eval mode for inference (training, in
//! [`crate::training`], runs the same chain in training mode with gradients on). Every boundary is checked against the
//! manifest before the first stage runs (a wrong batch size or shape names the expected one)
//! and the result is checked again after the last, so a stage file that disagrees with its
//! manifest cannot pass silently.

use std::fmt;
use std::ops::ControlFlow;
use std::time::Instant;

use tch::{CModule, IValue};

use crate::bundle::Bundle;
use crate::device::DeviceSpec;
use crate::error::{BoundaryProblem, BundleError, Result};
use crate::value::{synthetic_inputs, Boundary, Value};

/// Stages `[start, end)`: runs from cut `start` to cut `end`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StageRange {
    /// First stage (and the cut it starts from).
    pub start: usize,
    /// One past the last stage (and the cut it ends at).
    pub end: usize,
}

impl StageRange {
    /// Stages `[start, end)`.
    pub fn new(start: usize, end: usize) -> Self {
        Self { start, end }
    }

    /// Every stage of `bundle`.
    pub fn all(bundle: &Bundle) -> Self {
        Self::new(0, bundle.stage_count())
    }

    /// The edge's part when splitting at cut `split`.
    pub fn prefix(split: usize) -> Self {
        Self::new(0, split)
    }

    /// The server's part when splitting at cut `split`.
    pub fn suffix(bundle: &Bundle, split: usize) -> Self {
        Self::new(split, bundle.stage_count())
    }

    /// Number of stages.
    pub fn len(&self) -> usize {
        self.end.saturating_sub(self.start)
    }

    /// True when it runs no stage (a split at 0 or N leaves one side empty).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `inner` lies within this range.
    pub fn contains(&self, inner: StageRange) -> bool {
        self.start <= inner.start && inner.start <= inner.end && inner.end <= self.end
    }
}

impl fmt::Display for StageRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}, {})", self.start, self.end)
    }
}

/// Stages loaded on a device, ready to run any sub-range.
pub struct LoadedStages {
    bundle: Bundle,
    range: StageRange,
    device: tch::Device,
    modules: Vec<CModule>,
}

impl fmt::Debug for LoadedStages {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoadedStages").field("bundle", &self.bundle.id()).field("range", &self.range).field("device", &self.device).finish()
    }
}

impl LoadedStages {
    /// Loads stages `range` of `bundle` onto `device` for inference, in eval mode: each
    /// stage's frozen inference version where the bundle has one.
    pub fn load(bundle: &Bundle, range: StageRange, device: DeviceSpec) -> Result<Self> {
        Self::load_files(bundle, range, device, true)
    }

    /// Loads the trainable stages `range` (the ones with parameters, which split training
    /// runs), in eval mode.
    pub fn load_trainable(bundle: &Bundle, range: StageRange, device: DeviceSpec) -> Result<Self> {
        Self::load_files(bundle, range, device, false)
    }

    fn load_files(bundle: &Bundle, range: StageRange, device: DeviceSpec, inference: bool) -> Result<Self> {
        if !StageRange::all(bundle).contains(range) {
            return Err(BundleError::InvalidRange {
                start: range.start,
                end: range.end,
                reason: format!("the bundle has {} stages (cuts 0..={})", bundle.stage_count(), bundle.stage_count()),
            });
        }
        let device = device.resolve()?;
        let started = Instant::now();
        let modules = bundle.manifest().stages[range.start..range.end]
            .iter()
            .map(|stage| load_module(bundle.dir(), stage.index, stage.inference_file.as_ref().filter(|_| inference).unwrap_or(&stage.file), device))
            .collect::<Result<Vec<_>>>()?;
        tracing::debug!(range = %range, ?device, elapsed_ms = started.elapsed().as_millis() as u64, "stages loaded");
        Ok(Self { bundle: bundle.clone(), range, device, modules })
    }

    /// The device the stages run on.
    pub fn device(&self) -> tch::Device {
        self.device
    }

    /// Waits for the work queued on their device (none to wait for on the CPU).
    pub fn synchronize(&self) {
        synchronize(self.device);
    }

    /// The stages loaded.
    pub fn range(&self) -> StageRange {
        self.range
    }

    /// The bundle they come from.
    pub fn bundle(&self) -> &Bundle {
        &self.bundle
    }

    /// Runs stages `range` (within the loaded ones) on `input`, the boundary at cut
    /// `range.start`; returns the boundary at cut `range.end`, on this device.
    pub fn run(&self, range: StageRange, input: &Boundary) -> Result<Boundary> {
        tch::no_grad(|| self.run_chain(range, input, |_| ()))
    }

    /// [`LoadedStages::run`], asking `go_on()` before each stage: `None` when it said stop
    /// (the stages before it ran, the rest did not), so work nobody waits for any more ends
    /// at the next stage boundary.
    pub fn run_while(&self, range: StageRange, input: &Boundary, mut go_on: impl FnMut() -> bool) -> Result<Option<Boundary>> {
        tch::no_grad(|| self.chain(range, input, |_| if go_on() { ControlFlow::Continue(()) } else { ControlFlow::Break(()) }))
    }

    /// Runs every loaded stage twice on synthetic inputs of each batch size, so that no
    /// request pays for a cold start: TorchScript optimises a module over its first runs
    /// (several times slower), and a device allocates its buffers and kernels. Only stages
    /// loaded from cut 0 can be fed (their inputs are the model's); others are left as they are.
    pub fn warm_up(&self, batches: &[i64]) -> Result<()> {
        if self.range.start != 0 || self.range.is_empty() {
            return Ok(());
        }
        let started = Instant::now();
        for &batch in batches {
            let input = synthetic_inputs(&self.bundle.manifest().inputs, self.bundle.sizes_at(batch))?;
            for _ in 0..2 {
                self.run(self.range, &input)?;
            }
        }
        tracing::debug!(range = %self.range, ?batches, elapsed_ms = started.elapsed().as_millis() as u64, "stages warmed up");
        Ok(())
    }

    /// Runs stages `range` in the current grad mode. `enter_stage(i)` is called before stage
    /// `i` runs and what it returns is held until the stage returns (training seeds the
    /// random generator there and holds its lock).
    pub(crate) fn run_chain<G>(&self, range: StageRange, input: &Boundary, mut enter_stage: impl FnMut(usize) -> G) -> Result<Boundary> {
        let Some(output) = self.chain(range, input, |i| ControlFlow::Continue(enter_stage(i)))? else {
            unreachable!("a chain that is never told to stop runs to its end")
        };
        Ok(output)
    }

    /// Runs stages `range`; `enter_stage(i)` before stage `i` either stops the chain there
    /// (`None`) or returns what is held until the stage returns.
    fn chain<G>(&self, range: StageRange, input: &Boundary, mut enter_stage: impl FnMut(usize) -> ControlFlow<(), G>) -> Result<Option<Boundary>> {
        if !self.range.contains(range) {
            return Err(BundleError::InvalidRange { start: range.start, end: range.end, reason: format!("the loaded stages are {}", self.range) });
        }
        self.bundle.check_boundary(range.start, input)?;
        let mut values: Vec<IValue> = input.values.iter().map(|(_, v)| v.to_device(self.device).to_ivalue()).collect();
        let stages = &self.bundle.manifest().stages;
        let modules = &self.modules[range.start - self.range.start..range.end - self.range.start];
        for (stage, module) in stages[range.start..range.end].iter().zip(modules) {
            let failed = |message: String| BundleError::StageFailed { index: stage.index, name: stage.name.clone(), message };
            let ControlFlow::Continue(guard) = enter_stage(stage.index) else { return Ok(None) };
            let returned = module.forward_is(&values).map_err(|e| failed(first_line(&e.to_string())))?;
            drop(guard);
            values = match returned {
                IValue::Tuple(items) => items,
                other => return Err(failed(format!("returned {other:?} instead of a tuple"))),
            };
        }
        let cut = self.bundle.cut(range.end);
        if values.len() != cut.values.len() {
            return Err(BundleError::BoundaryMismatch {
                cut: range.end,
                cut_name: cut.name.clone(),
                problem: Box::new(BoundaryProblem::StageValues { got: values.len(), want: cut.values.len() }),
            });
        }
        let values =
            cut.values.iter().zip(values).map(|(spec, v)| Ok((spec.name.clone(), Value::from_ivalue(v, &spec.name)?))).collect::<Result<Vec<_>>>()?;
        let output = Boundary { values };
        if !range.is_empty() {
            self.bundle.check_boundary(range.end, &output)?;
        }
        Ok(Some(output))
    }

    /// Times every loaded stage on `input` (the boundary at the first loaded cut): one
    /// warm-up pass stage by stage, whose boundary at every cut `at_cut(k, boundary)` sees
    /// (the planner measures their size after the codec there), then `repeats` passes through
    /// the whole chain as a request runs it, each stage timed inside the chain; returns each
    /// stage's median milliseconds. CUDA work is synchronised before each clock reading.
    pub fn profile(&self, input: &Boundary, repeats: usize, at_cut: impl FnMut(usize, &Boundary)) -> Result<Vec<f64>> {
        Ok(self.profile_between(input, repeats, at_cut, || true)?.unwrap_or_default())
    }

    /// [`LoadedStages::profile`], calling `between()` before every stage, outside its timing
    /// (a server runs waiting requests there, so that they wait at most one stage behind a
    /// profile); `between()` returning false stops the profile at the end of that pass
    /// (`Ok(None)`).
    pub fn profile_between(
        &self,
        input: &Boundary,
        repeats: usize,
        mut at_cut: impl FnMut(usize, &Boundary),
        mut between: impl FnMut() -> bool,
    ) -> Result<Option<Vec<f64>>> {
        let mut boundary = input.shallow_clone();
        at_cut(self.range.start, &boundary);
        for stage in self.range.start..self.range.end {
            if !between() {
                return Ok(None);
            }
            boundary = self.run(StageRange::new(stage, stage + 1), &boundary)?;
            at_cut(stage + 1, &boundary);
        }
        let times: std::cell::RefCell<Vec<Vec<f64>>> = std::cell::RefCell::new(vec![Vec::new(); self.range.len()]);
        let mut go_on = true;
        for _ in 0..repeats.max(1) {
            tch::no_grad(|| {
                self.run_chain(self.range, input, |stage| {
                    go_on &= between();
                    StageTimer::start(self.device, stage - self.range.start, &times)
                })
            })?;
            if !go_on {
                return Ok(None);
            }
        }
        // Every stage was timed at least once, so no sample is empty.
        Ok(Some(times.into_inner().iter().map(|t| crate::stats::median(t).unwrap_or(f64::NAN)).collect()))
    }

    /// The loaded modules, in stage order.
    pub(crate) fn modules(&self) -> &[CModule] {
        &self.modules
    }

    /// Puts every loaded module in training (`true`) or eval mode, as `nn.Module.train()`
    /// does: batch norm uses and updates batch statistics, dropout draws masks.
    pub(crate) fn set_training(&mut self, training: bool) {
        for module in &mut self.modules {
            if training {
                module.set_train();
            } else {
                module.set_eval();
            }
        }
    }
}

/// Times one stage of a chain: started when the stage is entered, recorded when dropped
/// (after the stage returned), CUDA synchronised at both ends.
struct StageTimer<'a> {
    device: tch::Device,
    slot: usize,
    started: Instant,
    times: &'a std::cell::RefCell<Vec<Vec<f64>>>,
}

impl<'a> StageTimer<'a> {
    fn start(device: tch::Device, slot: usize, times: &'a std::cell::RefCell<Vec<Vec<f64>>>) -> Self {
        synchronize(device);
        Self { device, slot, started: Instant::now(), times }
    }
}

impl Drop for StageTimer<'_> {
    fn drop(&mut self) {
        synchronize(self.device);
        self.times.borrow_mut()[self.slot].push(self.started.elapsed().as_secs_f64() * 1e3);
    }
}

fn synchronize(device: tch::Device) {
    if let tch::Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

/// Stage `index`'s TorchScript `file` in `dir`, loaded onto `device` in eval mode.
pub(crate) fn load_module(dir: &std::path::Path, index: usize, file: &str, device: tch::Device) -> Result<CModule> {
    let mut module = CModule::load_on_device(dir.join(file), device).map_err(|e| BundleError::LoadStage {
        index,
        file: file.to_string(),
        message: first_line(&e.to_string()),
    })?;
    module.set_eval();
    Ok(module)
}

fn first_line(text: &str) -> String {
    text.lines().find(|l| !l.trim().is_empty()).unwrap_or(text).trim().to_string()
}
