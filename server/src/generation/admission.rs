//! What every generation session shares: `generation.max_sessions` places, the cache budget
//! (`limits.kv_cache_bytes`, apart from the request memory budget: a session's caches live as
//! long as the session, not a request), and each model's generation stages, loaded once at
//! its first session and shared by every range of every session. One peer holds at most its
//! share of the places (`generation.max_sessions_per_peer`) and of the cache budget
//! (`limits.kv_cache_bytes_per_peer`): the peer that asks too much is the one refused.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cleave_common::generation::GenerationStages;
use cleave_common::StageRange;

use crate::config::GenerationOptions;
use crate::error::{lock, GenerationError, RequestError};
use crate::metrics::{Metrics, OpenGuard};
use crate::models::Model;
use crate::peer::Peer;

/// Places, cache budget and loaded stages; cheap to clone.
#[derive(Clone)]
pub(crate) struct Generation {
    inner: Arc<Inner>,
}

struct Inner {
    options: GenerationOptions,
    cache_budget: u64,
    /// What one peer's sessions may hold of it.
    peer_cache_share: u64,
    metrics: Metrics,
    held: Mutex<Held>,
    /// Each model's generation stages, by bundle id.
    stages: Mutex<HashMap<String, GenerationStages>>,
}

#[derive(Default)]
struct Held {
    sessions: u32,
    cache_bytes: u64,
    /// Sessions open of each model (bundle id) and range: those whose decode steps may share
    /// a batch.
    by_range: HashMap<(String, StageRange), usize>,
    /// What each peer's sessions hold.
    by_peer: HashMap<Peer, PeerHeld>,
}

/// One peer's sessions and their caches' bytes.
#[derive(Debug, Default, Clone, Copy)]
struct PeerHeld {
    sessions: u32,
    cache_bytes: u64,
}

/// A session's place and its caches' share of the budget, given back on drop.
pub(crate) struct Admission {
    generation: Generation,
    cache_bytes: u64,
    /// Its model's bundle id and its range.
    key: (String, StageRange),
    peer: Option<Peer>,
    _open: OpenGuard,
}

impl Generation {
    /// Places of `options` and a cache budget of `cache_budget` bytes, `peer_cache_share` of
    /// them at most for one peer.
    pub(crate) fn new(options: GenerationOptions, cache_budget: u64, peer_cache_share: u64, metrics: Metrics) -> Self {
        metrics.budget("kv_cache", cache_budget, 0);
        let inner = Inner { options, cache_budget, peer_cache_share, metrics, held: Mutex::default(), stages: Mutex::default() };
        Self { inner: Arc::new(inner) }
    }

    pub(crate) fn options(&self) -> GenerationOptions {
        self.inner.options
    }

    /// Sessions open now of the model of bundle `model` over `range`.
    pub(crate) fn open_sessions(&self, model: &str, range: StageRange) -> usize {
        lock(&self.inner.held).by_range.get(&(model.to_string(), range)).copied().unwrap_or(0)
    }

    /// Takes a place and `cache_bytes` of the budget for `peer`'s session of the model of
    /// bundle `model` over `range`, or says which is full: the peer's share first.
    pub(crate) fn admit(&self, model: &str, range: StageRange, cache_bytes: u64, peer: Option<Peer>) -> Result<Admission, GenerationError> {
        let inner = &self.inner;
        let mut held = lock(&inner.held);
        if let Some(peer) = &peer {
            let mine = held.by_peer.get(peer).copied().unwrap_or_default();
            if mine.sessions >= inner.options.max_sessions_per_peer {
                return Err(GenerationError::PeerSessions { peer: peer.to_string(), max: inner.options.max_sessions_per_peer });
            }
            if mine.cache_bytes.saturating_add(cache_bytes) > inner.peer_cache_share {
                let share = inner.peer_cache_share;
                return Err(GenerationError::PeerCache { peer: peer.to_string(), bytes: cache_bytes, held: mine.cache_bytes, share });
            }
        }
        if held.sessions >= inner.options.max_sessions {
            return Err(GenerationError::Sessions { max: inner.options.max_sessions });
        }
        let free = inner.cache_budget - held.cache_bytes;
        if cache_bytes > free {
            return Err(GenerationError::CacheBudget { bytes: cache_bytes, free, budget: inner.cache_budget });
        }
        held.sessions += 1;
        held.cache_bytes += cache_bytes;
        let key = (model.to_string(), range);
        *held.by_range.entry(key.clone()).or_default() += 1;
        if let Some(peer) = &peer {
            let mine = held.by_peer.entry(peer.clone()).or_default();
            mine.sessions += 1;
            mine.cache_bytes += cache_bytes;
        }
        inner.metrics.budget("kv_cache", inner.cache_budget, held.cache_bytes);
        Ok(Admission { generation: self.clone(), cache_bytes, key, peer, _open: inner.metrics.generation_session_open() })
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

impl Admission {
    /// The peer it was admitted for.
    pub(crate) fn peer(&self) -> Option<&Peer> {
        self.peer.as_ref()
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        let inner = &self.generation.inner;
        let mut held = lock(&inner.held);
        held.sessions -= 1;
        held.cache_bytes -= self.cache_bytes;
        if let Some(open) = held.by_range.get_mut(&self.key) {
            *open -= 1;
            if *open == 0 {
                held.by_range.remove(&self.key);
            }
        }
        if let Some(peer) = &self.peer {
            if let Some(mine) = held.by_peer.get_mut(peer) {
                mine.sessions -= 1;
                mine.cache_bytes -= self.cache_bytes;
                if mine.sessions == 0 {
                    held.by_peer.remove(peer);
                }
            }
        }
        inner.metrics.budget("kv_cache", inner.cache_budget, held.cache_bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_and_the_cache_budget_are_taken_and_given_back() {
        let options = GenerationOptions { max_sessions: 2, ..GenerationOptions::default() };
        let generation = Generation::new(options, 1000, 1000, Metrics::new(Vec::new()));
        let (middle, tail) = (StageRange::new(2, 6), StageRange::new(3, 6));
        let admit = |model: &str, range, bytes| generation.admit(model, range, bytes, None);
        let a = admit("m", middle, 600).unwrap();
        let refused = admit("m", middle, 401).err().unwrap();
        assert!(matches!(refused, GenerationError::CacheBudget { bytes: 401, free: 400, budget: 1000 }), "{refused}");
        let b = admit("m", middle, 400).unwrap();
        assert!(matches!(admit("m", middle, 0), Err(GenerationError::Sessions { max: 2 })));
        assert_eq!(generation.open_sessions("m", middle), 2, "refusals count no session");
        drop(a);
        let c = admit("other", middle, 600).unwrap();
        // Only sessions of one model and range can share a batch: each counts its own.
        assert_eq!((generation.open_sessions("m", middle), generation.open_sessions("other", middle)), (1, 1));
        assert_eq!(generation.open_sessions("m", tail), 0);
        drop((b, c));
        assert_eq!(generation.open_sessions("m", middle), 0);
        assert!(admit("m", tail, 1000).is_ok());
        assert!(Metrics::new(Vec::new()).render().contains("cleave_generation_sessions"));
    }

    #[test]
    fn one_peer_holds_at_most_its_share_of_places_and_caches_and_others_are_admitted() {
        let options = GenerationOptions { max_sessions: 8, max_sessions_per_peer: 2, ..GenerationOptions::default() };
        let generation = Generation::new(options, 1000, 500, Metrics::new(Vec::new()));
        let range = StageRange::new(2, 6);
        let address = |ip: &str| Peer::Address(crate::peer::PeerGroup::of(ip.parse().unwrap()));
        let (hog, other) = (address("192.0.2.7"), address("2001:db8::1"));
        let admit = |bytes, peer: &Peer| generation.admit("m", range, bytes, Some(peer.clone()));
        let a = admit(300, &hog).unwrap();
        let refused = admit(201, &hog).err().unwrap();
        assert!(matches!(refused, GenerationError::PeerCache { bytes: 201, held: 300, share: 500, .. }), "{refused}");
        assert!(refused.to_string().contains("192.0.2.7") && refused.to_string().contains("limits.kv_cache_bytes_per_peer"), "{refused}");
        let b = admit(200, &hog).unwrap();
        let refused = admit(0, &hog).err().unwrap();
        assert!(matches!(refused, GenerationError::PeerSessions { max: 2, .. }), "{refused}");
        assert!(refused.to_string().contains("generation.max_sessions_per_peer"), "{refused}");
        // Another peer has its own share, within what the hog leaves of the whole.
        let c = admit(500, &other).unwrap();
        assert!(matches!(admit(1, &other), Err(GenerationError::PeerCache { .. })));
        drop((a, c));
        // What a session held is given back to its peer's share.
        let d = admit(300, &hog).unwrap();
        assert!(matches!(admit(0, &hog), Err(GenerationError::PeerSessions { .. })));
        drop((b, d));
        assert!(admit(500, &hog).is_ok());
    }
}
