//! The log lines both binaries write, as their configs' `log_format` says: `text` (the
//! default: colour only on a terminal and never with `NO_COLOR`) or `json` (one object a line,
//! for a log collector). `RUST_LOG` filters either.

use serde::Deserialize;

/// `log_format:` in edge.yaml and server.yaml.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object a line.
    Json,
}

/// Starts logging to stdout in `format`, at `default_filter` unless `RUST_LOG` says otherwise.
/// Call once, first thing (later calls are ignored).
pub fn init(format: LogFormat, default_filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default_filter.into());
    let logs = tracing_subscriber::fmt().with_env_filter(filter);
    let _ = match format {
        LogFormat::Text => logs.with_ansi(colour_logs()).try_init(),
        LogFormat::Json => logs.json().try_init(),
    };
}

/// Whether log lines may carry colour: only on a terminal, and never with `NO_COLOR` set to
/// anything (<https://no-color.org>): logs redirected to a file stay plain text.
pub fn colour_logs() -> bool {
    use std::io::IsTerminal;
    std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}
