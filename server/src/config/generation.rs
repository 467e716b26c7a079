//! `generation:` in server.yaml: how many generation sessions may be open and how long one
//! may say nothing. Their caches' bytes are `limits.kv_cache_bytes`.

use std::time::Duration;

use serde::Deserialize;

use cleave_common::config::{ConfigError, ConfigFile};

/// `generation:` as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServerGeneration {
    #[serde(default)]
    max_sessions: Option<u32>,
    #[serde(default, with = "humantime_serde")]
    session_idle_timeout: Option<Duration>,
}

/// How a server runs generation sessions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GenerationOptions {
    /// Sessions open at once, on every model together; one more is refused RESOURCE_EXHAUSTED.
    pub max_sessions: u32,
    /// A session whose host sends nothing for this long is closed and its caches freed (a
    /// vanished host never keeps the cache budget from others).
    pub session_idle_timeout: Duration,
}

impl Default for GenerationOptions {
    fn default() -> Self {
        Self { max_sessions: 64, session_idle_timeout: Duration::from_secs(300) }
    }
}

/// `generation:`, checked.
pub(super) fn options(file: &ConfigFile<'_>, raw: Option<RawServerGeneration>) -> Result<GenerationOptions, ConfigError> {
    let d = GenerationOptions::default();
    let options = match raw {
        None => d,
        Some(g) => GenerationOptions {
            max_sessions: g.max_sessions.unwrap_or(d.max_sessions),
            session_idle_timeout: g.session_idle_timeout.unwrap_or(d.session_idle_timeout),
        },
    };
    if options.max_sessions == 0 {
        return Err(file.invalid("generation.max_sessions", "must be positive"));
    }
    if options.session_idle_timeout.is_zero() {
        return Err(file.invalid("generation.session_idle_timeout", "must be positive"));
    }
    Ok(options)
}
