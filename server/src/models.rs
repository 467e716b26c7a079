//! The models a server serves, each selected by its bundle id: bundles opened, stages loaded
//! on their devices, and one scheduler per device shared by the models placed there.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use cleave_common::protocol::{ExportFacts, ServedModel, BUNDLE_ID_METADATA};
use cleave_common::{Bundle, DeviceSpec, LoadedStages, StageRange};

use crate::config::ModelConfig;
use crate::error::{RequestError, ServerError};
use crate::scheduler::watch::{self, LoadModels, SchedulerContext};
use crate::scheduler::{DeviceModel, DeviceScheduler};

/// One model served.
pub(crate) struct Model {
    pub(crate) bundle: Bundle,
    /// The device its stages run on, resolved (`cpu`, `cuda:0`).
    pub(crate) device: String,
    /// The same device as libtorch names it (where received tensors land: pinned for CUDA).
    pub(crate) torch_device: tch::Device,
    /// As configured (training sessions load their own copy there).
    pub(crate) device_spec: DeviceSpec,
    pub(crate) slo: Option<Duration>,
    /// Its index among its device's models.
    pub(crate) index: usize,
    /// Its device's scheduler.
    pub(crate) scheduler: DeviceScheduler,
    /// Samples one merged batch holds.
    pub(crate) batch_limit: u32,
}

impl Model {
    /// What `Info` says of it.
    pub(crate) fn info(&self) -> ServedModel {
        let manifest = self.bundle.manifest();
        ServedModel {
            bundle_id: self.bundle.id().to_string(),
            model_source: manifest.model.source.clone(),
            stage_count: self.bundle.stage_count(),
            device: self.device.clone(),
            max_batch: manifest.batch.max as u32,
            slo_ms: self.slo.map(|d| d.as_millis().min(u128::from(u32::MAX)) as u32),
            batch_limit: self.batch_limit,
            batchable_cuts: if self.batch_limit > 1 { self.bundle.batchable_cuts() } else { Vec::new() },
            export: Some(ExportFacts::of(&self.bundle)),
        }
    }
}

/// Every model served, in the config's order.
#[derive(Clone)]
pub(crate) struct Models {
    list: Arc<Vec<Arc<Model>>>,
}

impl Models {
    /// Opens every bundle, loads its stages on its device and starts one scheduler per
    /// device (which reloads them from the same configs if it restarts). Two entries of one
    /// bundle are refused.
    pub(crate) fn load(configs: &[ModelConfig], context: &SchedulerContext) -> Result<Self, ServerError> {
        let mut models: Vec<(&ModelConfig, Bundle, String, tch::Device)> = Vec::with_capacity(configs.len());
        let mut by_device: BTreeMap<String, Vec<(usize, DeviceModel, Bundle)>> = BTreeMap::new();
        for (position, config) in configs.iter().enumerate() {
            let bundle = Bundle::open(&config.bundle)?;
            if let Some((first, ..)) = models.iter().find(|(_, b, ..)| b.id() == bundle.id()) {
                return Err(ServerError::DuplicateModel {
                    id: bundle.id().to_string(),
                    first: first.bundle.display().to_string(),
                    second: config.bundle.display().to_string(),
                });
            }
            let on_device = load_on_device(&bundle, config)?;
            let (device, torch_device) = (on_device.device(), on_device.torch_device());
            tracing::info!(bundle = %config.bundle.display(), id = bundle.id(), %device, stages = bundle.stage_count(), "bundle loaded");
            by_device.entry(device.clone()).or_default().push((position, on_device, bundle.clone()));
            models.push((config, bundle, device, torch_device));
        }
        let mut placed: Vec<Option<(usize, DeviceScheduler)>> = vec![None; models.len()];
        for (device, on_device) in by_device {
            let mut positions = Vec::with_capacity(on_device.len());
            let mut device_models = Vec::with_capacity(on_device.len());
            let mut recipes = Vec::with_capacity(on_device.len());
            for (position, model, bundle) in on_device {
                positions.push(position);
                device_models.push(model);
                recipes.push((bundle, configs[position].clone()));
            }
            let reload: LoadModels = Box::new(move || recipes.iter().map(|(bundle, config)| load_on_device(bundle, config)).collect());
            let handle = watch::spawn(&device, device_models, reload, context.clone())?;
            for (index, position) in positions.into_iter().enumerate() {
                placed[position] = Some((index, handle.clone()));
            }
        }
        let list = models
            .into_iter()
            .zip(placed)
            .map(|((config, bundle, device, torch_device), slot)| {
                let (index, scheduler) = slot.expect("every model is placed on its device");
                let batch_limit = config.batching.limit(&bundle);
                Arc::new(Model { bundle, device, torch_device, device_spec: config.device, slo: config.slo, index, scheduler, batch_limit })
            })
            .collect();
        Ok(Self { list: Arc::new(list) })
    }

    /// Every model, in the config's order.
    pub(crate) fn all(&self) -> &[Arc<Model>] {
        &self.list
    }

    /// The model a call's `cleave-bundle-id` names. Without one, the only model when there is
    /// one and `optional`; otherwise refused, naming the ids served.
    pub(crate) fn select(&self, metadata: &tonic::metadata::MetadataMap, optional: bool) -> Result<Arc<Model>, RequestError> {
        let theirs = metadata.get(BUNDLE_ID_METADATA).and_then(|v| v.to_str().ok()).unwrap_or("");
        if theirs.is_empty() && optional && self.list.len() == 1 {
            return Ok(Arc::clone(&self.list[0]));
        }
        self.list.iter().find(|m| m.bundle.id() == theirs).cloned().ok_or_else(|| RequestError::UnknownModel {
            host: if theirs.is_empty() { "(none given)".to_string() } else { theirs.chars().take(80).collect() },
            served: self.list.iter().map(|m| m.bundle.id().to_string()).collect(),
        })
    }
}

/// Loads a model's stages on its device (its scheduler thread warms them before it serves,
/// at `warm_batches` too, which must be batch sizes the bundle takes).
fn load_on_device(bundle: &Bundle, config: &ModelConfig) -> Result<DeviceModel, ServerError> {
    let (min, max) = (bundle.manifest().batch.min, bundle.manifest().batch.max);
    if let Some(&batch) = config.warm_batches.iter().find(|&&b| b < min || b > max) {
        return Err(ServerError::WarmBatch { bundle: config.bundle.display().to_string(), batch, min, max });
    }
    let stages = LoadedStages::load(bundle, StageRange::all(bundle), config.device)?;
    let model = DeviceModel::new(stages, config.batching, config.slo, config.priority).keyed(config.generate_target(), config.train);
    Ok(model.warmed_at(&config.warm_batches))
}
