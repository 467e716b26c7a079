//! Split generation's stages (bundles exported with `--generation`): the embedding, one stage
//! per transformer layer that takes its key/value cache, and the head. A range of them runs
//! one step, a prefill of S tokens or a decode step of one, with the caches of its layers:
//! whoever runs a range keeps its caches, one per session (or per batch of sessions).
//!
//! Every step's inputs are checked before a stage sees them: the token ids against the
//! vocabulary, the positions against the cache, the shapes against each other, since a
//! layer writes its cache at the positions it is given.

use std::sync::Arc;

use tch::{CModule, Kind, Tensor};

use crate::bundle::{Bundle, CacheInfo, GenerationStageInfo};
use crate::device::DeviceSpec;
use crate::error::{BundleError, Result, StepProblem};
use crate::spec::TorchDType;
use crate::stages::{load_module, StageRange};

/// Generation stages `range`, loaded (shared with the other ranges sliced from them).
#[derive(Clone)]
pub struct GenerationStages {
    info: Arc<crate::bundle::GenerationInfo>,
    range: StageRange,
    /// The stages loaded, from `loaded_from` on.
    modules: Arc<[CModule]>,
    loaded_from: usize,
    device: tch::Device,
}

impl GenerationStages {
    /// Loads stages `range` of `bundle`'s generation stages onto `device`, in eval mode.
    pub fn load(bundle: &Bundle, range: StageRange, device: DeviceSpec) -> Result<Self> {
        let info = bundle.manifest().generation.clone().ok_or(BundleError::NoGeneration)?;
        let n = info.stages.len();
        if range.start > range.end || range.end > n {
            return Err(BundleError::InvalidRange { start: range.start, end: range.end, reason: format!("the model has {n} generation stages") });
        }
        let device = device.resolve()?;
        let modules = (range.start..range.end).map(|i| load_module(bundle.dir(), i, &info.stages[i].file, device)).collect::<Result<_>>()?;
        Ok(Self { info: Arc::new(info), range, modules, loaded_from: range.start, device })
    }

    /// Stages `range` of these, sharing their modules (a range within the loaded one).
    pub fn slice(&self, range: StageRange) -> Result<Self> {
        let loaded = self.loaded_from..self.loaded_from + self.modules.len();
        if range.start > range.end || range.start < loaded.start || range.end > loaded.end {
            let reason = format!("stages {}..{} are loaded", loaded.start, loaded.end);
            return Err(BundleError::InvalidRange { start: range.start, end: range.end, reason });
        }
        Ok(Self { range, ..self.clone() })
    }

    /// The stages' range.
    pub fn range(&self) -> StageRange {
        self.range
    }

    /// The manifest's generation section.
    pub fn info(&self) -> &crate::bundle::GenerationInfo {
        &self.info
    }

    /// The device they run on.
    pub fn device(&self) -> tch::Device {
        self.device
    }

    /// Whether the range ends with the head (its output is logits, not hidden states).
    pub fn ends_with_head(&self) -> bool {
        self.range.end == self.info.stages.len() && self.range.end > self.range.start
    }

    /// Zeroed caches for `batch` sequences of up to `max_len` positions: one per layer of the
    /// range, in order. `max_len` may not pass the model's `max_positions`.
    pub fn new_caches(&self, batch: i64, max_len: i64) -> Result<Vec<Tensor>> {
        if batch < 1 || !(1..=self.info.max_positions).contains(&max_len) {
            let problem = format!("caches for {batch} sequences of {max_len} positions (1 to {} positions)", self.info.max_positions);
            return Err(BundleError::GenerationStep { problem: StepProblem::Shape(problem) });
        }
        self.layers()
            .filter_map(|(index, s)| s.cache.map(|c| (index, c)))
            .map(|(index, c)| {
                Tensor::f_zeros([2, batch, c.heads, max_len, c.head_dim], (c.dtype.kind(), self.device)).map_err(|e| BundleError::StageFailed {
                    index,
                    name: "cache".into(),
                    message: e.to_string(),
                })
            })
            .collect()
    }

    /// Runs the range twice over a short prompt then two decode steps, on caches of its own,
    /// so that no session pays for a cold start: TorchScript optimises a module over its
    /// first runs (a first token took 50-110 ms where a warm one takes 15), and a device
    /// allocates its buffers.
    pub fn warm_up(&self) -> Result<()> {
        if self.range.is_empty() {
            return Ok(());
        }
        let max_len = self.info.max_positions.min(6);
        let prompt = (max_len - 2).max(1);
        let steps: Vec<(i64, i64)> = std::iter::once((0, prompt)).chain((prompt..max_len).map(|at| (at, 1))).collect();
        for _ in 0..2 {
            let mut caches = self.new_caches(1, max_len)?;
            for &(at, tokens) in &steps {
                let positions = Tensor::arange_start(at, at + tokens, (Kind::Int64, tch::Device::Cpu)).view([1, tokens]);
                let input = if self.range.start == 0 {
                    Tensor::zeros([1, tokens], (Kind::Int64, tch::Device::Cpu))
                } else {
                    Tensor::zeros([1, tokens, self.info.hidden_width()], (self.info.hidden.dtype.kind(), tch::Device::Cpu))
                };
                drop(self.step(&input, &positions, &mut caches)?);
            }
        }
        Ok(())
    }

    /// One step through the range: `input` (token ids [B, S] where the range starts at the
    /// embedding, hidden states [B, S, D] otherwise) at `positions` [B, S], writing the new
    /// tokens into `caches` (from [`Self::new_caches`]); returns the hidden states, or the
    /// logits where the range ends with the head.
    pub fn step(&self, input: &Tensor, positions: &Tensor, caches: &mut [Tensor]) -> Result<Tensor> {
        self.step_last(input, positions, caches, false)
    }

    /// [`Self::step`], giving with `last_only` each row's last token only: the head (where the
    /// range has it) then makes the logits of that token alone.
    pub fn step_last(&self, input: &Tensor, positions: &Tensor, caches: &mut [Tensor], last_only: bool) -> Result<Tensor> {
        let reach = self.check_step(input, positions, caches).map_err(|problem| BundleError::GenerationStep { problem })?;
        let last = |t: Tensor| if last_only { t.narrow(1, t.size()[1] - 1, 1) } else { t };
        let _no_grad = tch::no_grad_guard();
        // A layer attends to every position of the cache it is given, the later ones masked:
        // given the positions up to the furthest the step writes, a step's attention costs
        // what its context holds, not what the session may reach (a view: the layer writes
        // through it).
        let caches: Vec<Tensor> = caches.iter().map(|cache| cache.narrow(3, 0, reach)).collect();
        let (mut value, mut caches) = (input.to_device(self.device), caches.iter());
        let positions = positions.to_device(self.device);
        let modules = &self.modules[self.range.start - self.loaded_from..self.range.end - self.loaded_from];
        for ((index, info), module) in self.layers().zip(modules) {
            let result = match (index, info.cache) {
                (0, _) => module.forward_ts(&[&value, &positions]),
                (_, Some(_)) => {
                    let cache: &Tensor = caches.next().expect("checked: one cache per layer");
                    module.forward_ts(&[&value, &positions, cache])
                }
                // The head: after the last layer, only the tokens it answers for.
                (_, None) => {
                    value = last(value);
                    module.forward_ts(&[&value])
                }
            };
            value = result.map_err(|e| BundleError::StageFailed { index, name: info.name.clone(), message: e.to_string() })?;
        }
        Ok(if self.ends_with_head() { value } else { last(value) })
    }

    fn layers(&self) -> impl Iterator<Item = (usize, &GenerationStageInfo)> {
        (self.range.start..self.range.end).map(|i| (i, &self.info.stages[i]))
    }

    /// Checks a step's inputs; the positions the step's caches need (its furthest, plus one).
    fn check_step(&self, input: &Tensor, positions: &Tensor, caches: &[Tensor]) -> Result<i64, StepProblem> {
        let shape = |t: &Tensor| t.size();
        let (input_shape, position_shape) = (shape(input), shape(positions));
        if positions.kind() != Kind::Int64 || position_shape.len() != 2 || input_shape.get(..2) != Some(&position_shape[..]) {
            return Err(StepProblem::Shape(format!("positions int64 {position_shape:?} for an input of {input_shape:?}")));
        }
        if self.range.start == 0 {
            if input.kind() != Kind::Int64 || input_shape.len() != 2 {
                return Err(StepProblem::Shape(format!("token ids must be int64 [B, S], got {:?}{input_shape:?}", input.kind())));
            }
            let (min, max) = min_max(input);
            if min < 0 || max >= self.info.vocab_size {
                return Err(StepProblem::TokenId { min, max, vocab_size: self.info.vocab_size });
            }
        }
        let (min, max) = min_max(positions);
        if min < 0 || max >= self.info.max_positions {
            return Err(StepProblem::Position { min, max, max_len: self.info.max_positions });
        }
        let infos: Vec<CacheInfo> = self.layers().filter_map(|(_, s)| s.cache).collect();
        if caches.len() != infos.len() {
            return Err(StepProblem::Shape(format!("{} caches for {} layers", caches.len(), infos.len())));
        }
        let Some(first) = caches.first() else { return Ok(max + 1) };
        let (batch, max_len) = (input_shape[0], first.size().get(3).copied().unwrap_or(0));
        for (cache, info) in caches.iter().zip(&infos) {
            let want = [2, batch, info.heads, max_len, info.head_dim];
            if cache.size() != want || cache.kind() != info.dtype.kind() || cache.device() != self.device {
                return Err(StepProblem::Shape(format!("a cache of {:?}{:?}, the layer's is {:?}{want:?}", cache.kind(), cache.size(), info.dtype)));
            }
        }
        if max >= max_len {
            return Err(StepProblem::Position { min, max, max_len });
        }
        Ok(max + 1)
    }
}

fn min_max(t: &Tensor) -> (i64, i64) {
    if t.numel() == 0 {
        return (0, -1);
    }
    (t.min().int64_value(&[]), t.max().int64_value(&[]))
}
