//! Training sessions whose stream broke (its connection lost, the stream reset), kept for
//! their host to continue on a new stream (`OpenSession.reattach`) for
//! `training.session_idle_timeout`, then closed. Only sessions opened `reattachable` are
//! kept, and only a host holding the session's token may continue one.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cleave_common::pb;
use subtle::ConstantTimeEq;

use super::admission::SessionSlot;
use super::session::SessionHandle;
use crate::error::{lock, RequestError, SessionError};
use crate::metrics::OpenGuard;

/// A session and what a stream needs to answer its calls.
pub(crate) struct Attached {
    /// Its place among the open sessions (the bundle is held while it lives).
    pub(crate) slot: SessionSlot,
    pub(crate) session: SessionHandle,
    /// The bundle it trains.
    pub(crate) bundle_id: String,
    /// The cuts its calls arrive at and leave from.
    pub(crate) start: u32,
    pub(crate) end: u32,
    /// What continues it after its stream breaks; none: it closes with its stream.
    pub(crate) reattach_token: Option<String>,
    /// What `SessionOpened` says of it besides its step.
    pub(crate) parameters: u64,
    pub(crate) device: String,
    pub(crate) namespace: String,
    /// In a `splitfed` group: the weights its edge sends at the end of a round.
    pub(crate) weights: Option<std::sync::Arc<[cleave_common::wire::TensorSpec]>>,
    /// Counted among the open training sessions while it lives, kept or attached.
    pub(crate) _open: OpenGuard,
}

/// The sessions kept for their hosts; cheap to clone.
#[derive(Clone, Default)]
pub(crate) struct Parking {
    kept: Arc<Mutex<HashMap<String, (Attached, u64)>>>,
    /// Tells a keeping from the one before it of the same session.
    next: Arc<AtomicU64>,
}

impl std::fmt::Debug for Parking {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Parking").field("kept", &lock(&self.kept).len()).finish()
    }
}

impl Parking {
    /// Keeps `attached` for `keep_for`, then closes it unless its host has continued it.
    pub(crate) fn keep(&self, attached: Attached, keep_for: Duration) {
        let id = attached.slot.id.clone();
        let keeping = self.next.fetch_add(1, Ordering::Relaxed);
        tracing::info!(session = %id, ?keep_for, "training stream broke: the session is kept for its host to continue");
        lock(&self.kept).insert(id.clone(), (attached, keeping));
        let kept = Arc::clone(&self.kept);
        tokio::spawn(async move {
            tokio::time::sleep(keep_for).await;
            let mut kept = lock(&kept);
            if kept.get(&id).is_some_and(|(_, k)| *k == keeping) {
                kept.remove(&id);
                tracing::info!(session = %id, "a kept training session was not continued within `training.session_idle_timeout`: closed");
            }
        });
    }

    /// The session `reattach` names, given back to a stream of `bundle_id`'s model.
    pub(crate) fn take(&self, reattach: &pb::Reattach, bundle_id: &str) -> Result<Attached, RequestError> {
        let mut kept = lock(&self.kept);
        let id = &reattach.session_id;
        let Some((attached, _)) = kept.get(id) else {
            return Err(SessionError::NotWaiting { session: id.chars().take(40).collect() }.into());
        };
        let token = attached.reattach_token.as_deref().unwrap_or_default();
        if !bool::from(token.as_bytes().ct_eq(reattach.token.as_bytes())) {
            return Err(RequestError::Unauthenticated("the reattach token does not match the session's (SessionOpened.reattach_token)"));
        }
        if attached.bundle_id != bundle_id {
            let (session, trains, asked) = (id.clone(), attached.bundle_id.clone(), bundle_id.to_string());
            return Err(SessionError::OtherBundle { session, trains, asked }.into());
        }
        let (attached, _) = kept.remove(id).expect("the kept session was just found");
        tracing::info!(session = %id, "training session continued by its host");
        Ok(attached)
    }
}
