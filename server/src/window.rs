//! The window of recent results: a host that lost its connection resends every request it
//! has no answer for, and one the server already computed is answered from here instead of
//! computed again. Results are keyed by the host's session id (the `cleave-host-session`
//! metadata of its `Infer` streams) and the request id, and a result is given only to a
//! request whose envelope is byte for byte the one it was computed for: a resend is sent as
//! it was encoded, and a sealed envelope (its nonce, its authenticated header) cannot be
//! made without the key, so a peer that knows a session id can neither plant a result for
//! that host nor take one (a recalled result is sealed for the key the asking envelope
//! names). The window is bounded in both results and bytes (`limits.dedup_window_requests`,
//! `limits.dedup_window_bytes`, envelopes included): the least recently used go first.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use cleave_common::Boundary;
use lru::LruCache;

use crate::error::{BadCall, RequestError};

/// Longest host session id accepted.
const MAX_SESSION_CHARS: usize = 64;

/// A host's session id, as its streams carry it: 1 to 64 letters, digits, `-` or `_`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct HostSession(Arc<str>);

impl HostSession {
    /// Checks an id from a peer.
    pub(crate) fn parse(id: &str) -> Result<Self, RequestError> {
        let valid = (1..=MAX_SESSION_CHARS).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !valid {
            return Err(BadCall::HostSession { max: MAX_SESSION_CHARS }.into());
        }
        Ok(Self(id.into()))
    }
}

/// Recent results of every host session, shared by every stream.
#[derive(Clone)]
pub struct ResultWindow {
    inner: Arc<Inner>,
}

struct Inner {
    results: Mutex<Held>,
    max_results: usize,
    max_bytes: u64,
    /// Resent requests answered from the window.
    hits: AtomicU64,
}

struct Held {
    results: LruCache<(HostSession, u64), Kept>,
    bytes: u64,
}

/// A result and the envelope of the request it answers.
struct Kept {
    envelope: Bytes,
    output: Boundary,
    /// What it holds of the window: its tensors' bytes and its envelope's, counted once.
    bytes: u64,
}

impl ResultWindow {
    /// A window of at most `max_results` results and `max_bytes` tensor bytes (either zero:
    /// no window, every request is computed).
    pub fn new(max_results: usize, max_bytes: u64) -> Self {
        let held = Held { results: LruCache::unbounded(), bytes: 0 };
        Self { inner: Arc::new(Inner { results: Mutex::new(held), max_results, max_bytes, hits: AtomicU64::new(0) }) }
    }

    /// Keeps the result of the request `envelope` started, dropping the least recently used
    /// to stay within the bounds. A result larger than the whole window is not kept.
    pub(crate) fn keep(&self, session: &HostSession, request_id: u64, envelope: &Bytes, output: &Boundary) {
        let bytes = (output.tensor_bytes() + envelope.len()) as u64;
        if self.inner.max_results == 0 || bytes > self.inner.max_bytes {
            return;
        }
        let kept = Kept { envelope: envelope.clone(), output: output.shallow_clone(), bytes };
        let mut held = self.lock();
        if let Some(old) = held.results.put((session.clone(), request_id), kept) {
            held.bytes -= old.bytes;
        }
        held.bytes += bytes;
        while held.results.len() > self.inner.max_results || held.bytes > self.inner.max_bytes {
            let Some((_, dropped)) = held.results.pop_lru() else { break };
            held.bytes -= dropped.bytes;
        }
    }

    /// The result of a request this session sent before with this very envelope, if the
    /// window still holds it.
    pub(crate) fn recall(&self, session: &HostSession, request_id: u64, envelope: &[u8]) -> Option<Boundary> {
        let found =
            self.lock().results.get(&(session.clone(), request_id)).filter(|k| k.envelope.as_ref() == envelope).map(|k| k.output.shallow_clone());
        if found.is_some() {
            self.inner.hits.fetch_add(1, Ordering::Relaxed);
        }
        found
    }

    /// Resent requests answered from the window so far.
    pub fn hits(&self) -> u64 {
        self.inner.hits.load(Ordering::Relaxed)
    }

    /// Results held now.
    pub fn len(&self) -> usize {
        self.lock().results.len()
    }

    /// Whether it holds no result.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held now (results' tensors and their requests' envelopes).
    pub fn bytes(&self) -> u64 {
        self.lock().bytes
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Held> {
        // Nothing panics while holding it; were it poisoned, the map is still consistent.
        self.inner.results.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cleave_common::Value;
    use tch::{Device, Kind, Tensor};

    fn result(values: i64) -> Boundary {
        Boundary { values: vec![("y".into(), Value::Tensor(Tensor::arange(values, (Kind::Float, Device::Cpu))))] }
    }

    fn env(bytes: &'static [u8]) -> Bytes {
        Bytes::from_static(bytes)
    }

    fn session(id: &str) -> HostSession {
        HostSession::parse(id).unwrap()
    }

    #[test]
    fn a_kept_result_is_recalled_by_its_session_id_and_envelope_only() {
        let window = ResultWindow::new(8, 1 << 20);
        window.keep(&session("a"), 1, &env(b"e1"), &result(4));
        let recalled = window.recall(&session("a"), 1, b"e1").expect("kept");
        assert!(recalled.values[0].1.as_tensor().unwrap().equal(&Tensor::arange(4, (Kind::Float, Device::Cpu))));
        assert!(window.recall(&session("b"), 1, b"e1").is_none());
        assert!(window.recall(&session("a"), 2, b"e1").is_none());
        assert!(window.recall(&session("a"), 1, b"another request under the same id").is_none());
        assert_eq!(window.hits(), 1);
    }

    #[test]
    fn the_window_is_bounded_in_results_and_in_bytes() {
        let window = ResultWindow::new(2, 1 << 20);
        for id in 0..3 {
            window.keep(&session("a"), id, &env(b"e"), &result(4));
        }
        assert_eq!(window.len(), 2);
        assert!(window.recall(&session("a"), 0, b"e").is_none(), "the oldest went first");
        assert_eq!(window.bytes(), 2 * (16 + 1));

        let window = ResultWindow::new(100, 40);
        for id in 0..3 {
            window.keep(&session("a"), id, &env(b"e"), &result(4)); // 17 bytes each.
        }
        assert_eq!((window.len(), window.bytes()), (2, 34));
        window.keep(&session("a"), 9, &env(b"e"), &result(10)); // 41 bytes: larger than the window.
        assert!(window.recall(&session("a"), 9, b"e").is_none());
        let off = ResultWindow::new(0, 1 << 20);
        off.keep(&session("a"), 1, &env(b"e"), &result(1));
        assert!(off.is_empty());
    }

    #[test]
    fn session_ids_are_checked() {
        assert!(HostSession::parse("3f2a-host_1").is_ok());
        for bad in ["", "a/b", "a b", &"x".repeat(65)] {
            assert!(HostSession::parse(bad).is_err(), "{bad:?}");
        }
    }
}
