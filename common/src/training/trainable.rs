//! Stages loaded for training: their parameters (which record gradients) and buffers.

use std::collections::HashMap;

use tch::{IValue, Tensor};

use super::error::{StateError, TrainError};
use super::microbatch::Microbatch;
use super::seeding::{seeded_generator, stage_seed};
use crate::bundle::Bundle;
use crate::device::DeviceSpec;
use crate::stages::{LoadedStages, StageRange};
use crate::value::Boundary;

/// A range of stages in training mode.
#[derive(Debug)]
pub struct TrainableStages {
    stages: LoadedStages,
    seed: u64,
    training: bool,
    parameters: Vec<(String, Tensor)>,
    buffers: Vec<(String, Tensor)>,
}

impl TrainableStages {
    /// Loads stages `range` of `bundle` on `device` for training; `seed` fixes their dropout
    /// masks (see [`super::stage_seed`]). Refuses bundles whose stages cannot train as
    /// PyTorch would: traced stages (their train/eval behaviour is frozen), stages without
    /// the `cleave_buffers` method (exported before training support), and parameters held
    /// by two stages (tied weights would drift apart).
    pub fn load(bundle: &Bundle, range: StageRange, device: DeviceSpec, seed: u64) -> Result<Self, TrainError> {
        let manifest = bundle.manifest();
        match &manifest.exporter.shared_parameters {
            None => {
                return Err(TrainError::NotTrainable(
                    "it was exported before training support (no parameter names in its manifest); re-export it".into(),
                ))
            }
            Some(shared) if !shared.is_empty() => {
                let s = &shared[0];
                let names = if s.aliases.len() > 1 { &s.aliases } else { &s.names };
                let stages: Vec<String> = s.stages.iter().map(usize::to_string).collect();
                return Err(TrainError::NotTrainable(format!(
                    "{} are one tensor (tied weights) held by stages {}, and training would update each stage's copy apart; \
                     export the model with the weights untied to train it (a transformers model: --hf-config tie_word_embeddings=false); \
                     inference works at every cut",
                    names.join(" and "),
                    stages.join(" and ")
                )));
            }
            Some(_) => {}
        }
        let mut stages = LoadedStages::load_trainable(bundle, range, device)?;
        stages.set_training(true);
        let mut parameters = Vec::new();
        let mut buffers = Vec::new();
        for (info, module) in manifest.stages[range.start..range.end].iter().zip(stages.modules()) {
            if info.compiler != "script" {
                return Err(TrainError::NotTrainable(format!(
                    "stage {} ({}) was traced, not scripted, so its train/eval behaviour is fixed",
                    info.index, info.name
                )));
            }
            // libtorch lists a weight tied within a stage under each of its names; the
            // manifest (Python's `named_parameters()`) lists it once, and is what we train.
            let mut named: HashMap<String, Tensor> =
                module.named_parameters().map_err(|e| TrainError::torch("reading parameters", e))?.into_iter().collect();
            for name in info.parameter_names.as_deref().unwrap_or_default() {
                let p = named
                    .remove(name)
                    .ok_or_else(|| TrainError::NotTrainable(format!("stage {} has no parameter {name}, which its manifest lists", info.index)))?;
                if p.requires_grad() {
                    parameters.push((name.clone(), p));
                }
            }
            buffers.extend(stage_buffers(module, info)?);
        }
        Ok(Self { stages, seed, training: true, parameters, buffers })
    }

    /// The stages loaded.
    pub fn range(&self) -> StageRange {
        self.stages.range()
    }

    /// The bundle they come from.
    pub fn bundle(&self) -> &Bundle {
        self.stages.bundle()
    }

    /// The device they run on.
    pub fn device(&self) -> tch::Device {
        self.stages.device()
    }

    /// The trainable parameters, named like the model's `state_dict` keys.
    pub fn parameters(&self) -> &[(String, Tensor)] {
        &self.parameters
    }

    /// Number of trainable scalars.
    pub fn parameter_count(&self) -> u64 {
        self.parameters.iter().map(|(_, p)| p.numel() as u64).sum()
    }

    /// The buffers (batch-norm running statistics and counters).
    pub fn buffers(&self) -> &[(String, Tensor)] {
        &self.buffers
    }

    /// A training-mode forward pass of step `step` from the boundary at the first cut of the
    /// loaded range: gradients are recorded (the returned boundary's tensors carry the graph),
    /// batch norm uses batch statistics and updates its running ones, dropout draws masks
    /// seeded by (session seed, step, stage), the session seed that of the micro-batch.
    pub fn forward(&mut self, step: u64, microbatch: Microbatch, input: &Boundary) -> Result<Boundary, TrainError> {
        self.forward_seeded(self.seed, step, microbatch, input)
    }

    /// [`Self::forward`] with the dropout masks of session seed `seed` (stages several
    /// sessions train in turn draw each session's own).
    pub fn forward_seeded(&mut self, seed: u64, step: u64, microbatch: Microbatch, input: &Boundary) -> Result<Boundary, TrainError> {
        self.set_training(true);
        let seed = microbatch.seed(seed);
        let range = self.stages.range();
        Ok(self.stages.run_chain(range, input, |stage| seeded_generator(stage_seed(seed, step, stage)))?)
    }

    /// An eval-mode forward pass without gradients (held-out evaluation, inference).
    pub fn evaluate(&mut self, input: &Boundary) -> Result<Boundary, TrainError> {
        self.set_training(false);
        Ok(self.stages.run(self.stages.range(), input)?)
    }

    fn set_training(&mut self, training: bool) {
        if self.training != training {
            self.stages.set_training(training);
            self.training = training;
        }
    }

    /// Saves every stage's TorchScript file (current weights, eval mode) into `dir`, under
    /// the bundle's file names.
    pub fn save_stage_files(&mut self, dir: &std::path::Path) -> Result<(), TrainError> {
        self.set_training(false);
        let stages = &self.stages.bundle().manifest().stages[self.stages.range().start..self.stages.range().end];
        for (info, module) in stages.iter().zip(self.stages.modules()) {
            module.save(dir.join(&info.file)).map_err(|e| TrainError::torch("saving a stage", e))?;
        }
        Ok(())
    }

    /// Parameters and buffers, named `param.NAME` and `buffer.NAME` (what checkpoints hold).
    pub fn state(&self) -> Vec<(String, Tensor)> {
        let params = self.parameters.iter().map(|(n, t)| (format!("param.{n}"), t.detach()));
        let buffers = self.buffers.iter().map(|(n, t)| (format!("buffer.{n}"), t.shallow_clone()));
        params.chain(buffers).collect()
    }

    /// Copies a [`Self::state`] into the stages; every parameter and buffer must be present,
    /// with its shape and dtype.
    pub fn load_state(&self, state: &HashMap<String, Tensor>) -> Result<(), StateError> {
        let params = self.parameters.iter().map(|(n, t)| (format!("param.{n}"), t));
        let buffers = self.buffers.iter().map(|(n, t)| (format!("buffer.{n}"), t));
        tch::no_grad(|| {
            for (key, target) in params.chain(buffers) {
                let Some(source) = state.get(&key) else {
                    return Err(StateError::Missing { key });
                };
                if source.size() != target.size() || source.kind() != target.kind() {
                    let (found_kind, found_shape) = (source.kind(), source.size());
                    return Err(StateError::Mismatch { key, found_kind, found_shape, kind: target.kind(), shape: target.size() });
                }
                if let Err(e) = target.shallow_clone().f_copy_(source) {
                    return Err(StateError::Copy { key, message: e.to_string() });
                }
            }
            Ok(())
        })
    }
}

/// The buffers of one stage, through the `cleave_buffers()` method the exporter adds (tch
/// reaches parameters but not buffers); they share storage with the module's own.
fn stage_buffers(module: &tch::CModule, info: &crate::bundle::StageInfo) -> Result<Vec<(String, Tensor)>, TrainError> {
    let missing = || TrainError::NotTrainable(format!("stage {} has no buffer list; re-export the bundle", info.index));
    let expected = info.buffer_names.as_ref().ok_or_else(missing)?;
    let returned = module.method_is::<IValue>("cleave_buffers", &[]).map_err(|_| missing())?;
    let items = match returned {
        IValue::GenericList(items) | IValue::Tuple(items) => items,
        other => return Err(TrainError::NotTrainable(format!("stage {}: cleave_buffers() returned {other:?}", info.index))),
    };
    let returned = |item: &dyn std::fmt::Debug| TrainError::NotTrainable(format!("stage {}: cleave_buffers() returned {item:?}", info.index));
    let buffers = items
        .into_iter()
        .map(|item| match item {
            IValue::Tuple(mut pair) if pair.len() == 2 => match (pair.remove(0), pair.remove(0)) {
                (IValue::String(name), IValue::Tensor(t)) => Ok((name, t)),
                other => Err(returned(&other)),
            },
            other => Err(returned(&other)),
        })
        .collect::<Result<Vec<_>, TrainError>>()?;
    if buffers.iter().map(|(n, _)| n).ne(expected.iter()) {
        return Err(TrainError::NotTrainable(format!(
            "stage {} holds buffers [{}], its manifest lists [{}]",
            info.index,
            buffers.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>().join(", "),
            expected.join(", ")
        )));
    }
    Ok(buffers)
}
