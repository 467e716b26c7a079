//! The GPU side of cleave.
//!
//! The server loads each model's whole bundle once, on its device, so that it can run the
//! suffix `[s, N)` of any split point a host asks for; hosts select a model by bundle id.
//!
//! - [`PreparedServer::prepare_models`] checks the limits and loads the models before any
//!   port is bound; [`PreparedServer::serve`] serves on a listener until `shutdown` resolves
//!   (tests and `host --loopback` bind `127.0.0.1:0`).
//! - [`config`]: `server.yaml`, raw then validated (models and scheduler in its `models`).
//! - `models`: the models served, selected by the bundle id a call carries.
//! - `service`: the tonic service; every stream opens through its one skeleton
//!   (`open_stream`: model, drain, answers, reader), then its kind's task takes over.
//! - `streams`: what an open stream is made of (`OpenStream`), and its kinds.
//! - `infer`: the `Infer` stream (reader and responder tasks).
//! - `training`: the `Train` stream: `admission` (who may train), `session` (each session's
//!   own thread, stages, optimizer and checkpoints), `stream` (calls answered in order).
//! - `payloads`: decoding requests and encoding answers (on the blocking pool where that is
//!   real work).
//! - `scheduler`: one thread per device that owns its models' stages and picks what runs
//!   next: merged batches, profiles, training turns (the rules: `cleave_common::scheduling`;
//!   `watch`: a thread that dies is restarted or reported, per `on_device_failure`).
//! - `health`: what the health service says of the server and of each model.
//! - [`metrics`]: Prometheus metrics and their endpoint.
//! - `unsent`: what answers hold in the memory budget until written to their connection.
//! - `window`: recent results, so that a request resent after a broken connection is
//!   answered without computing it again.
//! - `error`: why a call failed, and the one map from errors to gRPC statuses.
//! - [`write_dev_secrets`]: `server dev-secrets`.
//! - [`check`]: `server check`, every split against the bundle's references on the device.
//! - [`allocator`]: glibc's allocator tuned, and a trimmer thread that gives freed memory
//!   back after a burst (the `server` binary).

// Libraries return what they found and hand progress to their caller; binaries print.
#![warn(clippy::print_stdout, clippy::print_stderr)]

pub mod allocator;
mod budget;
pub mod config;
mod connections;
mod dev_secrets;
mod error;
mod generation;
mod health;
mod inbound;
mod infer;
mod log_every;
pub mod metrics;
mod models;
mod payloads;
mod peer;
mod reader;
mod scheduler;
mod service;
mod streams;
mod training;
mod unsent;
mod window;

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use cleave_common::config::Limits;
use cleave_common::device::device_name;
use cleave_common::pb::split_inference_server::SplitInferenceServer;
use cleave_common::security::{ServerSecurity, TlsIdentity};
use cleave_common::verify::{verify_generation, verify_splits, GenerationCheck, VerifyReport};
use cleave_common::{Bundle, DeviceSpec};
use cleave_tables::verify_table;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;

pub use budget::MemoryBudget;
pub use config::{
    Batching, DeviceFailurePolicy, GenerationOptions, ModelConfig, PeerLimits, Policy, SchedulerConfig, ServerConfig, TrainingOptions, WorkTarget,
};
pub use dev_secrets::{write_dev_secrets, DevSecrets, DevSecretsError};
pub use error::ServerError;
pub use health::LIVENESS;
pub use metrics::Metrics;
pub use window::ResultWindow;

/// How long a failed accept waits before the next one.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// A server whose models are loaded on their devices, ready to serve.
pub struct PreparedServer {
    service: service::Service,
    /// Where Prometheus scrapes the metrics, when configured.
    metrics_listen: Option<std::net::SocketAddr>,
    /// The plaintext listener of the health service alone, when configured.
    health_listener: Option<TcpListener>,
    /// The devices' failures and restarts, which health and the server's exit follow.
    device_events: tokio::sync::mpsc::UnboundedReceiver<scheduler::watch::DeviceEvent>,
}

impl PreparedServer {
    /// One model on `device`, unbatched, with the default scheduler.
    pub fn prepare(bundle_dir: &std::path::Path, device: DeviceSpec, limits: Limits, security: ServerSecurity) -> Result<Self, ServerError> {
        Self::prepare_models(&[ModelConfig::new(bundle_dir, device)], SchedulerConfig::default(), limits, security)
    }

    /// Opens every model's bundle, loads its stages on its device and starts one scheduler
    /// per device (`scheduler.on_device_failure`: what happens when one dies).
    pub fn prepare_models(models: &[ModelConfig], scheduler: SchedulerConfig, limits: Limits, security: ServerSecurity) -> Result<Self, ServerError> {
        limits.validate().map_err(ServerError::Limits)?;
        let peers = PeerLimits::fitting(&limits);
        peers.validate(&limits).map_err(ServerError::Limits)?;
        // Each CUDA device once, however many models it holds (its memory is read per scrape).
        let mut cuda: Vec<(String, u32)> = models
            .iter()
            .filter_map(|m| match m.device.resolve() {
                Ok(tch::Device::Cuda(i)) => Some((device_name(tch::Device::Cuda(i)), i as u32)),
                _ => None,
            })
            .collect();
        cuda.sort_unstable();
        cuda.dedup();
        let metrics = Metrics::new(cuda);
        let (events, device_events) = tokio::sync::mpsc::unbounded_channel();
        let context = scheduler::watch::SchedulerContext { config: scheduler, depth: limits.queue_depth as usize, metrics: metrics.clone(), events };
        let models = models::Models::load(models, &context)?;
        let budget = MemoryBudget::new(peers.memory_budget_bytes, peers.memory_budget_bytes_per_peer, limits.max_message_bytes, peers.budget_wait);
        metrics.watch_memory_budget(budget.clone());
        let generation = generation::admission::Generation::new(
            GenerationOptions::default(),
            peers.kv_cache_bytes,
            peers.kv_cache_bytes_per_peer,
            metrics.clone(),
        );
        let service = service::Service {
            step_queues: generation::queue::StepQueues::new(generation.clone(), budget.clone(), metrics.clone()),
            generation,
            models,
            limits,
            security: Arc::new(security),
            metrics,
            training: training::admission::Training::new(TrainingOptions::default()),
            parking: training::parking::Parking::default(),
            peers,
            budget,
            window: ResultWindow::new(peers.dedup_window_requests as usize, peers.dedup_window_bytes),
            draining: CancellationToken::new(),
            profiling: Arc::new(tokio::sync::Semaphore::new(1)),
        };
        Ok(Self { service, metrics_listen: None, health_listener: None, device_events })
    }

    /// Sets what the server holds for its peers (connections, streams, memory, time).
    pub fn with_peer_limits(mut self, peers: PeerLimits) -> Result<Self, ServerError> {
        peers.validate(&self.service.limits).map_err(ServerError::Limits)?;
        self.service.peers = peers;
        let message = self.service.limits.max_message_bytes;
        self.service.budget = MemoryBudget::new(peers.memory_budget_bytes, peers.memory_budget_bytes_per_peer, message, peers.budget_wait);
        self.service.metrics.watch_memory_budget(self.service.budget.clone());
        self.set_generation(self.service.generation.options());
        self.service.window = ResultWindow::new(peers.dedup_window_requests as usize, peers.dedup_window_bytes);
        Ok(self)
    }

    /// The memory budget every stream's requests share (to watch what it holds).
    pub fn memory_budget(&self) -> MemoryBudget {
        self.service.budget.clone()
    }

    /// The window of recent results resent requests are answered from (to watch its hits).
    pub fn result_window(&self) -> ResultWindow {
        self.service.window.clone()
    }

    /// Sets how training sessions run (checkpoint directory, concurrent sessions).
    pub fn with_training(mut self, options: TrainingOptions) -> Self {
        self.service.training = training::admission::Training::new(options);
        self
    }

    /// Sets how generation sessions run (places, idle timeout, batching).
    pub fn with_generation(mut self, options: GenerationOptions) -> Self {
        self.set_generation(options);
        self
    }

    /// Generation sessions' places and step queues of `options`, within the peers' cache
    /// budget and the memory budget.
    fn set_generation(&mut self, options: GenerationOptions) {
        let s = &mut self.service;
        s.generation = generation::admission::Generation::new(options, s.peers.kv_cache_bytes, s.peers.kv_cache_bytes_per_peer, s.metrics.clone());
        s.step_queues = generation::queue::StepQueues::new(s.generation.clone(), s.budget.clone(), s.metrics.clone());
    }

    /// From a validated `server.yaml`.
    pub fn from_config(config: &ServerConfig) -> Result<Self, ServerError> {
        let mut server = Self::prepare_models(&config.models, config.scheduler, config.limits, config.security.clone())?
            .with_training(config.training.clone())
            .with_peer_limits(config.peers)?
            .with_generation(config.generation);
        server.metrics_listen = config.metrics_listen;
        Ok(server)
    }

    /// Also serves the gRPC health service alone, in plaintext and without the token, on
    /// `listener` (`health_listen`): probes that cannot speak TLS read it there. It says no
    /// more than SERVING or NOT_SERVING.
    pub fn with_health_listener(mut self, listener: TcpListener) -> Self {
        self.health_listener = Some(listener);
        self
    }

    /// The server's metrics (what `GET /metrics` renders).
    pub fn metrics(&self) -> Metrics {
        self.service.metrics.clone()
    }

    /// Each model served: bundle id and device, as `id on device`.
    pub fn models(&self) -> Vec<String> {
        self.service.models.all().iter().map(|m| format!("{} on {}", m.bundle.short_id(), m.device)).collect()
    }

    /// Whether it serves over TLS.
    pub fn uses_tls(&self) -> bool {
        self.service.security.tls.is_some()
    }

    /// Tests only: a handle that makes a device's scheduler thread die.
    #[cfg(feature = "fault-injection")]
    pub fn device_faults(&self) -> DeviceFaults {
        DeviceFaults { models: self.service.models.clone() }
    }

    /// Serves on `listener` until `shutdown` resolves, or a device is down for good, then
    /// drains: health NOT_SERVING at once, no new calls, the requests every stream has
    /// received answered, and every connection closed after `limits.drain_timeout` whatever
    /// its peer does. A device down ends it with [`ServerError::DeviceFailed`] after the drain.
    pub async fn serve(self, listener: TcpListener, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<(), ServerError> {
        let mut device_events = self.device_events;
        let limits = self.service.limits;
        let peers = self.service.peers;
        let draining = self.service.draining.clone();
        let max_message = limits.max_message_bytes as usize;
        let security = Arc::clone(&self.service.security);
        let metrics = self.service.metrics.clone();
        let inbound =
            connections::CallTracking::new(self.service.budget.clone(), limits.max_message_bytes, peers.request_timeout, security.tokens.clone());
        let (health_reporter, health_service) = tonic_health::server::health_reporter();
        let model_ids = self.service.models.all().iter().map(|m| m.bundle.id().to_string()).collect();
        let health = health::Health::serving(health_reporter, model_ids).await;
        let _health_only = self.health_listener.map(|listener| serve_health_only(listener, health_service.clone(), &peers, metrics.clone()));
        let inference = SplitInferenceServer::new(self.service).max_decoding_message_size(max_message).max_encoding_message_size(max_message);
        let tokens = security.tokens.clone();
        let inference = tonic::service::interceptor::InterceptedService::new(inference, move |request| service::check_token(&tokens, request));
        let builder = http2_server(&peers, security.tls.as_ref())?;
        let connections = Arc::new(connections::Connections::new(&peers, metrics));
        let incoming = accept(listener, Arc::clone(&connections));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let serving = builder.layer(inbound).add_service(health_service).add_service(inference).serve_with_incoming_shutdown(incoming, async {
            let _ = stopped.await;
        });
        tokio::pin!(serving);
        let down = tokio::select! {
            served = &mut serving => return served.map_err(ServerError::Serve),
            () = shutdown => None,
            down = health.follow(&mut device_events) => Some(down),
        };
        match &down {
            None => tracing::info!(drain_timeout = ?peers.drain_timeout, "draining: answering the requests received, then closing"),
            Some(e) => tracing::error!(drain_timeout = ?peers.drain_timeout, "{e}: draining the other devices' requests, then exiting"),
        }
        health.not_serving().await;
        if down.is_none() && !peers.drain_notice.is_zero() {
            tracing::info!(drain_notice = ?peers.drain_notice, "NOT_SERVING: still taking requests while balancers see it (`limits.drain_notice`)");
            tokio::time::sleep(peers.drain_notice).await;
        }
        draining.cancel();
        let _ = stop.send(());
        let drained = match tokio::time::timeout(peers.drain_timeout, &mut serving).await {
            Ok(served) => served.map_err(ServerError::Serve),
            Err(_) => {
                tracing::warn!(
                    open = connections.open(),
                    "the drain took longer than {:?} (`limits.drain_timeout`): closing every connection",
                    peers.drain_timeout
                );
                connections.close_all();
                let _ = tokio::time::timeout(Duration::from_secs(1), serving).await;
                Ok(())
            }
        };
        drained?;
        down.map_or(Ok(()), Err)
    }
}

/// Tests only: makes a device's scheduler thread die as a bug in it would, to show what the
/// server does then (`on_device_failure`).
#[cfg(feature = "fault-injection")]
pub struct DeviceFaults {
    models: models::Models,
}

#[cfg(feature = "fault-injection")]
impl DeviceFaults {
    /// Makes the scheduler thread of `device` (`cpu`, `cuda:0`) panic with `message`,
    /// outside any request, when it takes its next work.
    pub fn crash(&self, device: &str, message: &str) {
        let model = self.models.all().iter().find(|m| m.device == device).unwrap_or_else(|| panic!("no model runs on {device}"));
        model.scheduler.crash(message);
    }
}

/// Sockets closed at once are logged at most once this often (all counted in
/// `cleave_connections_refused_total`).
const REFUSED_LOG_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// The accepted connections: Nagle's algorithm off on each (small messages, a training
/// step's gradient say, must not wait for delayed ACKs), one past
/// `limits.max_handshaking_connections` or its address's share closed at once (the oldest
/// handshaking one gives way first), and a failed accept (out of file descriptors, say) waiting a moment before
/// the next: tonic goes on accepting after an error, and retrying at once would spin a core
/// while the descriptors stay taken.
fn accept(
    listener: TcpListener,
    connections: Arc<connections::Connections>,
) -> impl tokio_stream::Stream<Item = std::io::Result<connections::TrackedIo>> {
    // A flood of sockets would write a line each.
    let mut refused = log_every::LogEvery::new(REFUSED_LOG_EVERY);
    TcpListenerStream::new(listener)
        .then(|stream| async move {
            match stream {
                Ok(stream) => stream.set_nodelay(true).map(|()| Some(stream)),
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a connection failed; waiting before the next");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    Err(e)
                }
            }
        })
        .filter_map(move |accepted| match accepted {
            Ok(Some(stream)) => {
                let peer = stream.peer_addr().ok();
                match connections.admit(stream) {
                    Ok(tracked) => Some(Ok(tracked)),
                    Err(refusal) => {
                        if let Some(unlogged) = refused.came(std::time::Instant::now()) {
                            tracing::warn!(?peer, unlogged, "a connection closed at once: {refusal} (`cleave_connections_refused_total`)");
                        }
                        None
                    }
                }
            }
            Ok(None) => None,
            Err(e) => Some(Err(e)),
        })
}

/// What a server that has started listens on and asks of its peers: what `server` prints
/// once its models are loaded and its sockets bound.
#[derive(Debug, Clone)]
pub struct Listening {
    /// The models served, by name.
    pub models: Vec<String>,
    /// The gRPC address bound.
    pub addr: std::net::SocketAddr,
    /// The metrics endpoint's address, when `metrics_listen` is set.
    pub metrics: Option<std::net::SocketAddr>,
    /// The plaintext health listener's address, when `health_listen` is set.
    pub health: Option<std::net::SocketAddr>,
    /// Whether connections use TLS.
    pub tls: bool,
    /// Whether calls need the bearer token.
    pub token: bool,
    /// The payload keys' ids (none: payloads cannot be encrypted).
    pub key_ids: Vec<u32>,
    /// Whether every payload must be encrypted.
    pub encryption_required: bool,
    /// Where training checkpoints go (`training.checkpoint_dir`), when set.
    pub checkpoint_dir: Option<std::path::PathBuf>,
}

impl std::fmt::Display for Listening {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(metrics) = self.metrics {
            writeln!(f, "metrics on http://{metrics}/metrics")?;
        }
        if let Some(health) = self.health {
            writeln!(f, "health (grpc.health.v1, plaintext) on {health}")?;
        }
        write!(
            f,
            "serving {} on {} ({}, {}, {})",
            self.models.join(", "),
            self.addr,
            if self.tls { "TLS" } else { "plaintext" },
            if self.token { "bearer token required" } else { "no token" },
            match (self.key_ids.is_empty(), self.encryption_required) {
                (true, _) => "payload encryption unavailable".to_string(),
                (false, true) => format!("AES-256-GCM payloads required, key ids {:?}", self.key_ids),
                (false, false) => format!("AES-256-GCM payloads accepted, key ids {:?}", self.key_ids),
            }
        )?;
        // Created when a training session first saves (relative to the config unless set).
        if let Some(dir) = &self.checkpoint_dir {
            write!(f, "\ntraining checkpoints go to {} (`training.checkpoint_dir`)", dir.display())?;
        }
        Ok(())
    }
}

/// `server --config server.yaml`: validate, load, bind, tell `started` where it listens, then
/// serve until SIGINT or SIGTERM.
pub async fn run(config: ServerConfig, started: impl FnOnce(&Listening)) -> Result<(), ServerError> {
    // Opening the bundle hashes every file and loading it takes seconds: not on the runtime.
    let prepared = config.clone();
    let server = tokio::task::spawn_blocking(move || PreparedServer::from_config(&prepared)).await.map_err(ServerError::Loading)??;
    let listen_error = |error| ServerError::Listen { addr: config.listen.to_string(), error };
    let listener = TcpListener::bind(config.listen).await.map_err(listen_error)?;
    let mut server = server;
    let mut health = None;
    if let Some(addr) = config.health_listen {
        let health_error = |error| ServerError::Listen { addr: addr.to_string(), error };
        let health_listener = TcpListener::bind(addr).await.map_err(health_error)?;
        health = Some(health_listener.local_addr().map_err(health_error)?);
        server = server.with_health_listener(health_listener);
    }
    let mut metrics = None;
    if let Some(addr) = server.metrics_listen {
        let metrics_error = |error| ServerError::Metrics { addr: addr.to_string(), error };
        let metrics_listener = std::net::TcpListener::bind(addr).map_err(metrics_error)?;
        metrics = Some(metrics_listener.local_addr().map_err(metrics_error)?);
        // Served until the process exits (a scrape during the drain still sees the server), on
        // a thread and runtime of its own: scrapers never take the gRPC runtime's time.
        metrics::spawn(metrics_listener, server.metrics(), config.peers.metrics_endpoint).map_err(metrics_error)?;
    }
    if config.insecure && !config.listen.ip().is_loopback() && !server.uses_tls() {
        tracing::warn!(listen = %config.listen, "listening in plaintext on a non-loopback address: anyone on the path can read and alter boundaries; configure `tls`");
    }
    let s = &config.security;
    started(&Listening {
        models: server.models(),
        addr: listener.local_addr().map_err(listen_error)?,
        metrics,
        health,
        tls: server.uses_tls(),
        token: s.tokens.required(),
        key_ids: s.keys.ids(),
        encryption_required: s.policy.require_encryption,
        checkpoint_dir: config.training.checkpoint_dir.clone(),
    });
    server.serve(listener, shutdown_signal()).await
}

/// The HTTP/2 server cleave's inference listener runs on: TLS with `tls` (plaintext where
/// absent), and the windows, frame size, streams and keepalive of `peers`. The receive
/// windows bound what h2 buffers of requests not yet read; payloads are already raw or
/// compressed, so gRPC compression stays off. (`grpc-floor`'s echo serves on it too, so that
/// the floor it measures has the server's settings.)
pub fn http2_server(peers: &PeerLimits, tls: Option<&TlsIdentity>) -> Result<tonic::transport::Server, ServerError> {
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        let identity = tonic::transport::Identity::from_pem(&tls.cert_pem, &tls.key_pem[..]);
        builder = builder
            .tls_config(tonic::transport::ServerTlsConfig::new().identity(identity).timeout(peers.handshake_timeout))
            .map_err(ServerError::Tls)?;
    }
    Ok(builder
        .initial_stream_window_size(Some(peers.stream_window_bytes))
        .initial_connection_window_size(Some(peers.connection_window_bytes))
        .max_frame_size(Some(peers.max_frame_bytes))
        .max_concurrent_streams(Some(peers.max_streams_per_connection))
        .http2_keepalive_interval(Some(peers.keepalive_interval))
        .http2_keepalive_timeout(Some(peers.keepalive_timeout)))
}

/// Serves `health` alone on `listener` until the guard it returns is dropped (the server has
/// drained). Its connections are accepted as the main listener's are (the same caps, in
/// places of their own) and never established: each is closed `handshake_timeout` after it
/// was accepted, time for a probe's `Check`, not for a `Watch` held open.
fn serve_health_only<S>(listener: TcpListener, health: S, peers: &PeerLimits, metrics: Metrics) -> tokio_util::task::AbortOnDropHandle<()>
where
    S: tower::Service<http::Request<tonic::body::Body>, Response = http::Response<tonic::body::Body>, Error = std::convert::Infallible>
        + tonic::server::NamedService
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    let connections = Arc::new(connections::Connections::new(peers, metrics));
    let serving = tonic::transport::Server::builder()
        .timeout(peers.handshake_timeout)
        .max_concurrent_streams(Some(4))
        .add_service(health)
        .serve_with_incoming(accept(listener, connections));
    tokio_util::task::AbortOnDropHandle::new(tokio::spawn(async move {
        if let Err(e) = serving.await {
            tracing::warn!(error = %e, "the health listener stopped");
        }
    }))
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            s.recv().await;
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { () = ctrl_c => {}, () = term => {} }
    tracing::info!("shutting down: answering requests in flight");
}

/// What `server check` checks.
#[derive(Debug, Clone)]
pub struct CheckOptions {
    /// The bundle directory.
    pub bundle: PathBuf,
    /// The device to serve from.
    pub device: DeviceSpec,
}

/// What `server check` found: every split at every reference batch size, and how a
/// request lands on the device.
pub struct CheckReport {
    /// The bundle and the device it ran on.
    pub header: String,
    /// The bundle's stage count.
    pub stages: usize,
    /// Each reference batch size's report.
    pub batches: Vec<(i64, VerifyReport)>,
    /// Whether a request's bytes landed in pinned host memory (said, not failed).
    pub pinned: String,
    /// The generation stages run whole with their caches on the device, where the bundle
    /// has them (`--generation`).
    pub generation: Option<GenerationCheck>,
}

impl CheckReport {
    /// Whether every split matched at every batch size.
    pub fn passed(&self) -> bool {
        self.batches.iter().all(|(_, r)| r.passed()) && self.generation.as_ref().is_none_or(GenerationCheck::passed)
    }
}

impl std::fmt::Display for CheckReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "{}", self.header)?;
        for (batch, report) in &self.batches {
            writeln!(f, "batch {batch}: {} stages loaded on {} in {:.0} ms", self.stages, report.device, report.load_ms)?;
            writeln!(f, "{}", verify_table(report))?;
        }
        writeln!(f, "received into pinned host memory: {}", self.pinned)?;
        if let Some(g) = &self.generation {
            writeln!(
                f,
                "generation on {}: a {}-token prompt then {} decode steps, teacher-forced: relative error {:.1e} (tolerance {:.0e}), {:.2} ms a decode step",
                g.device, g.prompt, g.steps, g.relative_error, g.tolerance, g.step_ms
            )?;
        }
        f.write_str(if self.passed() { "check passed" } else { "CHECK FAILED: outputs differ from the reference" })
    }
}

/// Loads the bundle on the device and runs every split at every reference batch size.
pub fn check(opts: &CheckOptions) -> Result<CheckReport, ServerError> {
    let bundle = Bundle::open(&opts.bundle)?;
    let device = opts.device.resolve()?;
    let header = format!(
        "bundle {} ({}), id {}; device {} resolves to {}",
        opts.bundle.display(),
        bundle.manifest().model.source,
        bundle.id(),
        opts.device,
        device_name(device)
    );
    let batches = bundle
        .reference_batches()
        .into_iter()
        .map(|batch| Ok((batch, verify_splits(&bundle, opts.device, batch)?)))
        .collect::<Result<Vec<_>, ServerError>>()?;
    let generation = verify_generation(&bundle, opts.device)?;
    Ok(CheckReport { header, stages: bundle.stage_count(), batches, pinned: pinned_landing(&bundle, device), generation })
}

/// On a CUDA device, a request at the middle cut received as the server receives one (raw,
/// through the checks) and run from where it landed: whether its bytes were in pinned host
/// memory, and the output against the reference. Said, not failed: pinning is for speed.
fn pinned_landing(bundle: &Bundle, device: tch::Device) -> String {
    use cleave_common::wire::{Codec, CodecPolicy, Direction, KeyRing, PayloadMeta, PayloadReceiver, PayloadSender};
    use cleave_common::{LoadedStages, StageRange};
    let tch::Device::Cuda(index) = device else {
        return format!("not used ({})", device_name(device));
    };
    let run = || -> Result<String, Box<dyn std::error::Error + Send + Sync>> {
        let stages = LoadedStages::load(bundle, StageRange::all(bundle), DeviceSpec::Cuda(index))?;
        let (input, reference) = bundle.reference(bundle.reference_batches()[0])?;
        let cut = bundle.stage_count() / 2;
        let middle = stages.run(StageRange::prefix(cut), &input)?.to_device(tch::Device::Cpu);
        let meta = PayloadMeta { request_id: 1, split: cut as u32, direction: Direction::Request };
        // SAFETY: `middle` was just copied from the device to the CPU: no other handle has it.
        #[allow(unsafe_code)]
        let sent = unsafe { PayloadSender::plain().encode_owned(meta, &Codec::RAW, middle)? };
        let mut receiver = PayloadReceiver::new(Direction::Request, u64::MAX, CodecPolicy::default(), &KeyRing::default())
            .checked_against(bundle)
            .landing_for(device);
        let mut assembly = receiver.start(1, &sent.envelope)?;
        assembly.push_data(1, &sent.data)?;
        let received = receiver.finish(assembly)?;
        let total = received.boundary.tensor_bytes() as u64;
        let output = stages.run(StageRange::suffix(bundle, cut), &received.boundary)?;
        let error = output.max_relative_error(&reference);
        let verdict = if received.pinned_bytes == total { "yes" } else { "NO" };
        Ok(format!(
            "{verdict}, {} of {total} bytes at cut {cut}; the rest of the model run from them: relative error {error:.1e}",
            received.pinned_bytes
        ))
    };
    run().unwrap_or_else(|e| format!("failed: {e:#}"))
}
