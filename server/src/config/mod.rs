//! `server.yaml`: read raw (unknown keys refused), then validated into a [`ServerConfig`]
//! with typed values; every error names the file, the key and what was expected. The models
//! served and the scheduler are in [`models`].

mod generation;
mod models;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use cleave_common::config::{ConfigError, ConfigFile, CpuUse, LimitError, LimitRule, Limits, RawServerAuth, RawTlsIdentity};
use cleave_common::logs::LogFormat;
use cleave_common::security::ServerSecurity;
use cleave_common::telemetry::Telemetry;
use cleave_common::wire::{CodecPolicy, KeyRing, Precision};

use crate::metrics::EndpointLimits;

pub use generation::GenerationOptions;
pub use models::{Batching, DeviceFailurePolicy, ModelConfig, Policy, SchedulerConfig, WorkTarget};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServerConfig {
    listen: String,
    /// One model: `bundle:` and, beside it, `device`, `batching`, `slo_ms`, `priority`, `warm_batches`, `kinds`.
    #[serde(default)]
    bundle: Option<PathBuf>,
    #[serde(default)]
    device: Option<String>,
    #[serde(default)]
    batching: Option<models::RawBatching>,
    #[serde(default)]
    slo_ms: Option<u64>,
    #[serde(default)]
    priority: Option<f64>,
    #[serde(default)]
    warm_batches: Option<Vec<i64>>,
    #[serde(default)]
    kinds: Option<models::RawKinds>,
    /// Several models, each with those keys.
    #[serde(default)]
    models: Option<Vec<models::RawModel>>,
    #[serde(default)]
    scheduler: Option<serde_yaml::Value>,
    #[serde(default)]
    on_device_failure: Option<String>,
    #[serde(default)]
    metrics_listen: Option<String>,
    #[serde(default)]
    health_listen: Option<String>,
    #[serde(default)]
    limits: RawServerLimits,
    #[serde(default)]
    codecs: Option<RawAcceptedCodecs>,
    #[serde(default)]
    encryption: Option<RawServerEncryption>,
    #[serde(default)]
    tls: Option<RawTlsIdentity>,
    #[serde(default)]
    auth: Option<RawServerAuth>,
    #[serde(default)]
    training: Option<RawServerTraining>,
    #[serde(default)]
    generation: Option<generation::RawServerGeneration>,
    #[serde(default)]
    insecure: bool,
    #[serde(default)]
    threads: Option<usize>,
    #[serde(default)]
    cores: Option<Vec<usize>>,
    #[serde(default)]
    log_format: LogFormat,
    #[serde(default)]
    telemetry: Telemetry,
}

/// `limits:` in server.yaml: what a request may carry ([`Limits`], announced to hosts in
/// `Info`) and what the server holds for its peers ([`PeerLimits`]); an absent key keeps its
/// default.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawServerLimits {
    max_message_bytes: Option<u64>,
    max_payload_bytes: Option<u64>,
    queue_depth: Option<u32>,
    max_connections: Option<u32>,
    max_handshaking_connections: Option<u32>,
    max_connections_per_address: Option<u32>,
    #[serde(default, with = "humantime_serde")]
    handshake_timeout: Option<Duration>,
    max_streams_per_connection: Option<u32>,
    max_requests_per_stream: Option<u32>,
    memory_budget_bytes: Option<u64>,
    memory_budget_bytes_per_peer: Option<u64>,
    kv_cache_bytes: Option<u64>,
    kv_cache_bytes_per_peer: Option<u64>,
    free_memory_kept_bytes: Option<u64>,
    #[serde(default, with = "humantime_serde")]
    budget_wait: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    request_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    idle_connection_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    idle_stream_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    keepalive_interval: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    keepalive_timeout: Option<Duration>,
    stream_window_bytes: Option<u32>,
    connection_window_bytes: Option<u32>,
    max_frame_bytes: Option<u32>,
    #[serde(default, with = "humantime_serde")]
    answer_timeout: Option<Duration>,
    max_profile_repeats: Option<u32>,
    #[serde(default, with = "humantime_serde")]
    drain_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    drain_notice: Option<Duration>,
    dedup_window_requests: Option<u32>,
    dedup_window_bytes: Option<u64>,
    metrics_max_connections: Option<u32>,
    #[serde(default, with = "humantime_serde")]
    metrics_timeout: Option<Duration>,
}

impl RawServerLimits {
    fn split(self) -> (Limits, PeerLimits) {
        let l = Limits::default();
        let limits = Limits {
            max_message_bytes: self.max_message_bytes.unwrap_or(l.max_message_bytes),
            max_payload_bytes: self.max_payload_bytes.unwrap_or(l.max_payload_bytes),
            queue_depth: self.queue_depth.unwrap_or(l.queue_depth),
        };
        let p = PeerLimits::fitting(&limits);
        let max_connections = self.max_connections.unwrap_or(p.max_connections);
        let memory_budget_bytes = self.memory_budget_bytes.unwrap_or(p.memory_budget_bytes);
        let peers = PeerLimits {
            max_connections,
            max_handshaking_connections: self.max_handshaking_connections.unwrap_or(p.max_handshaking_connections),
            max_connections_per_address: self.max_connections_per_address.unwrap_or_else(|| PeerLimits::address_share_of(max_connections)),
            handshake_timeout: self.handshake_timeout.unwrap_or(p.handshake_timeout),
            max_streams_per_connection: self.max_streams_per_connection.unwrap_or(p.max_streams_per_connection),
            max_requests_per_stream: self.max_requests_per_stream.unwrap_or(p.max_requests_per_stream),
            memory_budget_bytes,
            memory_budget_bytes_per_peer: self.memory_budget_bytes_per_peer.unwrap_or(memory_budget_bytes / 4),
            kv_cache_bytes: self.kv_cache_bytes.unwrap_or(p.kv_cache_bytes),
            kv_cache_bytes_per_peer: self.kv_cache_bytes_per_peer.unwrap_or_else(|| self.kv_cache_bytes.unwrap_or(p.kv_cache_bytes) / 4),
            free_memory_kept_bytes: self.free_memory_kept_bytes.unwrap_or(p.free_memory_kept_bytes),
            budget_wait: self.budget_wait.unwrap_or(p.budget_wait),
            request_timeout: self.request_timeout.unwrap_or(p.request_timeout),
            idle_connection_timeout: self.idle_connection_timeout.unwrap_or(p.idle_connection_timeout),
            idle_stream_timeout: self.idle_stream_timeout.unwrap_or(p.idle_stream_timeout),
            keepalive_interval: self.keepalive_interval.unwrap_or(p.keepalive_interval),
            keepalive_timeout: self.keepalive_timeout.unwrap_or(p.keepalive_timeout),
            stream_window_bytes: self.stream_window_bytes.unwrap_or(p.stream_window_bytes),
            connection_window_bytes: self.connection_window_bytes.unwrap_or(p.connection_window_bytes),
            max_frame_bytes: self.max_frame_bytes.unwrap_or(p.max_frame_bytes),
            answer_timeout: self.answer_timeout.unwrap_or(p.answer_timeout),
            max_profile_repeats: self.max_profile_repeats.unwrap_or(p.max_profile_repeats),
            drain_timeout: self.drain_timeout.unwrap_or(p.drain_timeout),
            drain_notice: self.drain_notice.unwrap_or(p.drain_notice),
            dedup_window_requests: self.dedup_window_requests.unwrap_or(p.dedup_window_requests),
            dedup_window_bytes: self.dedup_window_bytes.unwrap_or(p.dedup_window_bytes),
            metrics_endpoint: EndpointLimits {
                max_connections: self.metrics_max_connections.unwrap_or(p.metrics_endpoint.max_connections),
                timeout: self.metrics_timeout.unwrap_or(p.metrics_endpoint.timeout),
            },
        };
        (limits, peers)
    }
}

/// What the server holds for its peers, all of them together: connections, streams, memory
/// and time. Every key sits under `limits:` in server.yaml (durations as `30s`, `500ms`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerLimits {
    /// Established connections (those that have made a call); the first call of one more is
    /// refused with RESOURCE_EXHAUSTED.
    pub max_connections: u32,
    /// Connections accepted whose first call has not come yet (TLS handshake, HTTP/2 preface);
    /// one more is closed as soon as it is accepted. They do not count against
    /// `max_connections`, so sockets that say nothing cannot lock callers out.
    pub max_handshaking_connections: u32,
    /// Sockets one peer address (an IPv6 peer's /64) may hold, handshaking or established: by
    /// default a quarter of `max_connections`, so that no one address takes every place. Behind
    /// a load balancer or a NAT, where every peer may arrive from one address, raise it to
    /// `max_connections`.
    pub max_connections_per_address: u32,
    /// From a connection's accept to its first call (TLS handshake and HTTP/2 preface
    /// included): longer and it is closed.
    pub handshake_timeout: Duration,
    /// Concurrent HTTP/2 streams (calls) per connection, announced in its SETTINGS.
    pub max_streams_per_connection: u32,
    /// Requests of one stream received and not yet answered; the stream is not read further
    /// until one is answered.
    pub max_requests_per_stream: u32,
    /// Bytes held by all streams together: requests (reassembly buffers and the boundaries
    /// they decode into), answers until written, and each call's largest message (from its
    /// prefix on: what tonic holds of it).
    pub memory_budget_bytes: u64,
    /// Of them, what one peer (an address, an IPv6 peer's /64) may hold: by default a quarter,
    /// so that a peer that sends much and reads little waits for its own bytes, not others'.
    /// One request takes at most the share less one message (`max_message_bytes`, its
    /// call's message buffer), or half the share where that is more: a peer that holds
    /// nothing else may still send the largest request the limits allow.
    pub memory_budget_bytes_per_peer: u64,
    /// Bytes the key/value caches of every generation session hold together, a budget of its
    /// own beside the memory budget (a session's caches live as long as the session, not a
    /// request): a session whose caches do not fit is refused RESOURCE_EXHAUSTED.
    pub kv_cache_bytes: u64,
    /// Of them, what one peer's sessions (an address, an IPv6 peer's /64) may hold: by default
    /// a quarter, so that no one peer takes the whole budget.
    pub kv_cache_bytes_per_peer: u64,
    /// Freed memory the allocator may keep for reuse beyond its low point: more (after a
    /// burst of peers' buffers) and it is given back to the system within a second
    /// (`allocator::Trimmer`). The stages' activations are reused from what it keeps.
    pub free_memory_kept_bytes: u64,
    /// How long a request waits for room in the budget before RESOURCE_EXHAUSTED.
    pub budget_wait: Duration,
    /// From a request's first frame to its last: longer is DEADLINE_EXCEEDED, its memory freed.
    pub request_timeout: Duration,
    /// A connection with no call open for this long is closed.
    pub idle_connection_timeout: Duration,
    /// How long an `Infer` stream may have no request in progress (none being received or
    /// answered) before the server ends it: a connection whose streams do nothing then holds
    /// no call and counts as idle. The host opens a new stream when it next sends.
    pub idle_stream_timeout: Duration,
    /// HTTP/2 PING interval on every connection.
    pub keepalive_interval: Duration,
    /// A connection whose PING is not answered within this is closed.
    pub keepalive_timeout: Duration,
    /// HTTP/2 receive window of each stream: request bytes a peer may send before the
    /// stream's reader takes them.
    pub stream_window_bytes: u32,
    /// HTTP/2 receive window of each connection: what h2 may buffer of a connection's request
    /// bytes not yet read, outside the memory budget (so at most `max_connections` times this).
    pub connection_window_bytes: u32,
    /// The largest HTTP/2 frame a peer may send, announced in SETTINGS: h2 holds a frame
    /// whole before it passes it on, so a connection may hold this much of one frame besides
    /// its window. Larger frames cut the per-frame work of a large boundary (16 KiB frames
    /// make a 3 MiB boundary 200 frames, each woken, copied and counted on its own).
    pub max_frame_bytes: u32,
    /// How long an answer (a result, a training answer, an `Echo` reply) may wait to be
    /// written to its connection, its bytes held in the memory budget: longer and its peer is
    /// not reading, and the connection is closed, freeing what every stream on it holds.
    pub answer_timeout: Duration,
    /// Timed passes a `Profile` call may ask for (it holds the compute worker between the
    /// requests it lets by; its batch is bounded by the bundle's range).
    pub max_profile_repeats: u32,
    /// On shutdown, how long requests in flight are given before every connection is closed.
    pub drain_timeout: Duration,
    /// On shutdown, how long health says NOT_SERVING while requests are still taken, before
    /// the drain: balancers (hosts with several servers, Kubernetes' endpoints) see it and
    /// send elsewhere, so that no request is refused UNAVAILABLE and sent again.
    pub drain_notice: Duration,
    /// Recent results kept so that a request its host resends after a broken connection is
    /// answered without computing it again (0: none kept).
    pub dedup_window_requests: u32,
    /// Tensor bytes those results may hold together.
    pub dedup_window_bytes: u64,
    /// What the metrics endpoint holds for scrapers (`metrics_max_connections`,
    /// `metrics_timeout`).
    pub metrics_endpoint: EndpointLimits,
}

impl Default for PeerLimits {
    fn default() -> Self {
        Self {
            max_connections: 256,
            // With the established ones, within the usual 1024 descriptors of a process.
            max_handshaking_connections: 512,
            max_connections_per_address: Self::address_share_of(256),
            handshake_timeout: Duration::from_secs(10),
            max_streams_per_connection: 32,
            max_requests_per_stream: 32,
            // Holds the largest request of the default limits (1 GiB) as received and decoded.
            memory_budget_bytes: 9 << 28,
            memory_budget_bytes_per_peer: 9 << 26,
            kv_cache_bytes: 1 << 30,
            kv_cache_bytes_per_peer: 1 << 28,
            // Above the activations a CPU stage chain frees and reuses on each request.
            free_memory_kept_bytes: 64 << 20,
            budget_wait: Duration::from_secs(2),
            request_timeout: Duration::from_secs(30),
            idle_connection_timeout: Duration::from_secs(300),
            idle_stream_timeout: Duration::from_secs(60),
            keepalive_interval: Duration::from_secs(30),
            keepalive_timeout: Duration::from_secs(10),
            // hyper's own defaults. 1 MiB at a 50 ms round trip is 20 MB/s a connection (raise
            // both on long fat links); 256 connections buffer at most 256 MiB unread. A stream
            // whose reader waits can take the whole connection window from its siblings (one
            // host's streams, as a rule): HTTP/2 returns it only as the data is read.
            stream_window_bytes: 1 << 20,
            connection_window_bytes: 1 << 20,
            // HTTP/2's initial size. 256 KiB made a loopback resnet18 boundary of 3 MiB 0.6 ms
            // faster, but under `make hostile-rss`'s slow readers the server's peak RSS rose
            // by about 200 MiB, past its bound (bench/README.md); raise it on trusted links.
            max_frame_bytes: 16 << 10,
            answer_timeout: Duration::from_secs(30),
            max_profile_repeats: 50,
            drain_timeout: Duration::from_secs(10),
            drain_notice: Duration::ZERO,
            dedup_window_requests: 1024,
            dedup_window_bytes: 256 << 20,
            metrics_endpoint: EndpointLimits::default(),
        }
    }
}

/// What the largest request holds: its tensors as decoded, and its data as received, which
/// the codec lets be larger than the tensors (our encoder stores a block that does not
/// shrink, but a peer may declare compressed blocks up to the compressor's bound, about
/// 100.4% for lz4; 110% covers every compressor, and 1 MiB a seal's tag and the headers);
/// and its call's message buffer, as large as the largest message (see `inbound`).
fn largest_request_bytes(limits: &Limits) -> u64 {
    let p = limits.max_payload_bytes;
    let read_buffer = limits.max_message_bytes.min(p.saturating_add(p / 10).saturating_add(1 << 20));
    p.saturating_add(p.saturating_add(p / 10)).saturating_add(1 << 20).saturating_add(read_buffer)
}

impl PeerLimits {
    /// The default share of one peer address: a quarter of `max_connections` (at least one).
    pub const fn address_share_of(max_connections: u32) -> u32 {
        if max_connections >= 4 {
            max_connections / 4
        } else {
            1
        }
    }

    /// The defaults, with the memory budget raised where `limits` allow larger requests than
    /// it holds.
    pub fn fitting(limits: &Limits) -> Self {
        let d = Self::default();
        let memory_budget_bytes = d.memory_budget_bytes.max(largest_request_bytes(limits));
        Self { memory_budget_bytes, memory_budget_bytes_per_peer: memory_budget_bytes / 4, ..d }
    }

    /// Checks every limit against the request limits; an error names the key (under
    /// `limits.`) and what it must be.
    pub fn validate(&self, limits: &Limits) -> Result<(), LimitError> {
        let positive = [
            ("limits.max_connections", u64::from(self.max_connections)),
            ("limits.max_handshaking_connections", u64::from(self.max_handshaking_connections)),
            ("limits.max_connections_per_address", u64::from(self.max_connections_per_address)),
            ("limits.handshake_timeout", self.handshake_timeout.as_millis() as u64),
            ("limits.max_streams_per_connection", u64::from(self.max_streams_per_connection)),
            ("limits.max_requests_per_stream", u64::from(self.max_requests_per_stream)),
            ("limits.request_timeout", self.request_timeout.as_millis() as u64),
            ("limits.answer_timeout", self.answer_timeout.as_millis() as u64),
            ("limits.idle_connection_timeout", self.idle_connection_timeout.as_millis() as u64),
            ("limits.idle_stream_timeout", self.idle_stream_timeout.as_millis() as u64),
            ("limits.keepalive_interval", self.keepalive_interval.as_millis() as u64),
            ("limits.keepalive_timeout", self.keepalive_timeout.as_millis() as u64),
            ("limits.max_profile_repeats", u64::from(self.max_profile_repeats)),
            ("limits.memory_budget_bytes_per_peer", self.memory_budget_bytes_per_peer),
            ("limits.kv_cache_bytes", self.kv_cache_bytes),
            ("limits.kv_cache_bytes_per_peer", self.kv_cache_bytes_per_peer),
            ("limits.metrics_max_connections", u64::from(self.metrics_endpoint.max_connections)),
            ("limits.metrics_timeout", self.metrics_endpoint.timeout.as_millis() as u64),
        ];
        if let Some(&(key, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(LimitError::new(key, LimitRule::Positive));
        }
        // HTTP/2 windows run from its initial 65,535 bytes to 2^31 - 1.
        let windows = [("limits.stream_window_bytes", self.stream_window_bytes), ("limits.connection_window_bytes", self.connection_window_bytes)];
        if let Some(&(key, _)) = windows.iter().find(|(_, w)| !(65_535..=i32::MAX as u32).contains(w)) {
            return Err(LimitError::new(key, LimitRule::Http2Range { min: 65_535, max: i32::MAX as u64 }));
        }
        // HTTP/2 frames run from 16,384 bytes to 2^24 - 1.
        if !(16_384..=(1 << 24) - 1).contains(&self.max_frame_bytes) {
            return Err(LimitError::new("limits.max_frame_bytes", LimitRule::Http2Range { min: 16_384, max: (1 << 24) - 1 }));
        }
        if self.connection_window_bytes < self.stream_window_bytes {
            let stream = LimitRule::AtLeastLimit { key: "limits.stream_window_bytes", value: u64::from(self.stream_window_bytes) };
            return Err(LimitError::new("limits.connection_window_bytes", stream));
        }
        let largest = largest_request_bytes(limits);
        if self.memory_budget_bytes < largest {
            return Err(LimitError::new("limits.memory_budget_bytes", LimitRule::LargestRequest(largest)));
        }
        Ok(())
    }
}

/// `training:` in server.yaml.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServerTraining {
    #[serde(default)]
    checkpoint_dir: Option<PathBuf>,
    #[serde(default)]
    concurrent_sessions: bool,
    #[serde(default, with = "humantime_serde")]
    session_idle_timeout: Option<Duration>,
    #[serde(default)]
    max_sessions: Option<u32>,
    #[serde(default)]
    max_sessions_per_peer: Option<u32>,
    #[serde(default)]
    max_checkpoints: Option<u32>,
    #[serde(default)]
    max_checkpoint_bytes: Option<u64>,
    #[serde(default)]
    max_checkpoint_bytes_total: Option<u64>,
    #[serde(default)]
    max_pipeline_depth: Option<u32>,
    #[serde(default)]
    max_kept_answer_bytes: Option<u64>,
    #[serde(default, with = "humantime_serde")]
    client_wait_timeout: Option<Duration>,
}

/// How a server runs training sessions.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainingOptions {
    /// Where sessions write checkpoints and resume from, each session in its own namespace
    /// (`NAMESPACE/NAME.safetensors`); none: a session cannot save.
    pub checkpoint_dir: Option<PathBuf>,
    /// Allow several sessions on the bundle at once, each training its own copy.
    pub concurrent_sessions: bool,
    /// A session whose host sends nothing for this long is closed (a vanished host never
    /// locks the others out).
    pub session_idle_timeout: Duration,
    /// Sessions open at once (with `concurrent_sessions`; otherwise one).
    pub max_sessions: u32,
    /// Of them, what one peer (an address, an IPv6 peer's /64) may hold, a client group's
    /// sessions counting once: by default half (at least one), so that no one peer takes
    /// every place of the few there are.
    pub max_sessions_per_peer: u32,
    /// Checkpoints one namespace may hold (overwriting one of them counts once).
    pub max_checkpoints: u32,
    /// Bytes on disk one namespace's checkpoints may hold together, the one being saved
    /// included (a save that would go over is refused before it is written, or after, by its
    /// file's size, before it is renamed into place).
    pub max_checkpoint_bytes: u64,
    /// Bytes on disk every namespace's checkpoints may hold together (each session gets a
    /// namespace of its own, so the per-namespace quota alone bounds nothing server-wide); a
    /// save over it is refused, and nothing is deleted without an operator.
    pub max_checkpoint_bytes_total: u64,
    /// Calls a session's host may have in flight (pipelined micro-batches): the session keeps
    /// that many answers (the tensors of one batch's boundary gradients, outside the memory
    /// budget), so that every call resent after a broken connection is answered from memory.
    pub max_pipeline_depth: u32,
    /// Tensor bytes the answers a session keeps for resent calls may hold besides its last
    /// one (which it always keeps, outside the memory budget, as a step of one call needs):
    /// older answers past it are let go, and a call resent for one of them is refused (its
    /// micro-batch out of order) rather than run twice.
    pub max_kept_answer_bytes: u64,
    /// How long a session of a client group waits for the others (its turn to step, the
    /// end of a round) while the group makes no progress, before its call is refused naming
    /// the edges it waited for. A waiting session is not idle. Longer than
    /// `session_idle_timeout` by default: a vanished edge's session keeps its place that long.
    pub client_wait_timeout: Duration,
}

impl Default for TrainingOptions {
    fn default() -> Self {
        Self {
            checkpoint_dir: None,
            concurrent_sessions: false,
            session_idle_timeout: Duration::from_secs(600),
            max_sessions: 4,
            max_sessions_per_peer: 2,
            max_checkpoints: 64,
            max_checkpoint_bytes: 4 << 30,
            max_checkpoint_bytes_total: 16 << 30,
            max_pipeline_depth: 8,
            max_kept_answer_bytes: 64 << 20,
            client_wait_timeout: Duration::from_secs(900),
        }
    }
}

/// `codecs:` in server.yaml: what the server accepts (everything when absent).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAcceptedCodecs {
    #[serde(default)]
    precisions: Option<Vec<String>>,
    #[serde(default)]
    compressions: Option<Vec<String>>,
}

/// `encryption:` in server.yaml.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServerEncryption {
    #[serde(default)]
    required: bool,
    keys: Vec<RawKey>,
}

/// One key: its id and where it is read from.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawKey {
    id: u32,
    #[serde(default)]
    file: Option<PathBuf>,
    #[serde(default)]
    env: Option<String>,
}

/// `server.yaml`, validated.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// The models served (bundle paths relative to the config file), at least one.
    pub models: Vec<ModelConfig>,
    /// How each device's scheduler orders its work.
    pub scheduler: SchedulerConfig,
    /// Where Prometheus scrapes the metrics (`GET /metrics`); none: not served.
    pub metrics_listen: Option<SocketAddr>,
    /// A plaintext listener with the gRPC health service alone, for an orchestrator's probes
    /// when `listen` takes TLS (Kubernetes' gRPC probes do not speak it); none: not served.
    pub health_listen: Option<SocketAddr>,
    /// What a request may carry.
    pub limits: Limits,
    /// What the server holds for its peers.
    pub peers: PeerLimits,
    /// Accepted codecs, keys, TLS and token.
    pub security: ServerSecurity,
    /// Training sessions (`training:`; checkpoints default to `checkpoints/` beside the file).
    pub training: TrainingOptions,
    /// Generation sessions (`generation:`).
    pub generation: GenerationOptions,
    /// `insecure: true`: serve another machine without TLS or without a token, on purpose.
    pub insecure: bool,
    /// libtorch's threads per operator and the cores (`threads:`, `cores:`).
    pub cpu: CpuUse,
    /// How log lines are written (`log_format: text | json`).
    pub log_format: LogFormat,
    /// Where traces go (`telemetry:`; none by default).
    pub telemetry: Telemetry,
}

impl ServerConfig {
    /// Reads and validates a server config file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let file = ConfigFile { path };
        let mut raw: RawServerConfig = file.read_yaml()?;
        let security = server_security(&file, &mut raw)?;
        let listen: SocketAddr =
            raw.listen.parse().map_err(|_| file.invalid("listen", format!("{:?} is not an address like 0.0.0.0:50051", raw.listen)))?;
        // Other machines reach a non-loopback address: without TLS anyone on the path reads
        // and alters boundaries, without a token anyone may use the GPU.
        if !listen.ip().is_loopback() && !raw.insecure && (security.tls.is_none() || !security.tokens.required()) {
            let missing = match (security.tls.is_none(), !security.tokens.required()) {
                (true, true) => "`tls` and `auth`",
                (true, false) => "`tls`",
                _ => "`auth` (a bearer token)",
            };
            return Err(file.invalid(
                "listen",
                format!("{listen} is reachable from other machines: configure {missing}, or write `insecure: true` to serve it as it is"),
            ));
        }
        let models = served_models(&file, &mut raw)?;
        let mut scheduler = match &raw.scheduler {
            None => SchedulerConfig::default(),
            Some(value) => SchedulerConfig::from_yaml(&file, value)?,
        };
        if let Some(name) = &raw.on_device_failure {
            scheduler.on_device_failure = DeviceFailurePolicy::from_name(&file, name)?;
        }
        let metrics_listen = match &raw.metrics_listen {
            None => None,
            Some(text) => Some(text.parse().map_err(|_| file.invalid("metrics_listen", format!("{text:?} is not an address like 127.0.0.1:9464")))?),
        };
        let health_listen = match &raw.health_listen {
            None => None,
            Some(text) => Some(text.parse().map_err(|_| file.invalid("health_listen", format!("{text:?} is not an address like 0.0.0.0:50052")))?),
        };
        let (limits, peers) = raw.limits.split();
        let limits = file.limits("", limits)?;
        peers.validate(&limits).map_err(|e| file.invalid(e.key, e.to_string()))?;
        let training = training_options(&file, raw.training.take())?;
        let generation = generation::options(&file, raw.generation.take())?;
        let cpu = file.cpu(raw.threads, raw.cores.take())?;
        raw.telemetry.check().map_err(|e| file.invalid(e.key(), e.to_string()))?;
        Ok(Self {
            listen,
            models,
            scheduler,
            metrics_listen,
            health_listen,
            limits,
            peers,
            security,
            training,
            generation,
            insecure: raw.insecure,
            cpu,
            log_format: raw.log_format,
            telemetry: raw.telemetry,
        })
    }
}

/// `training:` in server.yaml, checked (a checkpoint directory by default, beside the file).
fn training_options(file: &ConfigFile<'_>, raw: Option<RawServerTraining>) -> Result<TrainingOptions, ConfigError> {
    let d = TrainingOptions::default();
    let training = match raw {
        None => TrainingOptions { checkpoint_dir: Some(file.resolve(Path::new("checkpoints"))), ..d },
        Some(t) => TrainingOptions {
            checkpoint_dir: Some(file.resolve(t.checkpoint_dir.as_deref().unwrap_or(Path::new("checkpoints")))),
            concurrent_sessions: t.concurrent_sessions,
            session_idle_timeout: t.session_idle_timeout.unwrap_or(d.session_idle_timeout),
            max_sessions: t.max_sessions.unwrap_or(d.max_sessions),
            max_sessions_per_peer: t.max_sessions_per_peer.unwrap_or_else(|| (t.max_sessions.unwrap_or(d.max_sessions) / 2).max(1)),
            max_checkpoints: t.max_checkpoints.unwrap_or(d.max_checkpoints),
            max_checkpoint_bytes: t.max_checkpoint_bytes.unwrap_or(d.max_checkpoint_bytes),
            max_checkpoint_bytes_total: t.max_checkpoint_bytes_total.unwrap_or(d.max_checkpoint_bytes_total),
            max_pipeline_depth: t.max_pipeline_depth.unwrap_or(d.max_pipeline_depth),
            max_kept_answer_bytes: t.max_kept_answer_bytes.unwrap_or(d.max_kept_answer_bytes),
            client_wait_timeout: t.client_wait_timeout.unwrap_or(d.client_wait_timeout),
        },
    };
    if training.session_idle_timeout.is_zero() {
        return Err(file.invalid("training.session_idle_timeout", "must be positive"));
    }
    if training.client_wait_timeout.is_zero() {
        return Err(file.invalid("training.client_wait_timeout", "must be positive"));
    }
    if training.max_sessions == 0 {
        return Err(file.invalid("training.max_sessions", "must be positive"));
    }
    if training.max_sessions_per_peer == 0 {
        return Err(file.invalid("training.max_sessions_per_peer", "must be positive"));
    }
    if training.max_pipeline_depth == 0 {
        return Err(file.invalid("training.max_pipeline_depth", "must be positive"));
    }
    if training.max_checkpoints == 0 {
        return Err(file.invalid("training.max_checkpoints", "must be positive"));
    }
    if training.max_checkpoint_bytes == 0 {
        return Err(file.invalid("training.max_checkpoint_bytes", "must be positive"));
    }
    if training.max_checkpoint_bytes_total == 0 {
        return Err(file.invalid("training.max_checkpoint_bytes_total", "must be positive"));
    }
    Ok(training)
}

/// The `bundle:` form (one model, its keys at the top level) or the `models:` list; not both.
fn served_models(file: &ConfigFile<'_>, raw: &mut RawServerConfig) -> Result<Vec<ModelConfig>, ConfigError> {
    match (raw.bundle.take(), raw.models.take()) {
        (Some(bundle), None) => {
            let model = models::RawModel {
                bundle,
                device: raw.device.take(),
                batching: raw.batching.take(),
                slo_ms: raw.slo_ms.take(),
                priority: raw.priority.take(),
                warm_batches: raw.warm_batches.take(),
                kinds: raw.kinds.take(),
            };
            Ok(vec![ModelConfig::from_raw(file, "", model)?])
        }
        (None, Some(list)) => {
            let stray = [
                ("device", raw.device.is_some()),
                ("batching", raw.batching.is_some()),
                ("slo_ms", raw.slo_ms.is_some()),
                ("priority", raw.priority.is_some()),
                ("warm_batches", raw.warm_batches.is_some()),
                ("kinds", raw.kinds.is_some()),
            ];
            if let Some((key, _)) = stray.iter().find(|(_, set)| *set) {
                return Err(file.invalid(key, "with `models:`, write it in each model's entry"));
            }
            if list.is_empty() {
                return Err(file.invalid("models", "list at least one model: - {bundle: path, device: cuda:0}"));
            }
            list.into_iter().enumerate().map(|(i, m)| ModelConfig::from_raw(file, &format!("models[{i}]"), m)).collect()
        }
        (Some(_), Some(_)) => Err(file.invalid("models", "write either `bundle:` (one model) or `models:` (a list), not both")),
        (None, None) => Err(file.invalid("bundle", "missing: write `bundle:` (one model) or `models:` (a list of them)")),
    }
}

/// The accepted codecs, the keys, the TLS identity and the token of a server config.
fn server_security(file: &ConfigFile<'_>, raw: &mut RawServerConfig) -> Result<ServerSecurity, ConfigError> {
    let mut policy = CodecPolicy::default();
    if let Some(codecs) = raw.codecs.take() {
        if let Some(names) = codecs.precisions {
            policy.precisions = names
                .iter()
                .map(|n| {
                    Precision::ALL
                        .into_iter()
                        .find(|p| p.name() == n)
                        .ok_or_else(|| file.invalid("codecs.precisions", format!("{n:?} is not a precision (full, fp16, bf16, int8)")))
                })
                .collect::<Result<_, _>>()?;
        }
        if let Some(names) = codecs.compressions {
            if let Some(bad) = names.iter().find(|n| !["none", "lz4", "zstd"].contains(&n.as_str())) {
                return Err(file.invalid("codecs.compressions", format!("{bad:?} is not a compression (none, lz4, zstd)")));
            }
            policy.compressions = names;
        }
    }
    let mut keys = KeyRing::default();
    if let Some(enc) = raw.encryption.take() {
        if enc.keys.is_empty() {
            return Err(file.invalid("encryption.keys", "list at least one key: { id: 1, file: path } or { id: 1, env: VAR }"));
        }
        let pairs = enc
            .keys
            .into_iter()
            .enumerate()
            .map(|(i, k)| Ok((k.id, file.key(&format!("encryption.keys[{i}]"), k.file, k.env)?)))
            .collect::<Result<Vec<_>, ConfigError>>()?;
        keys = KeyRing::new(pairs).map_err(|e| file.invalid("encryption.keys", e.to_string()))?;
        policy.require_encryption = enc.required;
    }
    Ok(ServerSecurity { policy, keys, tls: file.identity("tls", raw.tls.take())?, tokens: file.server_tokens(raw.auth.take())? })
}

#[cfg(test)]
mod tests {
    use cleave_common::DeviceSpec;

    use super::*;

    fn load(yaml: &str) -> Result<ServerConfig, String> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("server.yaml");
        std::fs::write(&path, format!("bundle: b\n{yaml}")).unwrap();
        ServerConfig::load(&path).map_err(|e| e.to_string())
    }

    #[test]
    fn a_token_for_each_client_is_read_by_name_and_bad_ones_are_refused() {
        use cleave_common::security::ServerTokens;
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = ("the-token-of-edge-a-0123456789", "the-token-of-edge-b-0123456789");
        for (file, token) in [("a", a), ("b", b), ("same", a)] {
            std::fs::write(dir.path().join(file), token).unwrap();
        }
        let load = |auth: &str| {
            let path = dir.path().join("server.yaml");
            std::fs::write(&path, format!("bundle: b\nlisten: 127.0.0.1:1\nauth: {auth}\n")).unwrap();
            ServerConfig::load(&path).map_err(|e| e.to_string())
        };
        let bearer = |token: &str| format!("Bearer {token}").into_bytes();
        let named = load("{tokens: {edge-a: {file: a}, edge.b_2: {file: b}}}").unwrap().security.tokens;
        assert!(matches!(&named, ServerTokens::Named(t) if t.len() == 2));
        assert_eq!((named.name_of(&bearer(a)), named.name_of(&bearer(b))), (Some("edge-a"), Some("edge.b_2")));
        assert!(named.take(&bearer(b)) && !named.take(&bearer("the-token-of-edge-c-0123456789")) && !named.take(a.as_bytes()));
        let shared = load("{token: {file: a}}").unwrap().security.tokens;
        assert!(matches!(shared, ServerTokens::Shared(_)) && shared.take(&bearer(a)) && shared.name_of(&bearer(a)).is_none());
        for (auth, says) in [
            (
                "{token: {file: a}, tokens: {x: {file: b}}}",
                "`auth`: give `token` (one, every client's) or `tokens` (one a client, by name), not both",
            ),
            ("{tokens: {}}", "`auth`: give `token: {file: F}`"),
            ("{tokens: {'an edge': {file: a}}}", "`auth.tokens.an edge`: a client's name is 1 to 64 letters"),
            ("{tokens: {x: {file: a}, y: {file: same}}}", "`auth.tokens.y`: the same token as `x`"),
        ] {
            let err = load(auth).unwrap_err();
            assert!(err.contains(says), "{auth}: {err}");
        }
    }

    #[test]
    fn the_budget_holds_the_largest_request_of_every_codec() {
        use cleave_common::wire::{Direction, PayloadMeta, PayloadReceiver, PayloadSender};
        use cleave_common::{Boundary, Value};
        assert_eq!(PeerLimits::fitting(&Limits::default()), PeerLimits::default());
        assert!(PeerLimits::default().validate(&Limits::default()).is_ok());
        // Tensors of exactly the payload limit that do not compress: every codec holds them
        // and their data, stored block by block where compressing would not shrink them.
        let limits = Limits { max_payload_bytes: 1 << 20, ..Limits::default() };
        let t = tch::Tensor::randint(i64::from(i32::MAX), [1 << 18], (tch::Kind::Int, tch::Device::Cpu));
        let boundary = Boundary { values: vec![("x".into(), Value::Tensor(t))] };
        let floor = largest_request_bytes(&limits);
        for codec in ["raw", "lz4", "zstd", "shuffle+lz4", "shuffle+zstd-19"] {
            let meta = PayloadMeta { request_id: 1, split: 0, direction: Direction::Request };
            let e = PayloadSender::plain().encode(meta, &codec.parse().unwrap(), &boundary).unwrap();
            let rx = PayloadReceiver::new(Direction::Request, limits.max_payload_bytes, CodecPolicy::default(), &KeyRing::default());
            // And its call's message buffer, as large as the one frame it comes in (with 64 bytes
            // for the frame's fields and gRPC's prefix).
            let held = rx.start(1, &e.envelope).unwrap().held_bytes() + (e.envelope.len() + e.data.len() + 64) as u64;
            assert!(held <= floor, "{codec}: {held} bytes held, the smallest budget allowed is {floor}");
            if codec != "raw" {
                let held = rx.start(1, &e.envelope).unwrap().held_bytes();
                assert_eq!(held, 2 * limits.max_payload_bytes, "{codec}: incompressible blocks are stored, never larger");
            }
        }
    }

    #[test]
    fn another_machine_is_served_only_with_tls_and_a_token_or_insecure_written() {
        let err = load("listen: 0.0.0.0:50051\n").unwrap_err();
        assert!(
            err.contains("`listen`: 0.0.0.0:50051 is reachable from other machines: configure `tls` and `auth`, or write `insecure: true`"),
            "{err}"
        );
        assert!(load("listen: 0.0.0.0:50051\ninsecure: true\n").unwrap().insecure);
        assert!(load("listen: 127.0.0.1:50051\n").is_ok());
        assert!(load("listen: \"[::1]:50051\"\n").is_ok());
    }

    #[test]
    fn every_limit_is_a_key_with_a_default_and_a_bad_value_names_its_key() {
        let c = load("listen: 127.0.0.1:1\n").unwrap();
        assert_eq!((c.limits, c.peers), (Limits::default(), PeerLimits::default()));
        assert_eq!(c.training.session_idle_timeout, TrainingOptions::default().session_idle_timeout);
        let c = load(
            "listen: 127.0.0.1:1\nlimits:\n  max_connections: 3\n  max_streams_per_connection: 4\n  max_requests_per_stream: 5\n  \
             memory_budget_bytes: 3221225472\n  kv_cache_bytes: 65536\n  free_memory_kept_bytes: 1048576\n  budget_wait: 250ms\n  request_timeout: 7s\n  idle_connection_timeout: 1m\n  idle_stream_timeout: 45s\n  \
             keepalive_interval: 9s\n  keepalive_timeout: 3s\n  answer_timeout: 12s\n  stream_window_bytes: 65536\n  connection_window_bytes: 131072\n  max_frame_bytes: 65536\n  max_profile_repeats: 6\n  \
             drain_timeout: 2s\n  drain_notice: 1s\n  dedup_window_requests: 10\n  dedup_window_bytes: 4096\n  max_handshaking_connections: 7\n  \
             max_connections_per_address: 2\n  handshake_timeout: 4s\n  metrics_max_connections: 3\n  metrics_timeout: 2s\ntraining:\n  session_idle_timeout: 90s\n  max_sessions: 2\n  max_pipeline_depth: 3\n  max_kept_answer_bytes: 1024\n  client_wait_timeout: 7s\n",
        )
        .unwrap();
        let want = PeerLimits {
            max_connections: 3,
            max_streams_per_connection: 4,
            max_requests_per_stream: 5,
            memory_budget_bytes: 3 << 30,
            // A quarter of the budget where the key is not set.
            memory_budget_bytes_per_peer: 3 << 28,
            kv_cache_bytes: 65536,
            kv_cache_bytes_per_peer: 16384,
            free_memory_kept_bytes: 1 << 20,
            budget_wait: Duration::from_millis(250),
            request_timeout: Duration::from_secs(7),
            idle_connection_timeout: Duration::from_secs(60),
            idle_stream_timeout: Duration::from_secs(45),
            keepalive_interval: Duration::from_secs(9),
            keepalive_timeout: Duration::from_secs(3),
            stream_window_bytes: 65536,
            connection_window_bytes: 131072,
            max_frame_bytes: 65536,
            answer_timeout: Duration::from_secs(12),
            max_profile_repeats: 6,
            drain_timeout: Duration::from_secs(2),
            drain_notice: Duration::from_secs(1),
            dedup_window_requests: 10,
            dedup_window_bytes: 4096,
            max_handshaking_connections: 7,
            max_connections_per_address: 2,
            handshake_timeout: Duration::from_secs(4),
            metrics_endpoint: EndpointLimits { max_connections: 3, timeout: Duration::from_secs(2) },
        };
        assert_eq!(c.peers, want);
        assert_eq!((c.training.session_idle_timeout, c.training.max_sessions), (Duration::from_secs(90), 2));
        assert_eq!(c.training.max_sessions_per_peer, 1, "half of max_sessions (2)");
        let one = load("listen: 127.0.0.1:1\ntraining: {max_sessions: 1}\n").unwrap();
        assert_eq!(one.training.max_sessions_per_peer, 1, "at least one");
        assert_eq!((c.training.max_pipeline_depth, c.training.max_kept_answer_bytes), (3, 1024));
        assert_eq!(c.training.client_wait_timeout, Duration::from_secs(7));
        assert_eq!(c.generation, GenerationOptions::default());
        let c = load(
            "listen: 127.0.0.1:1\ngeneration: {max_sessions: 3, session_idle_timeout: 20s, max_batch: 4, max_wait: 2ms, prefill_chunk_tokens: 64}\n",
        )
        .unwrap();
        let want = GenerationOptions {
            max_sessions: 3,
            max_sessions_per_peer: 1,
            session_idle_timeout: Duration::from_secs(20),
            max_batch: 4,
            max_wait: Duration::from_millis(2),
            prefill_chunk_tokens: 64,
        };
        assert_eq!(c.generation, want);
        for (yaml, key, says) in [
            ("limits: {max_connections: 0}", "limits.max_connections", "must be positive"),
            ("limits: {kv_cache_bytes_per_peer: 0}", "limits.kv_cache_bytes_per_peer", "must be positive"),
            ("limits: {memory_budget_bytes_per_peer: 0}", "limits.memory_budget_bytes_per_peer", "must be positive"),
            ("training: {max_sessions_per_peer: 0}", "training.max_sessions_per_peer", "must be positive"),
            ("generation: {max_sessions_per_peer: 0}", "generation.max_sessions_per_peer", "must be positive"),
            ("limits: {request_timeout: 0s}", "limits.request_timeout", "must be positive"),
            ("limits: {handshake_timeout: 0s}", "limits.handshake_timeout", "must be positive"),
            ("limits: {max_handshaking_connections: 0}", "limits.max_handshaking_connections", "must be positive"),
            ("limits: {max_connections_per_address: 0}", "limits.max_connections_per_address", "must be positive"),
            ("limits: {metrics_max_connections: 0}", "limits.metrics_max_connections", "must be positive"),
            ("limits: {metrics_timeout: 0s}", "limits.metrics_timeout", "must be positive"),
            ("limits: {memory_budget_bytes: 2147483648}", "limits.memory_budget_bytes", "at least 2.1 x limits.max_payload_bytes + 1 MiB"),
            ("limits: {answer_timeout: 0s}", "limits.answer_timeout", "must be positive"),
            ("limits: {kv_cache_bytes: 0}", "limits.kv_cache_bytes", "must be positive"),
            ("generation: {max_sessions: 0}", "generation.max_sessions", "must be positive"),
            ("generation: {session_idle_timeout: 0s}", "generation.session_idle_timeout", "must be positive"),
            ("generation: {max_batch: 0}", "generation.max_batch", "must be positive"),
            ("generation: {max_wait: 2s}", "generation.max_wait", "at most 1s"),
            ("generation: {prefill_chunk_tokens: 0}", "generation.prefill_chunk_tokens", "must be positive"),
            ("limits: {stream_window_bytes: 1024}", "limits.stream_window_bytes", "from 65535"),
            ("limits: {stream_window_bytes: 8388608}", "limits.connection_window_bytes", "at least limits.stream_window_bytes"),
            ("limits: {max_frame_bytes: 1024}", "limits.max_frame_bytes", "from 16384"),
            ("limits: {max_frame_bytes: 16777216}", "limits.max_frame_bytes", "to 16777215"),
            ("training: {max_sessions: 0}", "training.max_sessions", "must be positive"),
            ("training: {max_pipeline_depth: 0}", "training.max_pipeline_depth", "must be positive"),
            ("training: {client_wait_timeout: 0s}", "training.client_wait_timeout", "must be positive"),
        ] {
            let err = load(&format!("listen: 127.0.0.1:1\n{yaml}\n")).unwrap_err();
            assert!(err.contains(&format!("`{key}`")) && err.contains(says), "{yaml}: {err}");
        }
        let err = load("listen: 127.0.0.1:1\nlimits: {request_timeout: soon}\n").unwrap_err();
        assert!(err.contains("request_timeout"), "{err}");
    }

    #[test]
    fn checkpoint_quotas_are_keys_with_defaults_and_must_be_positive() {
        let d = TrainingOptions::default();
        assert_eq!((d.max_checkpoints, d.max_checkpoint_bytes, d.max_checkpoint_bytes_total), (64, 4 << 30, 16 << 30));
        let c = load("listen: 127.0.0.1:1\ntraining: {checkpoint_dir: ck}\n").unwrap();
        assert_eq!((c.training.max_checkpoints, c.training.max_checkpoint_bytes), (d.max_checkpoints, d.max_checkpoint_bytes));
        let c =
            load("listen: 127.0.0.1:1\ntraining:\n  max_checkpoints: 3\n  max_checkpoint_bytes: 1048576\n  max_checkpoint_bytes_total: 2097152\n")
                .unwrap();
        assert_eq!((c.training.max_checkpoints, c.training.max_checkpoint_bytes, c.training.max_checkpoint_bytes_total), (3, 1 << 20, 2 << 20));
        for (yaml, key) in [
            ("training: {max_checkpoints: 0}", "training.max_checkpoints"),
            ("training: {max_checkpoint_bytes: 0}", "training.max_checkpoint_bytes"),
            ("training: {max_checkpoint_bytes_total: 0}", "training.max_checkpoint_bytes_total"),
        ] {
            let err = load(&format!("listen: 127.0.0.1:1\n{yaml}\n")).unwrap_err();
            assert!(err.contains(&format!("`{key}`")) && err.contains("must be positive"), "{yaml}: {err}");
        }
        let err = load("listen: 127.0.0.1:1\ntraining: {max_checkpoint_bytes: lots}\n").unwrap_err();
        assert!(err.contains("max_checkpoint_bytes"), "{err}");
    }

    #[test]
    fn one_bundle_or_a_list_of_models_each_with_its_batching_target_and_priority() {
        let one = load("listen: 127.0.0.1:1\ndevice: cpu\nbatching: {max_batch: 8}\nslo_ms: 40\n").unwrap();
        assert_eq!(one.models.len(), 1);
        let m = &one.models[0];
        assert!(m.bundle.ends_with("b"));
        assert_eq!((m.device, m.batching.max_batch, m.batching.max_wait, m.batching.merge_cuts), (DeviceSpec::Cpu, 8, Duration::ZERO, true));
        assert_eq!((m.slo, m.priority), (Some(Duration::from_millis(40)), 1.0));
        assert_eq!(one.scheduler, SchedulerConfig::default());
        assert_eq!((one.metrics_listen, one.health_listen), (None, None));
        assert_eq!(load("listen: 127.0.0.1:1\nwarm_batches: [1, 8]\n").unwrap().models[0].warm_batches, [1, 8]);
        let err = load("listen: 127.0.0.1:1\nwarm_batches: [0]\n").unwrap_err();
        assert!(err.contains("`warm_batches`") && err.contains("at least 1"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("server.yaml");
        std::fs::write(&path, "listen: 127.0.0.1:1\nmodels:\n  - {bundle: a, warm_batches: [4, -1]}\n").unwrap();
        let err = ServerConfig::load(&path).unwrap_err().to_string();
        assert!(err.contains("`models[0].warm_batches`"), "{err}");
        // Defaults: no batching (bit-identical results), no target, nothing warmed beyond the
        // smallest batch and the batch limit.
        let plain = &load("listen: 127.0.0.1:1\n").unwrap().models[0];
        assert!(plain.warm_batches.is_empty());
        assert_eq!((plain.batching, plain.slo), (Batching::default(), None));
        assert_eq!(Batching::default().max_batch, 1);

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("server.yaml");
        std::fs::write(
            &path,
            "listen: 127.0.0.1:1\nmodels:\n  - {bundle: a, device: cpu, batching: {max_batch: 16, max_wait_ms: 5, merge_cuts: false}, slo_ms: 50, priority: 2}\n  \
             - {bundle: b}\nscheduler: {policy: edf, max_age_ms: 500}\non_device_failure: restart\nmetrics_listen: 127.0.0.1:9464\nhealth_listen: 127.0.0.1:50052\n",
        )
        .unwrap();
        let many = ServerConfig::load(&path).unwrap();
        assert_eq!(many.models.len(), 2);
        assert_eq!(many.models[0].bundle, dir.path().join("a"));
        assert_eq!(many.models[0].batching, Batching { max_batch: 16, max_wait: Duration::from_millis(5), merge_cuts: false });
        assert_eq!((many.models[0].slo, many.models[0].priority), (Some(Duration::from_millis(50)), 2.0));
        let restart = DeviceFailurePolicy::Restart;
        assert_eq!(many.scheduler, SchedulerConfig { policy: Policy::Edf, max_age: Duration::from_millis(500), on_device_failure: restart });
        assert_eq!(one.scheduler.on_device_failure, DeviceFailurePolicy::Exit);
        assert_eq!(many.metrics_listen, Some("127.0.0.1:9464".parse().unwrap()));
        assert_eq!(many.health_listen, Some("127.0.0.1:50052".parse().unwrap()));
        assert_eq!(load("listen: 127.0.0.1:1\nscheduler: edf\n").unwrap().scheduler.policy, Policy::Edf);
    }

    #[test]
    fn bad_model_and_scheduler_keys_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("server.yaml");
        let load_raw = |yaml: &str| {
            std::fs::write(&path, format!("listen: 127.0.0.1:1\n{yaml}\n")).unwrap();
            ServerConfig::load(&path).map_err(|e| e.to_string())
        };
        for (yaml, key, says) in [
            ("bundle: b\nmodels: [{bundle: c}]", "models", "not both"),
            ("", "bundle", "`models:`"),
            ("models: []", "models", "at least one"),
            ("models: [{bundle: c}]\nslo_ms: 5", "slo_ms", "each model's entry"),
            ("models: [{bundle: c, batching: {max_batch: 0}}]", "models[0].batching.max_batch", "at least 1"),
            ("models: [{bundle: c, batching: {max_wait_ms: 60000}}]", "models[0].batching.max_wait_ms", "at most 10000"),
            ("models: [{bundle: c}, {bundle: d, priority: 0}]", "models[1].priority", "positive"),
            ("bundle: b\nslo_ms: 0", "slo_ms", "positive"),
            ("bundle: b\nscheduler: lifo", "scheduler", "fifo or edf"),
            ("bundle: b\nscheduler: {policy: edf, max_age_ms: 0}", "scheduler.max_age_ms", "positive"),
            ("bundle: b\nscheduler: {policy: edf, age: 3}", "scheduler", "unknown key"),
            ("bundle: b\nmetrics_listen: anywhere", "metrics_listen", "not an address"),
            ("bundle: b\nhealth_listen: anywhere", "health_listen", "not an address"),
            ("bundle: b\non_device_failure: reboot", "on_device_failure", "exit or restart"),
            ("bundle: b\ntelemetry: {sample_ratio: 1.5}", "telemetry.sample_ratio", "between 0 and 1"),
            ("bundle: b\ntelemetry: {otlp_endpoint: collector:4317}", "telemetry.otlp_endpoint", "http://localhost:4317"),
            ("models: [{bundle: c}]\nkinds: {train: {slo_ms: 5}}", "kinds", "each model's entry"),
            ("models: [{bundle: c, kinds: {train: {priority: 0}}}]", "models[0].kinds.train.priority", "positive"),
            ("bundle: b\nkinds: {generate: {slo_ms: 0}}", "kinds.generate.slo_ms", "positive"),
        ] {
            let err = load_raw(yaml).unwrap_err();
            assert!(err.contains(&format!("`{key}`")) && err.contains(says), "{yaml}: {err}");
        }
        assert!(load_raw("models: [{bundle: c, batch: 3}]").unwrap_err().contains("unknown field `batch`"));
        assert!(load_raw("bundle: b\nkinds: {infer: {slo_ms: 5}}").unwrap_err().contains("unknown field `infer`"));
        assert!(load_raw("bundle: b\nkinds: {train: {deadline_ms: 5}}").unwrap_err().contains("unknown field `deadline_ms`"));
    }

    #[test]
    fn each_kind_of_a_model_s_work_has_its_target_and_priority() {
        let ms = |n| Some(Duration::from_millis(n));
        let plain = load("listen: 127.0.0.1:1\ndevice: cpu\nslo_ms: 40\npriority: 2\n").unwrap();
        let m = &plain.models[0];
        // Generation steps are keyed as the model's requests; training calls have no target.
        assert_eq!(m.generate_target(), WorkTarget { slo: ms(40), priority: 2.0 });
        assert_eq!(m.train, WorkTarget { slo: None, priority: 1.0 });
        let yaml = "listen: 127.0.0.1:1\ndevice: cpu\nslo_ms: 40\nkinds: {generate: {slo_ms: 200}, train: {slo_ms: 1000, priority: 0.5}}\n";
        let kinds = load(yaml).unwrap();
        let m = &kinds.models[0];
        assert_eq!((m.slo, m.priority), (ms(40), 1.0));
        assert_eq!(m.generate_target(), WorkTarget { slo: ms(200), priority: 1.0 });
        assert_eq!(m.train, WorkTarget { slo: ms(1000), priority: 0.5 });
    }
}
