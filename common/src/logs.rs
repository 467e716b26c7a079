//! The log lines both binaries write, as their configs' `log_format` says: `text` (the
//! default: colour only on a terminal and never with `NO_COLOR`) or `json` (one object a line,
//! for a log collector). `RUST_LOG` filters either. With `telemetry.otlp_endpoint` set, the
//! spans of cleave's crates are exported too ([`crate::telemetry`]), whatever `RUST_LOG` says.

use serde::Deserialize;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

use crate::telemetry::{Telemetry, TelemetryError, Tracing};

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

/// The crates whose spans are exported (a request's spans are at debug level).
const TRACED_CRATES: [&str; 4] = ["cleave_client", "cleave_host", "cleave_server", "cleave_common"];

/// Starts logging to stdout in `format`, at `default_filter` unless `RUST_LOG` says otherwise,
/// and exporting spans as `telemetry` says, as `service` unless it names one. Call once,
/// first thing (later calls log nothing more); keep what it returns until the end: dropping
/// it exports the last spans.
pub fn init(format: LogFormat, default_filter: &str, telemetry: &Telemetry, service: &str) -> Result<Tracing, TelemetryError> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default_filter.into());
    let lines = tracing_subscriber::fmt::layer();
    let lines = match format {
        LogFormat::Text => lines.with_ansi(colour_logs()).boxed(),
        LogFormat::Json => lines.json().boxed(),
    };
    let (tracing, spans) = Tracing::start(telemetry, service)?;
    let spans = spans.map(|layer| layer.with_filter(Targets::new().with_targets(TRACED_CRATES.map(|c| (c, tracing::Level::DEBUG)))));
    let _ = tracing_subscriber::registry().with(lines.with_filter(filter)).with(spans).try_init();
    Ok(tracing)
}

/// Whether log lines may carry colour: only on a terminal, and never with `NO_COLOR` set to
/// anything (<https://no-color.org>): logs redirected to a file stay plain text.
pub fn colour_logs() -> bool {
    use std::io::IsTerminal;
    std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}
