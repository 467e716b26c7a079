//! What the server counts, for Prometheus: `GET /metrics` on `metrics_listen`, in the
//! OpenMetrics text format (which Prometheus reads), through the `prometheus-client` crate.
//!
//! Per model (label `model`, the bundle id): requests answered by gRPC code, queue depth,
//! merged batch sizes, requests merged at a later cut, queue / compute / total durations,
//! bytes in and out, latency-target misses. Per server: open streams by kind and open training sessions. Per device: its
//! scheduler's failures and restarts; per CUDA device, the memory this process holds there,
//! read from NVML when a scrape comes.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Metric, Registry};
use tokio::net::TcpListener;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLabel {
    model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CodeLabels {
    model: String,
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AbandonedLabels {
    model: String,
    at: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BudgetLabel {
    budget: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeviceLabel {
    device: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeviceWorkLabels {
    device: String,
    kind: String,
}

type Histograms = Family<ModelLabel, Histogram, fn() -> Histogram>;

fn seconds() -> Histogram {
    // 0.1 ms to about 26 s.
    Histogram::new(exponential_buckets(1e-4, 2.0, 19))
}

fn samples() -> Histogram {
    // 1, 2, 4 ... 256 samples.
    Histogram::new(exponential_buckets(1.0, 2.0, 9))
}

/// The server's metrics; cheap to clone (every clone counts into the same registry).
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

struct Inner {
    registry: Registry,
    requests: Family<CodeLabels, Counter>,
    queue_depth: Family<ModelLabel, Gauge>,
    batch_samples: Histograms,
    queue_seconds: Histograms,
    compute_seconds: Histograms,
    total_seconds: Histograms,
    bytes_in: Family<ModelLabel, Counter>,
    bytes_out: Family<ModelLabel, Counter>,
    copied_in: Family<ModelLabel, Counter>,
    pinned_in: Family<ModelLabel, Counter>,
    copied_out: Family<ModelLabel, Counter>,
    slo_misses: Family<ModelLabel, Counter>,
    cut_merges: Family<ModelLabel, Counter>,
    open_streams: Family<KindLabel, Gauge>,
    abandoned: Family<AbandonedLabels, Counter>,
    answer_timeouts: Counter,
    handshakes_given_way: Counter,
    connections_refused: Family<ReasonLabel, Counter>,
    device_failures: Family<DeviceLabel, Counter>,
    device_restarts: Family<DeviceLabel, Counter>,
    training_sessions: Gauge,
    generation_sessions: Gauge,
    generation_steps: Family<ModelLabel, Counter>,
    generation_batched_steps: Family<ModelLabel, Counter>,
    device_work: Family<DeviceWorkLabels, Counter>,
    device_busy: Family<DeviceWorkLabels, Counter<f64, std::sync::atomic::AtomicU64>>,
    budget_bytes: Family<BudgetLabel, Gauge>,
    held_bytes: Family<BudgetLabel, Gauge>,
    /// The request memory budget, read at each scrape.
    memory_budget: std::sync::Mutex<Option<crate::budget::MemoryBudget>>,
    device_memory: Family<DeviceLabel, Gauge>,
    cuda_devices: Vec<(String, u32)>,
}

/// One answered request, as the metrics see it.
pub(crate) struct Answered<'a> {
    pub(crate) model: &'a str,
    /// The gRPC code it was answered with (`OK` for a result).
    pub(crate) code: tonic::Code,
    pub(crate) queue: Duration,
    pub(crate) compute: Duration,
    /// From its first frame to its answer being framed.
    pub(crate) total: Duration,
    pub(crate) bytes_out: u64,
    /// Bytes of the result copied as they were to send it.
    pub(crate) copied_bytes: u64,
    pub(crate) slo: Option<Duration>,
}

/// Registers `metric` under `name` and gives it back to be kept.
fn registered<M: Metric + Clone>(registry: &mut Registry, name: &str, help: &str, metric: M) -> M {
    registry.register(name, help, metric.clone());
    metric
}

impl Metrics {
    /// A registry with every family; `cuda_devices` are the (name, index) of the CUDA devices
    /// models run on (their memory is read at each scrape).
    pub fn new(cuda_devices: Vec<(String, u32)>) -> Self {
        let mut registry = Registry::with_prefix("cleave");
        let r = &mut registry;
        let inner = Inner {
            requests: registered(r, "requests", "Requests answered, by model and gRPC code", Family::default()),
            queue_depth: registered(r, "queue_depth", "Requests waiting for their device, by model", Family::default()),
            batch_samples: registered(r, "batch_samples", "Samples in each batch a device ran, by model", Family::new_with_constructor(samples)),
            queue_seconds: registered(r, "queue_seconds", "Time a request waited for its device", Family::new_with_constructor(seconds)),
            compute_seconds: registered(r, "compute_seconds", "Time the device ran a request's batches", Family::new_with_constructor(seconds)),
            total_seconds: registered(r, "request_seconds", "Time from a request's first frame to its answer", Family::new_with_constructor(seconds)),
            bytes_in: registered(r, "received_bytes", "Payload bytes received (requests and training calls)", Family::default()),
            bytes_out: registered(r, "sent_bytes", "Payload bytes sent (results and training answers)", Family::default()),
            copied_in: registered(
                r,
                "received_copied_bytes",
                "Bytes of requests copied as they were to receive them: frames into tensors, decoding (gRPC's own copies not counted)",
                Family::default(),
            ),
            pinned_in: registered(
                r,
                "received_pinned_bytes",
                "Bytes of requests received into pinned host memory (models on CUDA devices), copied to the device without blocking",
                Family::default(),
            ),
            copied_out: registered(
                r,
                "sent_copied_bytes",
                "Bytes of results copied as they were to send them (none for a raw result sent from its tensors' memory)",
                Family::default(),
            ),
            slo_misses: registered(r, "slo_misses", "Requests answered later than their model's slo_ms", Family::default()),
            cut_merges: registered(r, "cut_merges", "Requests run up to a later cut to join the requests waiting there", Family::default()),
            open_streams: registered(r, "open_streams", "Infer and Train streams open", Family::default()),
            abandoned: registered(
                r,
                "abandoned_requests",
                "Requests and training calls dropped because their stream went (reset, connection closed), by model and where: queued (never started) or running (stopped at a stage boundary)",
                Family::default(),
            ),
            answer_timeouts: registered(
                r,
                "answer_timeouts",
                "Connections closed because an answer on them was not written within limits.answer_timeout (their peer did not read)",
                Counter::default(),
            ),
            handshakes_given_way: registered(
                r,
                "handshakes_given_way",
                "Handshaking connections closed to make room for a newer one: every place under limits.max_handshaking_connections was taken",
                Counter::default(),
            ),
            connections_refused: registered(
                r,
                "connections_refused",
                "Sockets closed as soon as they were accepted, by reason: address_share (limits.max_connections_per_address) or handshakes (limits.max_handshaking_connections, none could give way)",
                Family::default(),
            ),
            device_failures: registered(
                r,
                "device_failures",
                "Times a device's scheduler thread died (see on_device_failure), by device",
                Family::default(),
            ),
            device_restarts: registered(
                r,
                "device_restarts",
                "Times a device's models were reloaded on a new thread after it died, by device",
                Family::default(),
            ),
            training_sessions: registered(r, "training_sessions", "Training sessions open", Gauge::default()),
            generation_sessions: registered(r, "generation_sessions", "Generation sessions open", Gauge::default()),
            generation_steps: registered(r, "generation_steps", "Generation steps answered with their output, by model", Family::default()),
            generation_batched_steps: registered(
                r,
                "generation_batched_steps",
                "Generation decode steps run in one batch with other sessions' (continuous batching), by model",
                Family::default(),
            ),
            device_work: registered(
                r,
                "device_work",
                "What a device's scheduler ran, by device and kind: infer (a batch of requests, to the last cut or the next where others wait), generate (a batch of generation steps, or a prompt's step), train (a training step's turn), profile (its time includes the requests it lets by between stages)",
                Family::default(),
            ),
            device_busy: registered(
                r,
                "device_busy_seconds",
                "Time a device's scheduler spent running each kind of work (see cleave_device_work_total), by device and kind",
                Family::default(),
            ),
            budget_bytes: registered(
                r,
                "budget_bytes",
                "Each budget's size: memory (limits.memory_budget_bytes: requests, answers, calls' message buffers) and kv_cache (limits.kv_cache_bytes: generation sessions' caches)",
                Family::default(),
            ),
            held_bytes: registered(r, "budget_held_bytes", "Bytes held against each budget now", Family::default()),
            memory_budget: std::sync::Mutex::new(None),
            device_memory: registered(r, "device_memory_used_bytes", "CUDA memory this process holds, by device", Family::default()),
            cuda_devices,
            registry,
        };
        Self { inner: Arc::new(inner) }
    }

    fn model(model: &str) -> ModelLabel {
        ModelLabel { model: model.to_string() }
    }

    /// A request reached its device's queue (`+1`) or started running (`-1`).
    pub(crate) fn queued(&self, model: &str, delta: i64) {
        self.inner.queue_depth.get_or_create(&Self::model(model)).inc_by(delta);
    }

    /// A request dropped because its stream went: `at` is `queued` or `running`.
    pub(crate) fn abandoned(&self, model: &str, at: &str) {
        self.inner.abandoned.get_or_create(&AbandonedLabels { model: model.to_string(), at: at.to_string() }).inc();
    }

    /// A connection was closed because an answer on it waited too long to be written.
    pub(crate) fn answer_timeout(&self) {
        self.inner.answer_timeouts.inc();
    }

    /// The oldest handshaking connection was closed to make room for a newer one.
    pub(crate) fn handshake_given_way(&self) {
        self.inner.handshakes_given_way.inc();
    }

    /// An accepted socket was closed at once, for `reason`.
    pub(crate) fn connection_refused(&self, reason: &'static str) {
        self.inner.connections_refused.get_or_create(&ReasonLabel { reason }).inc();
    }

    /// A device's scheduler thread died.
    pub(crate) fn device_failed(&self, device: &str) {
        self.inner.device_failures.get_or_create(&DeviceLabel { device: device.to_string() }).inc();
    }

    /// A device's models were reloaded on a new thread after it died.
    pub(crate) fn device_restarted(&self, device: &str) {
        self.inner.device_restarts.get_or_create(&DeviceLabel { device: device.to_string() }).inc();
    }

    /// A device ran a batch of `samples`.
    pub(crate) fn batch(&self, model: &str, samples: i64) {
        self.inner.batch_samples.get_or_create(&Self::model(model)).observe(samples as f64);
    }

    /// `requests` of `model` ran up to a later cut to join those waiting there.
    pub(crate) fn cut_merges(&self, model: &str, requests: usize) {
        self.inner.cut_merges.get_or_create(&Self::model(model)).inc_by(requests as u64);
    }

    /// Payload bytes received for `model`.
    pub(crate) fn received(&self, model: &str, bytes: u64) {
        self.inner.bytes_in.get_or_create(&Self::model(model)).inc_by(bytes);
    }

    /// Bytes of a request for `model` copied as they were to receive it.
    pub(crate) fn received_copied(&self, model: &str, copied: u64, pinned: u64) {
        let model = Self::model(model);
        self.inner.copied_in.get_or_create(&model).inc_by(copied);
        if pinned > 0 {
            self.inner.pinned_in.get_or_create(&model).inc_by(pinned);
        }
    }

    /// Payload bytes sent for `model` outside an [`Answered`] request (training answers).
    pub(crate) fn sent(&self, model: &str, bytes: u64) {
        self.inner.bytes_out.get_or_create(&Self::model(model)).inc_by(bytes);
    }

    /// A request answered, with a result or an error.
    pub(crate) fn answered(&self, a: &Answered<'_>) {
        let m = Self::model(a.model);
        let code = format!("{:?}", a.code);
        self.inner.requests.get_or_create(&CodeLabels { model: a.model.to_string(), code }).inc();
        self.inner.bytes_out.get_or_create(&m).inc_by(a.bytes_out);
        self.inner.copied_out.get_or_create(&m).inc_by(a.copied_bytes);
        self.inner.total_seconds.get_or_create(&m).observe(a.total.as_secs_f64());
        if a.code == tonic::Code::Ok {
            self.inner.queue_seconds.get_or_create(&m).observe(a.queue.as_secs_f64());
            self.inner.compute_seconds.get_or_create(&m).observe(a.compute.as_secs_f64());
        }
        if a.slo.is_some_and(|slo| a.total > slo) {
            self.inner.slo_misses.get_or_create(&m).inc();
        }
    }

    /// A stream of `kind` (`infer`, `train`) opened; closed when the guard drops.
    pub(crate) fn stream_open(&self, kind: &str) -> OpenGuard {
        let gauge = self.inner.open_streams.get_or_create(&KindLabel { kind: kind.to_string() }).clone();
        gauge.inc();
        OpenGuard(gauge)
    }

    /// A training session opened; closed when the guard drops.
    pub(crate) fn session_open(&self) -> OpenGuard {
        let gauge = self.inner.training_sessions.clone();
        gauge.inc();
        OpenGuard(gauge)
    }

    /// A generation session opened; closed when the guard drops.
    pub(crate) fn generation_session_open(&self) -> OpenGuard {
        let gauge = self.inner.generation_sessions.clone();
        gauge.inc();
        OpenGuard(gauge)
    }

    /// A generation step of `model` answered with its output.
    pub(crate) fn generation_step(&self, model: &str) {
        self.inner.generation_steps.get_or_create(&Self::model(model)).inc();
    }

    /// `sessions` decode steps of `model` ran as one batch.
    pub(crate) fn generation_batch(&self, model: &str, sessions: usize) {
        self.inner.generation_batched_steps.get_or_create(&Self::model(model)).inc_by(sessions as u64);
    }

    /// Device `device` ran one piece of work of `kind` (`infer`, `generate`, `train`,
    /// `profile`) for `took`.
    pub(crate) fn device_worked(&self, device: &str, kind: &str, took: Duration) {
        let labels = DeviceWorkLabels { device: device.to_string(), kind: kind.to_string() };
        self.inner.device_work.get_or_create(&labels).inc();
        self.inner.device_busy.get_or_create(&labels).inc_by(took.as_secs_f64());
    }

    /// Budget `budget` (`memory`, `kv_cache`) is `total` bytes and holds `held` now.
    pub(crate) fn budget(&self, budget: &str, total: u64, held: u64) {
        let label = BudgetLabel { budget: budget.to_string() };
        self.inner.budget_bytes.get_or_create(&label).set(total as i64);
        self.inner.held_bytes.get_or_create(&label).set(held as i64);
    }

    /// Reports `budget` (the request memory budget) at each scrape.
    pub(crate) fn watch_memory_budget(&self, budget: crate::budget::MemoryBudget) {
        *crate::error::lock(&self.inner.memory_budget) = Some(budget);
    }

    /// Every metric in the OpenMetrics text format (device memory read now).
    pub fn render(&self) -> String {
        if let Some(budget) = crate::error::lock(&self.inner.memory_budget).clone() {
            self.budget("memory", budget.total_bytes(), budget.held_bytes());
        }
        for (name, index) in &self.inner.cuda_devices {
            if let Some(bytes) = cuda_memory_used(*index) {
                self.inner.device_memory.get_or_create(&DeviceLabel { device: name.clone() }).set(bytes as i64);
            }
        }
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.inner.registry);
        text
    }
}

/// Keeps a gauge up by one while it lives.
pub(crate) struct OpenGuard(Gauge);

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// The memory this process holds on CUDA device `index`, from NVML (the driver's library,
/// loaded at run time: none on a machine without the driver).
fn cuda_memory_used(index: u32) -> Option<u64> {
    use nvml_wrapper::enums::device::UsedGpuMemory;
    static NVML: std::sync::OnceLock<Option<nvml_wrapper::Nvml>> = std::sync::OnceLock::new();
    let nvml =
        NVML.get_or_init(|| nvml_wrapper::Nvml::init().map_err(|e| tracing::warn!(error = %e, "NVML is unavailable: no device memory metric")).ok());
    let device = nvml.as_ref()?.device_by_index(index).ok()?;
    let pid = std::process::id();
    let ours = device.running_compute_processes().ok()?.into_iter().find(|p| p.pid == pid)?;
    match ours.used_gpu_memory {
        UsedGpuMemory::Used(bytes) => Some(bytes),
        UsedGpuMemory::Unavailable => None,
    }
}

/// What the metrics endpoint holds for its scrapers (`limits.metrics_max_connections` and
/// `limits.metrics_timeout` in server.yaml).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EndpointLimits {
    /// Connections open at once; one more is closed as soon as it is accepted.
    pub max_connections: u32,
    /// From a connection's accept to its answer written (a request's headers included): longer
    /// and it is closed, so a scraper that sends or reads slowly holds nothing for long.
    pub timeout: Duration,
}

impl Default for EndpointLimits {
    fn default() -> Self {
        Self { max_connections: 8, timeout: Duration::from_secs(10) }
    }
}

/// Serves `GET /metrics` on `listener` on a thread of its own, with a one-thread runtime,
/// until the process exits.
pub fn spawn(listener: std::net::TcpListener, metrics: Metrics, limits: EndpointLimits) -> std::io::Result<()> {
    listener.set_nonblocking(true)?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    std::thread::Builder::new().name("cleave-metrics".into()).spawn(move || {
        runtime.block_on(async move {
            let served = match TcpListener::from_std(listener) {
                Ok(listener) => serve(listener, metrics, limits, std::future::pending()).await,
                Err(e) => Err(e),
            };
            if let Err(e) = served {
                tracing::error!(error = %e, "the metrics endpoint stopped");
            }
        });
    })?;
    Ok(())
}

/// Serves `GET /metrics` on `listener` until `shutdown` resolves: HTTP/1.1, one request per
/// connection, at most `limits.max_connections` at once, each closed after `limits.timeout`.
pub async fn serve(
    listener: TcpListener,
    metrics: Metrics,
    limits: EndpointLimits,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let places = Arc::new(tokio::sync::Semaphore::new(limits.max_connections as usize));
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of descriptors, say: wait rather than spin.
                    tracing::warn!(error = %e, "accepting a metrics connection failed; waiting before the next");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => return Ok(()),
        };
        let Ok(place) = Arc::clone(&places).try_acquire_owned() else {
            tracing::debug!(max = limits.max_connections, "a metrics connection closed at once: `limits.metrics_max_connections` are open");
            continue;
        };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let _place = place;
            let service =
                hyper::service::service_fn(move |request| std::future::ready(Ok::<_, std::convert::Infallible>(answer(&metrics, &request))));
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(limits.timeout)
                .keep_alive(false)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            if tokio::time::timeout(limits.timeout, connection).await.is_err() {
                tracing::debug!("a metrics connection closed after `limits.metrics_timeout`");
            }
        });
    }
}

/// The scrape for `GET /metrics`, 404 for anything else.
fn answer<B>(metrics: &Metrics, request: &http::Request<B>) -> http::Response<http_body_util::Full<bytes::Bytes>> {
    let response = http::Response::builder();
    let built = if request.method() == http::Method::GET && request.uri().path() == "/metrics" {
        response.header(http::header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8").body(metrics.render().into())
    } else {
        response.status(http::StatusCode::NOT_FOUND).body("cleave serves GET /metrics only\n".into())
    };
    built.unwrap_or_default()
}
