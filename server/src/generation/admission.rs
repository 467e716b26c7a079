//! What every generation session shares: `generation.max_sessions` places, the cache budget
//! (`limits.kv_cache_bytes`, apart from the request memory budget: a session's caches live as
//! long as the session, not a request), and each model's generation stages, loaded once at
//! its first session and shared by every range of every session.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cleave_common::generation::GenerationStages;
use cleave_common::StageRange;

use crate::config::GenerationOptions;
use crate::error::{lock, GenerationError, RequestError};
use crate::metrics::{Metrics, OpenGuard};
use crate::models::Model;

/// Places, cache budget and loaded stages; cheap to clone.
#[derive(Clone)]
pub(crate) struct Generation {
    inner: Arc<Inner>,
}

struct Inner {
    options: GenerationOptions,
    cache_budget: u64,
    metrics: Metrics,
    held: Mutex<Held>,
    /// Each model's generation stages, by bundle id.
    stages: Mutex<HashMap<String, GenerationStages>>,
}

#[derive(Default)]
struct Held {
    sessions: u32,
    cache_bytes: u64,
}

/// A session's place and its caches' share of the budget, given back on drop.
pub(crate) struct Admission {
    generation: Generation,
    cache_bytes: u64,
    _open: OpenGuard,
}

impl Generation {
    pub(crate) fn new(options: GenerationOptions, cache_budget: u64, metrics: Metrics) -> Self {
        metrics.budget("kv_cache", cache_budget, 0);
        Self { inner: Arc::new(Inner { options, cache_budget, metrics, held: Mutex::default(), stages: Mutex::default() }) }
    }

    pub(crate) fn options(&self) -> GenerationOptions {
        self.inner.options
    }

    /// Sessions open now, of every model.
    pub(crate) fn open_sessions(&self) -> usize {
        lock(&self.inner.held).sessions as usize
    }

    /// Takes a place and `cache_bytes` of the budget, or says which is full.
    pub(crate) fn admit(&self, cache_bytes: u64) -> Result<Admission, GenerationError> {
        let inner = &self.inner;
        let mut held = lock(&inner.held);
        if held.sessions >= inner.options.max_sessions {
            return Err(GenerationError::Sessions { max: inner.options.max_sessions });
        }
        let free = inner.cache_budget - held.cache_bytes;
        if cache_bytes > free {
            return Err(GenerationError::CacheBudget { bytes: cache_bytes, free, budget: inner.cache_budget });
        }
        held.sessions += 1;
        held.cache_bytes += cache_bytes;
        inner.metrics.budget("kv_cache", inner.cache_budget, held.cache_bytes);
        Ok(Admission { generation: self.clone(), cache_bytes, _open: inner.metrics.generation_session_open() })
    }

    /// `model`'s generation stages, loaded on its device and warmed up at the first call
    /// (blocking: run it on the blocking pool). The first session waits for that in its
    /// opening, not in its first steps.
    pub(crate) fn stages(&self, model: &Model) -> Result<GenerationStages, RequestError> {
        let mut loaded = lock(&self.inner.stages);
        if let Some(stages) = loaded.get(model.bundle.id()) {
            return Ok(stages.clone());
        }
        let info = model
            .bundle
            .manifest()
            .generation
            .as_ref()
            .ok_or_else(|| GenerationError::NotExported { bundle: model.bundle.short_id().to_string() })?;
        let all = StageRange::new(0, info.stages.len());
        let stages = GenerationStages::load(&model.bundle, all, model.device_spec).map_err(RequestError::Bundle)?;
        stages.warm_up().map_err(RequestError::Bundle)?;
        tracing::info!(bundle = %model.bundle.short_id(), device = %model.device, stages = info.stages.len(), "generation stages loaded and warmed up");
        loaded.insert(model.bundle.id().to_string(), stages.clone());
        Ok(stages)
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        let inner = &self.generation.inner;
        let mut held = lock(&inner.held);
        held.sessions -= 1;
        held.cache_bytes -= self.cache_bytes;
        inner.metrics.budget("kv_cache", inner.cache_budget, held.cache_bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_and_the_cache_budget_are_taken_and_given_back() {
        let options = GenerationOptions { max_sessions: 2, ..GenerationOptions::default() };
        let generation = Generation::new(options, 1000, Metrics::new(Vec::new()));
        let a = generation.admit(600).unwrap();
        let refused = generation.admit(401).err().unwrap();
        assert!(matches!(refused, GenerationError::CacheBudget { bytes: 401, free: 400, budget: 1000 }), "{refused}");
        let b = generation.admit(400).unwrap();
        assert!(matches!(generation.admit(0), Err(GenerationError::Sessions { max: 2 })));
        drop(a);
        let c = generation.admit(600).unwrap();
        drop((b, c));
        assert!(generation.admit(1000).is_ok());
        assert!(Metrics::new(Vec::new()).render().contains("cleave_generation_sessions"));
    }
}
