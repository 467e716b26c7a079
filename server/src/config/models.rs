//! The models a server serves (`bundle:` for one, `models:` for several) and how its
//! devices' schedulers order their work (`scheduler:`), read raw and validated.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use cleave_common::config::{ConfigError, ConfigFile};
use cleave_common::DeviceSpec;

/// One entry of `models:` (or the top-level `bundle:` form).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawModel {
    pub(super) bundle: PathBuf,
    #[serde(default)]
    pub(super) device: Option<String>,
    #[serde(default)]
    pub(super) batching: Option<RawBatching>,
    #[serde(default)]
    pub(super) slo_ms: Option<u64>,
    #[serde(default)]
    pub(super) priority: Option<f64>,
    #[serde(default)]
    pub(super) warm_batches: Option<Vec<i64>>,
    #[serde(default)]
    pub(super) kinds: Option<RawKinds>,
}

/// `kinds:` of a model: how its other kinds of work are keyed beside its inference requests.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawKinds {
    #[serde(default)]
    generate: Option<RawTarget>,
    #[serde(default)]
    train: Option<RawTarget>,
}

/// A kind's `{slo_ms, priority}`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTarget {
    #[serde(default)]
    slo_ms: Option<u64>,
    #[serde(default)]
    priority: Option<f64>,
}

/// `batching:` of a model.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawBatching {
    #[serde(default)]
    max_batch: Option<u32>,
    #[serde(default)]
    max_wait_ms: Option<u64>,
    #[serde(default)]
    merge_cuts: Option<bool>,
}

/// How requests of one model are merged into batches across hosts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batching {
    /// Samples in one merged batch (at most the bundle's largest batch); 1: each request
    /// runs alone, results bit-identical to running it by itself.
    pub max_batch: u32,
    /// How long a request may wait for others to fill its batch (0: only those already
    /// waiting are merged).
    pub max_wait: Duration,
    /// Requests that entered at an earlier cut run up to the first later cut where others
    /// wait, and join them there.
    pub merge_cuts: bool,
}

impl Default for Batching {
    /// Off, as in Triton: merged batches change results by float rounding, so a model gets
    /// them only when its config asks.
    fn default() -> Self {
        Self { max_batch: 1, max_wait: Duration::ZERO, merge_cuts: true }
    }
}

impl Batching {
    /// Samples one merged batch of `bundle` may hold: `max_batch` within the bundle's
    /// largest batch.
    pub fn limit(&self, bundle: &cleave_common::Bundle) -> u32 {
        i64::from(self.max_batch).min(bundle.manifest().batch.max).max(1) as u32
    }
}

/// The longest `batching.max_wait_ms`: a wait is a latency every request may pay.
const MAX_WAIT_MS: u64 = 10_000;

/// How one kind of a model's work is keyed by its device's policy: its latency target and the
/// weight of its deadlines under `edf`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkTarget {
    /// Its target; none: it yields to work that arrived after it for up to `scheduler.max_age`.
    pub slo: Option<Duration>,
    /// Weight of its deadlines under `edf` (higher: sooner); positive.
    pub priority: f64,
}

impl Default for WorkTarget {
    /// No target, priority 1.
    fn default() -> Self {
        Self { slo: None, priority: 1.0 }
    }
}

impl WorkTarget {
    /// Validates `slo_ms` and `priority` (the keys under `at`), `priority` 1 where absent.
    fn from_raw(file: &ConfigFile<'_>, at: &dyn Fn(&str) -> String, slo_ms: Option<u64>, priority: Option<f64>) -> Result<Self, ConfigError> {
        if slo_ms == Some(0) {
            return Err(file.invalid(&at("slo_ms"), "must be positive (leave it out for no target)"));
        }
        let priority = priority.unwrap_or(1.0);
        if !(priority.is_finite() && priority > 0.0) {
            return Err(file.invalid(&at("priority"), "must be a positive number"));
        }
        Ok(Self { slo: slo_ms.map(Duration::from_millis), priority })
    }
}

/// One model a server serves, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// The bundle directory.
    pub bundle: PathBuf,
    /// Where its stages run; models on one device share that device's scheduler.
    pub device: DeviceSpec,
    /// How its requests are merged.
    pub batching: Batching,
    /// Its latency target: `edf` schedules by it and requests slower than it count as misses.
    pub slo: Option<Duration>,
    /// Weight of its deadlines under `edf` (higher: sooner); positive.
    pub priority: f64,
    /// Its generation steps (`kinds.generate`); none: as its requests (`slo_ms`, `priority`).
    pub generate: Option<WorkTarget>,
    /// Its training sessions' calls (`kinds.train`): by default no target (each yields to other
    /// work for up to `scheduler.max_age`).
    pub train: WorkTarget,
    /// Batch sizes its stages are warmed at before the server serves, besides its smallest
    /// and its batch limit (the sizes its hosts send: a size never run pays for its set-up on
    /// its first request, 0.4 s for a CUDA device).
    pub warm_batches: Vec<i64>,
}

impl ModelConfig {
    /// How its generation steps are keyed: `kinds.generate`, else as its requests.
    pub fn generate_target(&self) -> WorkTarget {
        self.generate.unwrap_or(WorkTarget { slo: self.slo, priority: self.priority })
    }

    /// A model on `device` with no batching, no target and priority 1.
    pub fn new(bundle: impl Into<PathBuf>, device: DeviceSpec) -> Self {
        let (generate, train) = (None, WorkTarget::default());
        Self { bundle: bundle.into(), device, batching: Batching::default(), slo: None, priority: 1.0, generate, train, warm_batches: Vec::new() }
    }

    /// Validates a raw entry; `key` is where it sits (`models[1]`, or empty at the top level).
    pub(super) fn from_raw(file: &ConfigFile<'_>, key: &str, raw: RawModel) -> Result<Self, ConfigError> {
        let at = |k: &str| if key.is_empty() { k.to_string() } else { format!("{key}.{k}") };
        let device = file.device(&at("device"), raw.device.as_deref().unwrap_or("auto"))?;
        let d = Batching::default();
        let batching = match raw.batching {
            None => d,
            Some(b) => Batching {
                max_batch: b.max_batch.unwrap_or(d.max_batch),
                max_wait: Duration::from_millis(b.max_wait_ms.unwrap_or(0)),
                merge_cuts: b.merge_cuts.unwrap_or(d.merge_cuts),
            },
        };
        if batching.max_batch == 0 {
            return Err(file.invalid(&at("batching.max_batch"), "must be at least 1 (1: no batching)"));
        }
        if batching.max_wait > Duration::from_millis(MAX_WAIT_MS) {
            return Err(file.invalid(&at("batching.max_wait_ms"), format!("must be at most {MAX_WAIT_MS}")));
        }
        let requests = WorkTarget::from_raw(file, &at, raw.slo_ms, raw.priority)?;
        let kinds = raw.kinds.unwrap_or(RawKinds { generate: None, train: None });
        let kind = |name: &str, raw: Option<RawTarget>| {
            raw.map(|t| WorkTarget::from_raw(file, &|k: &str| at(&format!("kinds.{name}.{k}")), t.slo_ms, t.priority)).transpose()
        };
        let generate = kind("generate", kinds.generate)?;
        let train = kind("train", kinds.train)?.unwrap_or_default();
        let warm_batches = raw.warm_batches.unwrap_or_default();
        if warm_batches.iter().any(|&b| b < 1) {
            return Err(file.invalid(&at("warm_batches"), "batch sizes must be at least 1"));
        }
        let (slo, priority) = (requests.slo, requests.priority);
        Ok(Self { bundle: file.resolve(&raw.bundle), device, batching, slo, priority, generate, train, warm_batches })
    }
}

pub use cleave_common::scheduling::Policy;

/// `scheduler:` in server.yaml: `fifo`, `edf`, or `{policy: edf, max_age_ms: 2000}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// The order.
    pub policy: Policy,
    /// How long a training step, or a request of a model without `slo_ms`, yields to work
    /// that arrived after it: its place is its arrival plus this, so it always runs in the
    /// end however busy the device is (its priority rises as it ages).
    pub max_age: Duration,
    /// What the server does when a device's scheduler thread dies (`on_device_failure:`, a
    /// top-level key of server.yaml).
    pub on_device_failure: DeviceFailurePolicy,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self { policy: Policy::Fifo, max_age: Duration::from_secs(2), on_device_failure: DeviceFailurePolicy::Exit }
    }
}

/// What the server does when a device's scheduler thread dies (a bug, or a device error
/// that libtorch raised outside any request). Either way the requests it held are answered
/// INTERNAL once, and health says NOT_SERVING for the server and the device's models.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceFailurePolicy {
    /// Answer the device's requests INTERNAL, drain the others and exit non-zero, for a
    /// supervisor (systemd, Kubernetes) to start the server afresh: the default, since a
    /// device that failed once may hold memory or state that a new process does not.
    Exit,
    /// Reload the device's models on a new thread and serve them again (health SERVING);
    /// if they cannot be reloaded, exit as `exit` does.
    Restart,
}

impl DeviceFailurePolicy {
    /// From the value of `on_device_failure:`.
    pub(super) fn from_name(file: &ConfigFile<'_>, name: &str) -> Result<Self, ConfigError> {
        match name {
            "exit" => Ok(Self::Exit),
            "restart" => Ok(Self::Restart),
            other => Err(file.invalid("on_device_failure", format!("{other:?} is not a policy: exit or restart"))),
        }
    }
}

impl SchedulerConfig {
    /// From the YAML value of `scheduler:` (a policy name, or a mapping).
    pub(super) fn from_yaml(file: &ConfigFile<'_>, value: &serde_yaml::Value) -> Result<Self, ConfigError> {
        let policy = |name: &str, key: &str| match name {
            "fifo" => Ok(Policy::Fifo),
            "edf" => Ok(Policy::Edf),
            other => Err(file.invalid(key, format!("{other:?} is not a scheduler: fifo or edf"))),
        };
        let d = Self::default();
        match value {
            serde_yaml::Value::String(name) => Ok(Self { policy: policy(name, "scheduler")?, ..d }),
            serde_yaml::Value::Mapping(map) => {
                let mut config = d;
                for (k, v) in map {
                    match (k.as_str().unwrap_or("?"), v) {
                        ("policy", serde_yaml::Value::String(name)) => config.policy = policy(name, "scheduler.policy")?,
                        ("policy", _) => return Err(file.invalid("scheduler.policy", "must be fifo or edf")),
                        ("max_age_ms", v) => match v.as_u64() {
                            Some(ms) if ms > 0 => config.max_age = Duration::from_millis(ms),
                            _ => return Err(file.invalid("scheduler.max_age_ms", "must be a positive number of milliseconds")),
                        },
                        (k, _) => return Err(file.invalid("scheduler", format!("unknown key {k:?}: policy or max_age_ms"))),
                    }
                }
                Ok(config)
            }
            _ => Err(file.invalid("scheduler", "must be fifo, edf, or a mapping {policy, max_age_ms}")),
        }
    }
}
