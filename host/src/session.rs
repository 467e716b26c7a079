//! The one way the edge connects to a server, for runs, plans and training alike: the
//! endpoint (HTTP/2 windows, TLS trust, Nagle off), the bearer token on every call, then
//! `Info` and the checks a host makes before it sends anything: the protocol version, the
//! bundle id, and (per run) that the server accepts the host's codec and can open its
//! payloads. The message limit and the result payload limit are the server's, from `Info`:
//! the host frames what it sends and accepts what it receives by them.

use std::time::Duration;

use cleave_common::bundle::short_id;
use cleave_common::pb;
use cleave_common::pb::split_inference_client::SplitInferenceClient;
use cleave_common::protocol::{ExportFacts, ServedModel, ServerInfo, BUNDLE_ID_METADATA};
use cleave_common::security::{ClientTls, EdgeSecurity, Token};
use cleave_common::telemetry::{traceparent, TRACEPARENT_METADATA};
use cleave_common::wire::{chunk_bytes_for, Codec, Key};
use cleave_common::Bundle;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tracing::Instrument;

use crate::config::{EdgeConfig, Resilience, RetryPolicy};
use crate::error::{BundleMismatch, ConnectFailure, HostError, Refusal, Result};

/// How to reach a server: TLS trust, bearer token, and how long to wait for it.
#[derive(Debug, Clone)]
pub struct Link {
    /// TLS trust (the URL must then be https://).
    pub tls: Option<ClientTls>,
    /// Bearer token sent with every call.
    pub token: Option<Token>,
    /// The key id and key generation steps are sealed with (plaintext where absent).
    pub key: Option<(u32, Key)>,
    /// Opening the connection and its `Info` call.
    pub connect_timeout: Duration,
    /// HTTP/2 PING interval, and how long a PING may go unanswered before the connection is
    /// taken for broken: a server that stops answering is noticed even between requests.
    pub keepalive: (Duration, Duration),
    /// How long a generation step's answer may take (`request_timeout`): a server that keeps
    /// the connection alive but never answers is left, as one that went away.
    pub request_timeout: Duration,
}

impl Default for Link {
    fn default() -> Self {
        let r = Resilience::default();
        let keepalive = (r.keepalive_interval, r.keepalive_timeout);
        Self { tls: None, token: None, key: None, connect_timeout: r.connect_timeout, keepalive, request_timeout: r.request_timeout }
    }
}

impl Link {
    /// Plaintext, no token.
    pub fn plain() -> Self {
        Self::default()
    }

    /// With the TLS trust, token and key of an edge config.
    pub fn secured(security: &EdgeSecurity) -> Self {
        Self { tls: security.tls.clone(), token: security.token.clone(), key: security.key.clone(), ..Self::default() }
    }

    /// With the TLS trust, token and timeouts of an edge config. Servers reached by the
    /// addresses their name resolves to (`resolve_every`) are checked against that name.
    pub fn of(config: &EdgeConfig) -> Self {
        let r = &config.resilience;
        let mut link = Self {
            connect_timeout: r.connect_timeout,
            keepalive: (r.keepalive_interval, r.keepalive_timeout),
            request_timeout: r.request_timeout,
            ..Self::secured(&config.security)
        };
        if let (Some(tls), Some(_)) = (&mut link.tls, config.resolve_every) {
            tls.domain = tls.domain.take().or_else(|| url_host(&config.server));
        }
        link
    }
}

/// The host of `url` (`https://name:port/` gives `name`).
fn url_host(url: &str) -> Option<String> {
    let authority = url.split_once("://")?.1.split('/').next()?;
    let host = match authority.rsplit_once(':') {
        Some((host, port)) if port.parse::<u16>().is_ok() => host,
        _ => authority,
    };
    Some(host.trim_start_matches('[').trim_end_matches(']').to_string())
}

/// Adds `authorization: Bearer <token>` to every call when there is a token, and the calling
/// span's `traceparent` when it is sampled, so that the server's span of a unary call
/// (`Info`, `Profile`, `Echo`) continues the caller's trace.
#[derive(Clone)]
pub struct CallHeaders(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for CallHeaders {
    fn call(&mut self, mut request: tonic::Request<()>) -> std::result::Result<tonic::Request<()>, tonic::Status> {
        if let Some(value) = &self.0 {
            request.metadata_mut().insert("authorization", value.clone());
        }
        if let Some(parent) = traceparent(&tracing::Span::current()).and_then(|tp| tp.parse().ok()) {
            request.metadata_mut().insert(TRACEPARENT_METADATA, parent);
        }
        Ok(request)
    }
}

/// A connected client.
pub type Client = SplitInferenceClient<InterceptedService<Channel, CallHeaders>>;

/// A connection to a server that serves this host's bundle.
#[derive(Clone)]
pub struct EdgeSession {
    /// The gRPC client, its message limits set from the server's.
    pub client: Client,
    /// What the server said of itself.
    pub server: ServerInfo,
    /// The model of this host's bundle among those it serves.
    pub model: ServedModel,
    /// Its URL.
    pub url: String,
    /// How it was reached (to reach it again).
    pub link: Link,
    /// The connection itself, for the services beside cleave's (the health service).
    pub channel: Channel,
}

impl std::fmt::Debug for EdgeSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EdgeSession").field("url", &self.url).field("server", &self.server).finish_non_exhaustive()
    }
}

/// Connects to `url`, asks `Info`, and checks the protocol version and the bundle id.
pub async fn connect(url: &str, bundle: &Bundle, link: &Link) -> Result<EdgeSession> {
    let connect_error = |failure| HostError::Connect { url: url.to_string(), failure, attempts: 1 };
    let lasting_error = |failure| HostError::Unreachable { url: url.to_string(), failure };
    let mut endpoint = Endpoint::from_shared(url.to_string())
        .map_err(|e| lasting_error(ConnectFailure::Transport(e)))?
        .tcp_nodelay(true)
        .connect_timeout(link.connect_timeout)
        .http2_keep_alive_interval(link.keepalive.0)
        .keep_alive_timeout(link.keepalive.1)
        .keep_alive_while_idle(true)
        .initial_stream_window_size(Some(8 << 20))
        .initial_connection_window_size(Some(32 << 20));
    if link.tls.is_none() && url.starts_with("https://") {
        return Err(lasting_error(ConnectFailure::HttpsWithoutTls));
    }
    if let Some(tls) = &link.tls {
        if !url.starts_with("https://") {
            return Err(lasting_error(ConnectFailure::TlsWithoutHttps));
        }
        let mut config = tonic::transport::ClientTlsConfig::new().ca_certificate(tonic::transport::Certificate::from_pem(&tls.ca_pem));
        if let Some(domain) = &tls.domain {
            config = config.domain_name(domain.clone());
        }
        endpoint = endpoint.tls_config(config).map_err(|e| lasting_error(ConnectFailure::TlsConfig(e)))?;
    }
    // A server that accepts and then says nothing (stopped, say) must not hold the host: the
    // whole handshake and `Info` get `connect_timeout`.
    let timed_out = || connect_error(ConnectFailure::NoAnswer(link.connect_timeout));
    let channel = tokio::time::timeout(link.connect_timeout, endpoint.connect()).await.map_err(|_| timed_out())?.map_err(|e| {
        if may_pass(&e) {
            connect_error(ConnectFailure::Transport(e))
        } else {
            lasting_error(ConnectFailure::Transport(e))
        }
    })?;
    let token = match &link.token {
        Some(t) => Some(t.bearer().parse().map_err(|_| HostError::TokenNotAHeaderValue)?),
        None => None,
    };
    let mut client = SplitInferenceClient::with_interceptor(channel.clone(), CallHeaders(token));
    let mut info = tonic::Request::new(pb::InfoRequest {});
    info.set_timeout(link.connect_timeout);
    // A refusal is final; a server that is not there yet (or stalls) may be tried again.
    let reply = client.info(info).instrument(tracing::debug_span!("server_info")).await.map_err(|s| match s.code() {
        tonic::Code::Unauthenticated | tonic::Code::PermissionDenied | tonic::Code::Unimplemented | tonic::Code::InvalidArgument => {
            HostError::Rpc { call: "Info", code: s.code(), message: format!("{url}: {}", s.message()) }
        }
        tonic::Code::Cancelled | tonic::Code::DeadlineExceeded => connect_error(ConnectFailure::NoInfo(link.connect_timeout)),
        code => connect_error(ConnectFailure::Info { code, message: s.message().to_string() }),
    })?;
    let server = ServerInfo::try_from(reply.into_inner()).map_err(|error| Refusal::Info { url: url.to_string(), error })?;
    let Some(model) = server.model(bundle.id()).cloned() else {
        return Err(Refusal::from(bundle_mismatch(bundle, &server, url)).into());
    };
    let max_message = server.limits.max_message_bytes as usize;
    let client = client.max_decoding_message_size(max_message).max_encoding_message_size(max_message);
    Ok(EdgeSession { client, server, model, url: url.to_string(), link: link.clone(), channel })
}

/// The server serves no bundle with this host's id: the ids on each side and, for a served
/// model of the same source, what differs between the two exports.
fn bundle_mismatch(bundle: &Bundle, server: &ServerInfo, url: &str) -> BundleMismatch {
    let source = &bundle.manifest().model.source;
    let here = ExportFacts::of(bundle);
    let differences = |other: &ServedModel| match other.export.as_ref().map(|e| e.differences(&here)) {
        Some(d) if !d.is_empty() => d.join(", "),
        _ => "their files differ".to_string(),
    };
    BundleMismatch {
        bundle_id: bundle.id().to_string(),
        source_name: source.clone(),
        url: url.to_string(),
        served: server.models.iter().map(|m| format!("{} ({})", m.bundle_id, m.model_source)).collect(),
        same_model: server
            .models
            .iter()
            .filter(|m| m.model_source == *source)
            .map(|m| (short_id(&m.bundle_id).to_string(), differences(m)))
            .collect(),
    }
}

/// Whether a failed connection may succeed when tried again: what a server that is starting,
/// restarting, stopped or overloaded causes (a refused, reset or timed-out connection). A name
/// that does not resolve, a refused TLS handshake or anything else stays until the config or
/// the server changes.
fn may_pass(error: &(dyn std::error::Error + 'static)) -> bool {
    use std::io::ErrorKind::*;
    let mut source = Some(error);
    while let Some(e) = source {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            return matches!(
                io.kind(),
                ConnectionRefused
                    | ConnectionReset
                    | ConnectionAborted
                    | NotConnected
                    | BrokenPipe
                    | UnexpectedEof
                    | TimedOut
                    | Interrupted
                    | AddrNotAvailable
                    | NetworkUnreachable
                    | HostUnreachable
                    | NetworkDown
            );
        }
        source = e.source();
    }
    false
}

/// [`connect`], tried up to `retry.max_attempts` times with exponential backoff and jitter
/// between attempts (a host started while its server is down, or restarting, waits for it).
/// A server that answers and refuses this host (another bundle, say), or one that cannot be
/// reached for a lasting reason (see [`HostError::Unreachable`]), is not tried again.
pub async fn connect_retrying(url: &str, bundle: &Bundle, link: &Link, retry: &RetryPolicy) -> Result<EdgeSession> {
    let mut backoff = retry.backoff();
    let mut attempt = 1;
    loop {
        match connect(url, bundle, link).await {
            Ok(session) => return Ok(session),
            Err(e @ HostError::Connect { .. }) if attempt < retry.max_attempts => {
                let wait = backoff.next().unwrap_or(retry.max_backoff);
                tracing::warn!(attempt, of = retry.max_attempts, error = %e, "cannot reach the server; trying again in {wait:?}");
                tokio::time::sleep(wait).await;
                attempt += 1;
            }
            Err(HostError::Connect { url, failure, .. }) => return Err(HostError::Connect { url, failure, attempts: attempt }),
            Err(e) => return Err(e),
        }
    }
}

/// A connection to the first of `servers` that answers, tried in turn, the whole list up to
/// `retry.max_attempts` times with backoff between passes; the last error when none answers
/// (at once when every server refused for a reason that stays).
pub async fn connect_first(servers: &[String], bundle: &Bundle, link: &Link, retry: &RetryPolicy) -> Result<EdgeSession> {
    let [_, _, ..] = servers else {
        return connect_retrying(&servers[0], bundle, link, retry).await;
    };
    let mut backoff = retry.backoff();
    let passes = retry.max_attempts.max(1);
    for pass in 1..=passes {
        let mut last = None;
        let mut lasting = true;
        for url in servers {
            match connect(url, bundle, link).await {
                Ok(session) => return Ok(session),
                Err(e) => {
                    tracing::warn!(server = %url, error = %e, "cannot reach the server; trying the next");
                    lasting &= e.is_lasting();
                    last = Some(e);
                }
            }
        }
        let last = last.expect("several servers were tried");
        if lasting || pass == passes {
            return Err(last);
        }
        tokio::time::sleep(backoff.next().unwrap_or(retry.max_backoff)).await;
    }
    unreachable!("the last pass returns")
}

impl EdgeSession {
    /// Checks, before anything is sent, that the server accepts this codec and can open this
    /// host's payloads (see [`check_server_accepts`]).
    pub fn check_accepts(&self, codec: &Codec, key_id: Option<u32>) -> Result<()> {
        check_server_accepts(&self.server, codec, key_id)
    }

    /// Data bytes per frame under the server's message limit.
    pub fn chunk_bytes(&self) -> usize {
        chunk_bytes_for(self.server.limits.max_message_bytes)
    }

    /// The largest payload (results, gradients) accepted back: the server's own limit.
    pub fn max_payload_bytes(&self) -> u64 {
        self.server.limits.max_payload_bytes
    }

    /// A call's request, carrying the bundle id that selects this host's model on the server.
    pub fn model_request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        let id = self.model.bundle_id.parse().expect("a bundle id (hex) is a valid header value");
        request.metadata_mut().insert(BUNDLE_ID_METADATA, id);
        request
    }
}

/// Checks that a server accepts `codec` and holds `key_id` (or needs no key); the error says
/// what the server accepts.
pub fn check_server_accepts(server: &ServerInfo, codec: &Codec, key_id: Option<u32>) -> Result<()> {
    server.policy.check(codec).map_err(|error| Refusal::Codec { codec: codec.to_string(), error })?;
    match key_id {
        None if server.policy.require_encryption => Err(Refusal::EncryptionRequired { held: server.key_ids.clone() }.into()),
        Some(id) if !server.key_ids.contains(&id) => Err(Refusal::KeyNotHeld { id, held: server.key_ids.clone() }.into()),
        _ => Ok(()),
    }
}
