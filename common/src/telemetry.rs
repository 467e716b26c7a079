//! Traces over OpenTelemetry: each request's spans on the host and on the server, exported
//! over OTLP/gRPC when `telemetry.otlp_endpoint` is set, and not even recorded otherwise
//! (the spans are at debug level, which nothing else enables by default).
//!
//! One trace covers a request on both sides: the host puts the context of the request's
//! attempt in W3C `traceparent` form in the request's first frame (gRPC metadata is per call,
//! and one `Infer` call carries many requests), and the server's span for the request takes
//! it as its parent. A `traceparent` is checked as any bytes from the network are: one that
//! does not parse is ignored.

use std::time::Duration;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider, SpanData, SpanExporter};
use serde::Deserialize;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// How long one export may take before it is given up (a collector that does not answer
/// must not hold spans, or the exit, for long).
const EXPORT_TIMEOUT: Duration = Duration::from_secs(3);

/// The longest `traceparent` taken from a peer (version 00 has 55 characters; later versions
/// may add fields).
pub const MAX_TRACEPARENT_BYTES: usize = 256;

/// The gRPC metadata key a unary call's trace context travels in (W3C trace context). A
/// stream's requests carry theirs in their first frame instead: one `Infer` call carries
/// many requests, each with a trace of its own.
pub const TRACEPARENT_METADATA: &str = "traceparent";

/// `telemetry:` in edge.yaml and server.yaml.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Telemetry {
    /// Where spans go: an OTLP/gRPC endpoint (`http://localhost:4317`); none: no traces.
    #[serde(default)]
    pub otlp_endpoint: Option<String>,
    /// The share of new traces kept, 0 to 1. A request whose host traced it is traced on the
    /// server whatever the server's ratio (the host decides).
    #[serde(default = "all")]
    pub sample_ratio: f64,
    /// The service spans are exported as (default: `cleave-host`, `cleave-server`).
    #[serde(default)]
    pub service_name: Option<String>,
}

fn all() -> f64 {
    1.0
}

impl Default for Telemetry {
    fn default() -> Self {
        Self { otlp_endpoint: None, sample_ratio: all(), service_name: None }
    }
}

/// A `telemetry:` value that cannot work, or an exporter that cannot start.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The endpoint is not an http(s) URL.
    #[error("{0:?}: expected a URL like http://localhost:4317")]
    Endpoint(String),
    /// The ratio is outside 0 to 1.
    #[error("{0}: must be between 0 and 1")]
    SampleRatio(f64),
    /// The thread that exports spans did not start.
    #[error("the thread that exports spans: {0}")]
    Runtime(#[source] std::io::Error),
    /// The OTLP exporter cannot be built for the endpoint.
    #[error("the OTLP exporter for {endpoint}: {source}")]
    Exporter {
        /// The endpoint.
        endpoint: String,
        /// Why not.
        #[source]
        source: opentelemetry_otlp::ExporterBuildError,
    },
}

impl TelemetryError {
    /// The config key at fault, for a value that cannot work.
    pub fn key(&self) -> &'static str {
        match self {
            Self::SampleRatio(_) => "telemetry.sample_ratio",
            Self::Endpoint(_) | Self::Runtime(_) | Self::Exporter { .. } => "telemetry.otlp_endpoint",
        }
    }
}

impl Telemetry {
    /// Checks the values (read from a config file).
    pub fn check(&self) -> Result<(), TelemetryError> {
        if !(0.0..=1.0).contains(&self.sample_ratio) {
            return Err(TelemetryError::SampleRatio(self.sample_ratio));
        }
        match &self.otlp_endpoint {
            Some(url)
                if !(url.starts_with("http://") || url.starts_with("https://")) || tonic::transport::Endpoint::from_shared(url.clone()).is_err() =>
            {
                Err(TelemetryError::Endpoint(url.clone()))
            }
            _ => Ok(()),
        }
    }
}

/// Spans being exported; dropping it exports what is left (waiting up to the export timeout).
#[derive(Debug, Default)]
pub struct Tracing {
    provider: Option<SdkTracerProvider>,
    /// Where the exporter's gRPC client runs (the SDK exports from a thread of its own).
    runtime: Option<tokio::runtime::Runtime>,
}

impl Tracing {
    /// Nothing exported.
    pub fn off() -> Self {
        Self::default()
    }

    /// The layer that turns the spans of cleave's crates into OpenTelemetry spans, and what
    /// exports them; none without an endpoint.
    pub(crate) fn start<S>(telemetry: &Telemetry, default_service: &str) -> Result<(Self, Option<impl tracing_subscriber::Layer<S>>), TelemetryError>
    where
        S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
    {
        let Some(endpoint) = &telemetry.otlp_endpoint else { return Ok((Self::off(), None)) };
        telemetry.check()?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("cleave-otlp")
            .enable_all()
            .build()
            .map_err(TelemetryError::Runtime)?;
        let exporter = {
            let _inside = runtime.enter();
            opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint)
                .with_timeout(EXPORT_TIMEOUT)
                .build()
                .map_err(|source| TelemetryError::Exporter { endpoint: endpoint.clone(), source })?
        };
        let exporter = OnRuntime { inner: exporter, runtime: runtime.handle().clone() };
        let service = telemetry.service_name.clone().unwrap_or_else(|| default_service.to_string());
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(telemetry.sample_ratio))))
            .with_resource(opentelemetry_sdk::Resource::builder().with_service_name(service).build())
            .build();
        let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("cleave"));
        Ok((Self { provider: Some(provider), runtime: Some(runtime) }, Some(layer)))
    }
}

impl Drop for Tracing {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take() {
            if let Err(e) = provider.shutdown() {
                tracing::warn!(error = %e, "telemetry: the last spans were not exported");
            }
        }
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// The OTLP exporter, run on a runtime of its own: the SDK's batch processor exports from a
/// plain thread, where tonic finds no reactor.
#[derive(Debug)]
struct OnRuntime {
    inner: opentelemetry_otlp::SpanExporter,
    runtime: tokio::runtime::Handle,
}

impl SpanExporter for OnRuntime {
    fn export(&self, batch: Vec<SpanData>) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        let exported = self.runtime.block_on(self.inner.export(batch));
        std::future::ready(exported)
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}

/// `span`'s context as a W3C `traceparent`, to send with a request; none when the span is
/// not traced (telemetry off, or not sampled).
pub fn traceparent(span: &tracing::Span) -> Option<String> {
    let context = span.context();
    if !context.span().span_context().is_sampled() {
        return None;
    }
    let mut carrier = std::collections::HashMap::new();
    TraceContextPropagator::new().inject_context(&context, &mut carrier);
    carrier.remove("traceparent")
}

/// Makes the context a peer sent in `traceparent` the parent of `span`. A value that is too
/// long or does not parse is ignored: the span starts a trace of its own.
pub fn follow(span: &tracing::Span, traceparent: &str) {
    if traceparent.len() > MAX_TRACEPARENT_BYTES || !well_formed(traceparent) {
        return;
    }
    let carrier = std::collections::HashMap::from([("traceparent".to_string(), traceparent.to_string())]);
    let parent = TraceContextPropagator::new().extract(&carrier);
    if parent.span().span_context().is_valid() {
        let _ = span.set_parent(parent);
    }
}

/// Whether `traceparent` has the W3C form, checked here because OpenTelemetry's parser is
/// lenient (it trims whitespace and takes one-digit flags): `vv-<32 hex>-<16 hex>-ff`, all
/// lowercase, the version not `ff`; version 00 ends there, a later one may go on after a `-`.
fn well_formed(traceparent: &str) -> bool {
    let bytes = traceparent.as_bytes();
    let hex_at = |range: std::ops::Range<usize>| bytes.get(range).is_some_and(|b| b.iter().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')));
    let dash_at = |at: usize| bytes.get(at) == Some(&b'-');
    let fields = hex_at(0..2) && dash_at(2) && hex_at(3..35) && dash_at(35) && hex_at(36..52) && dash_at(52) && hex_at(53..55);
    let ends = match bytes.get(..2) {
        Some(b"00") => bytes.len() == 55,
        Some(b"ff") => false,
        _ => bytes.len() == 55 || dash_at(55),
    };
    fields && ends
}

/// Links `span` to `other` (a batch to each request it carries).
pub fn link(span: &tracing::Span, other: &tracing::Span) {
    let context = other.context().span().span_context().clone();
    if context.is_valid() {
        span.add_link(context);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_that_cannot_work_name_their_key() {
        let bad_ratio = Telemetry { sample_ratio: 1.5, ..Telemetry::default() };
        assert_eq!(bad_ratio.check().unwrap_err().key(), "telemetry.sample_ratio");
        let bad_url = Telemetry { otlp_endpoint: Some("localhost:4317".into()), ..Telemetry::default() };
        let e = bad_url.check().unwrap_err();
        assert_eq!(e.key(), "telemetry.otlp_endpoint");
        assert!(e.to_string().contains("http://localhost:4317"), "{e}");
        let good = Telemetry { otlp_endpoint: Some("http://collector:4317".into()), sample_ratio: 0.1, service_name: None };
        assert!(good.check().is_ok());
    }

    /// Runs `f` with spans recorded by OpenTelemetry (nothing exported), as with telemetry on.
    fn traced<T>(f: impl FnOnce() -> T) -> T {
        use tracing_subscriber::layer::SubscriberExt;
        let provider = SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry().with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::with_default(subscriber, f)
    }

    /// A peer's trace context: version 00, its trace and span ids, sampled.
    const PEER: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_span_joins_the_trace_a_peer_names() {
        let joined = traced(|| {
            let span = tracing::info_span!("request");
            follow(&span, PEER);
            traceparent(&span)
        });
        let joined = joined.expect("a traced span has a traceparent");
        assert!(joined.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"), "{joined}");
        assert!(!joined.contains("00f067aa0ba902b7"), "a span of its own under the peer's: {joined}");
    }

    #[test]
    fn what_opentelemetry_would_forgive_is_ignored() {
        let unsampled = PEER.replace("-01", "-00");
        let lenient = [format!("{PEER}\t"), format!(" {PEER}"), PEER.replace("-01", "-1"), PEER.to_uppercase(), format!("{unsampled}-extra")];
        for sent in lenient.iter().chain([&unsampled.replace("-00", "-0\t")]) {
            let ours = traced(|| {
                let span = tracing::info_span!("request");
                follow(&span, sent);
                traceparent(&span)
            });
            let ours = ours.unwrap_or_else(|| panic!("{sent:?} left the span unsampled"));
            assert!(!ours.contains("4bf92f3577b34da6a3ce929d0e0e4736"), "{sent:?} was followed: {ours}");
        }
        let later_version = traced(|| {
            let span = tracing::info_span!("request");
            follow(&span, &format!("01{}-extra", &PEER[2..]));
            traceparent(&span)
        });
        assert!(
            later_version.is_some_and(|ours| ours.contains("4bf92f3577b34da6a3ce929d0e0e4736")),
            "a later version's fields after the flags are allowed"
        );
    }

    proptest::proptest! {
        /// Whatever a peer sends as its `traceparent` (any text, or a valid one with a byte
        /// changed), following it never panics; the span joins the trace the text names in
        /// its place (after the version) or starts one of its own, never a trace of all zeros;
        /// and it is left unsampled only by a well-formed parent whose flags say so.
        #[test]
        fn any_traceparent_is_followed_or_ignored(text in "\\PC{0,80}", at in 0usize..55, byte in proptest::num::u8::ANY) {
            let mut mutated = PEER.as_bytes().to_vec();
            mutated[at] = byte;
            for sent in [text, String::from_utf8_lossy(&mutated).into_owned()] {
                let ours = traced(|| {
                    let span = tracing::info_span!("request");
                    follow(&span, &sent);
                    traceparent(&span)
                });
                match ours {
                    Some(ours) => {
                        let trace = &ours[3..35];
                        proptest::prop_assert_ne!(trace, "0".repeat(32), "{:?}", sent);
                        if sent.contains(trace) {
                            proptest::prop_assert_eq!(sent.get(3..35), Some(trace));
                        }
                    }
                    None => {
                        let unsampled = sent.len() == 55 && sent.get(53..).and_then(|f| u8::from_str_radix(f, 16).ok()).is_some_and(|f| f & 1 == 0);
                        proptest::prop_assert!(unsampled, "{:?} left the span unsampled", sent);
                    }
                }
            }
        }
    }

    #[test]
    fn a_span_without_telemetry_has_no_traceparent_and_ignores_one() {
        let span = tracing::info_span!("request");
        assert_eq!(traceparent(&span), None);
        follow(&span, "00-not-a-trace");
        follow(&span, &"0".repeat(MAX_TRACEPARENT_BYTES + 1));
        assert_eq!(traceparent(&span), None);
    }
}
