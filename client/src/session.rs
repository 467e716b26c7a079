//! The one way a program connects to a server, for inference, training and generation alike:
//! the endpoint (HTTP/2 windows, TLS trust, Nagle off), the bearer token on every call, then
//! `Info` and the checks a caller makes before it sends anything: the protocol version, the
//! bundle id, and (per run) that the server accepts the caller's codec and can open its
//! payloads. The message limit and the result payload limit are the server's, from `Info`:
//! the caller frames what it sends and accepts what it receives by them.

use cleave_common::bundle::short_id;
use cleave_common::pb;
use cleave_common::pb::split_inference_client::SplitInferenceClient;
use cleave_common::protocol::{ExportFacts, ServedModel, ServerInfo, BUNDLE_ID_METADATA};
use cleave_common::telemetry::{traceparent, TRACEPARENT_METADATA};
use cleave_common::wire::{chunk_bytes_for, Codec};
use cleave_common::Bundle;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tracing::Instrument;

use crate::error::{BundleMismatch, ConnectFailure, LinkError, Refusal};
use crate::link::Link;

/// Result alias of the link.
type Result<T, E = LinkError> = std::result::Result<T, E>;

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

/// A connection to a server that serves the caller's bundle.
#[derive(Clone)]
pub struct ServerSession {
    /// The gRPC client, its message limits set from the server's.
    pub client: Client,
    /// What the server said of itself.
    pub server: ServerInfo,
    /// The model of the caller's bundle among those it serves.
    pub model: ServedModel,
    /// Its URL.
    pub url: String,
    /// How it was reached (to reach it again).
    pub link: Link,
    /// The connection itself, for the services beside cleave's (the health service).
    pub channel: Channel,
}

impl std::fmt::Debug for ServerSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerSession").field("url", &self.url).field("server", &self.server).finish_non_exhaustive()
    }
}

/// The HTTP/2 endpoint every connection to a server is opened from: `link`'s TLS trust,
/// keepalive and local address, no Nagle, and receive windows of 8 MiB a stream and 32 MiB
/// the connection (a result is read as fast as it comes). (`split-overhead` opens its tonic
/// floor from it too.)
pub fn endpoint(url: &str, link: &Link) -> Result<Endpoint> {
    let lasting_error = |failure| LinkError::Unreachable { url: url.to_string(), failure };
    let mut endpoint = Endpoint::from_shared(url.to_string())
        .map_err(|e| lasting_error(ConnectFailure::Transport(e)))?
        .tcp_nodelay(true)
        .local_address(link.local_address)
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
    Ok(endpoint)
}

/// Connects to `url`, asks `Info`, and checks the protocol version and the bundle id.
pub async fn connect(url: &str, bundle: &Bundle, link: &Link) -> Result<ServerSession> {
    let connect_error = |failure| LinkError::Connect { url: url.to_string(), failure, attempts: 1 };
    let lasting_error = |failure| LinkError::Unreachable { url: url.to_string(), failure };
    let endpoint = endpoint(url, link)?;
    // A server that accepts and then says nothing (stopped, say) must not hold the caller: the
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
        Some(t) => Some(t.bearer().parse().map_err(|_| LinkError::TokenNotAHeaderValue)?),
        None => None,
    };
    let mut client = SplitInferenceClient::with_interceptor(channel.clone(), CallHeaders(token));
    let mut info = tonic::Request::new(pb::InfoRequest {});
    info.set_timeout(link.connect_timeout);
    // A refusal is final; a server that is not there yet (or stalls) may be tried again.
    let reply = client.info(info).instrument(tracing::debug_span!("server_info")).await.map_err(|s| match s.code() {
        tonic::Code::Unauthenticated | tonic::Code::PermissionDenied | tonic::Code::Unimplemented | tonic::Code::InvalidArgument => {
            LinkError::Rpc { call: "Info", code: s.code(), message: format!("{url}: {}", s.message()) }
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
    Ok(ServerSession { client, server, model, url: url.to_string(), link: link.clone(), channel })
}

/// The server serves no bundle with the caller's id: the ids on each side and, for a served
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

impl ServerSession {
    /// Checks, before anything is sent, that the server accepts this codec and can open this
    /// caller's payloads (see [`check_server_accepts`]).
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

    /// A call's request, carrying the bundle id that selects the caller's model on the server.
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
