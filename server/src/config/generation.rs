//! `generation:` in server.yaml: how many generation sessions may be open, how long one may
//! say nothing, and how their decode steps are batched. Their caches' bytes are
//! `limits.kv_cache_bytes`.

use std::time::Duration;

use serde::Deserialize;

use cleave_common::config::{ConfigError, ConfigFile};

/// `generation:` as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServerGeneration {
    #[serde(default)]
    max_sessions: Option<u32>,
    #[serde(default)]
    max_sessions_per_peer: Option<u32>,
    #[serde(default, with = "humantime_serde")]
    session_idle_timeout: Option<Duration>,
    #[serde(default)]
    max_batch: Option<u32>,
    #[serde(default, with = "humantime_serde")]
    max_wait: Option<Duration>,
    #[serde(default)]
    prefill_chunk_tokens: Option<u32>,
}

/// How a server runs generation sessions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GenerationOptions {
    /// Sessions open at once, on every model together; one more is refused RESOURCE_EXHAUSTED.
    pub max_sessions: u32,
    /// Sessions one peer (an address, an IPv6 peer's /64) may hold at once: by default a
    /// quarter of `max_sessions`, so that no one peer takes every place.
    pub max_sessions_per_peer: u32,
    /// A session whose host sends nothing for this long is closed and its caches freed (a
    /// vanished host never keeps the cache budget from others).
    pub session_idle_timeout: Duration,
    /// Rows of decode steps (one token each) of sessions at the same cut run as one batch
    /// (continuous batching: a session joins or leaves between steps); 1 runs each alone.
    pub max_batch: u32,
    /// How long a decode step waits for others to fill its batch, while fewer steps than
    /// sessions open are in it. 0 takes those that came while the last batch ran, and no more.
    pub max_wait: Duration,
    /// A step run by itself (a prompt's) runs in parts of at most this many tokens (rows x
    /// positions, at least one position), each a turn of the device, one part of a peer's in
    /// its queue at a time: other peers' work runs between the parts of a long prompt.
    pub prefill_chunk_tokens: u32,
}

impl Default for GenerationOptions {
    fn default() -> Self {
        Self {
            max_sessions: 64,
            max_sessions_per_peer: 16,
            session_idle_timeout: Duration::from_secs(300),
            max_batch: 16,
            max_wait: Duration::from_millis(2),
            prefill_chunk_tokens: 128,
        }
    }
}

/// A quarter of `n`: one peer's default share.
fn quarter(n: u32) -> u32 {
    n / 4
}

/// The longest `generation.max_wait`: every token of every session may wait this long.
const MAX_WAIT: Duration = Duration::from_secs(1);

/// `generation:`, checked.
pub(super) fn options(file: &ConfigFile<'_>, raw: Option<RawServerGeneration>) -> Result<GenerationOptions, ConfigError> {
    let d = GenerationOptions::default();
    let options = match raw {
        None => d,
        Some(g) => GenerationOptions {
            max_sessions: g.max_sessions.unwrap_or(d.max_sessions),
            max_sessions_per_peer: g.max_sessions_per_peer.unwrap_or_else(|| quarter(g.max_sessions.unwrap_or(d.max_sessions)).max(1)),
            session_idle_timeout: g.session_idle_timeout.unwrap_or(d.session_idle_timeout),
            max_batch: g.max_batch.unwrap_or(d.max_batch),
            max_wait: g.max_wait.unwrap_or(d.max_wait),
            prefill_chunk_tokens: g.prefill_chunk_tokens.unwrap_or(d.prefill_chunk_tokens),
        },
    };
    if options.max_sessions == 0 {
        return Err(file.invalid("generation.max_sessions", "must be positive"));
    }
    if options.max_sessions_per_peer == 0 {
        return Err(file.invalid("generation.max_sessions_per_peer", "must be positive"));
    }
    if options.session_idle_timeout.is_zero() {
        return Err(file.invalid("generation.session_idle_timeout", "must be positive"));
    }
    if options.max_batch == 0 {
        return Err(file.invalid("generation.max_batch", "must be positive (1 runs each session's steps alone)"));
    }
    if options.prefill_chunk_tokens == 0 {
        return Err(file.invalid("generation.prefill_chunk_tokens", "must be positive (a part runs one position at least)"));
    }
    if options.max_wait > MAX_WAIT {
        return Err(file.invalid("generation.max_wait", format!("at most {MAX_WAIT:?}: a decode step waits this long for others on every token")));
    }
    Ok(options)
}
