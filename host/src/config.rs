//! `edge.yaml`: read raw (unknown keys refused), then validated into an [`EdgeConfig`] with
//! typed values; every error names the file, the key and what was expected. A config runs
//! inference (`input:`) or training (`train:`), never both: its [`Job`].

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use cleave_client::{Link, RetryPolicy};
use cleave_common::bundle::SplitSpec;
use cleave_common::config::{auto_device, ConfigError, ConfigFile, CpuUse, Limits, RawAuth, RawTlsIdentity};
use cleave_common::logs::LogFormat;
use cleave_common::security::{ClientTls, EdgeSecurity, ServerSecurity, ServerTokens, TlsIdentity};
use cleave_common::telemetry::Telemetry;
use cleave_common::training::loss::LossKind;
use cleave_common::training::optim::OptimizerConfig;
use cleave_common::training::schedule::{check_clip_norm, Schedule};
use cleave_common::wire::{Codec, CodecPolicy};
use cleave_common::DeviceSpec;

use crate::planner::Objective;

/// `encryption:` in edge.yaml.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEdgeEncryption {
    key_id: u32,
    #[serde(default)]
    file: Option<PathBuf>,
    #[serde(default)]
    env: Option<String>,
}

/// `tls:` in edge.yaml.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawClientTls {
    ca: PathBuf,
    #[serde(default)]
    domain: Option<String>,
}

/// Where the host's inputs come from.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum InputSource {
    /// Random tensors shaped like the bundle's inputs, from a seed.
    Synthetic {
        /// The seed.
        #[serde(default)]
        seed: i64,
    },
    /// A `.safetensors` or `.npz` file whose tensors are named like the bundle's inputs, or a
    /// `.npy` file for a bundle with one input; batch first. Requests take consecutive batches.
    File {
        /// The file.
        path: PathBuf,
    },
    /// A directory of PNG/JPEG images, resized, centre-cropped and normalised to the model's
    /// input (with the bundle's preprocessing when it has one). Requests take consecutive images.
    Images {
        /// The directory.
        dir: PathBuf,
    },
}

/// The most servers a run takes (a longer `server:` list is refused; a longer DNS answer is
/// cut there).
pub const MAX_SERVERS: usize = 256;

/// `server:`, one URL or a list of them.
#[derive(Deserialize)]
#[serde(untagged)]
enum ServerUrls {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEdgeConfig {
    server: ServerUrls,
    #[serde(default, with = "humantime_serde")]
    resolve_every: Option<Duration>,
    bundle: PathBuf,
    split: SplitSpec,
    #[serde(default)]
    objective: Option<String>,
    #[serde(default = "auto_device")]
    device: String,
    #[serde(default = "one")]
    batch_size: i64,
    #[serde(default = "ten")]
    requests: u64,
    #[serde(default = "two")]
    in_flight: usize,
    #[serde(default)]
    input: Option<InputSource>,
    output: PathBuf,
    #[serde(default = "five")]
    top_k: usize,
    #[serde(default)]
    loopback: LoopbackConfig,
    #[serde(default)]
    codec: Option<String>,
    #[serde(default)]
    encryption: Option<RawEdgeEncryption>,
    #[serde(default)]
    tls: Option<RawClientTls>,
    #[serde(default)]
    auth: Option<RawAuth>,
    #[serde(default)]
    train: Option<RawTrain>,
    #[serde(default, with = "humantime_serde")]
    connect_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    request_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    keepalive_interval: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    keepalive_timeout: Option<Duration>,
    #[serde(default)]
    retry: RawRetry,
    #[serde(default)]
    fallback: Fallback,
    #[serde(default)]
    threads: Option<usize>,
    #[serde(default)]
    cores: Option<Vec<usize>>,
    #[serde(default)]
    log_format: LogFormat,
    #[serde(default)]
    telemetry: Telemetry,
}

/// `retry:` in edge.yaml.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawRetry {
    #[serde(default)]
    max_attempts: Option<u32>,
    #[serde(default, with = "humantime_serde")]
    max_backoff: Option<Duration>,
}

/// How the host deals with a server that fails, stalls or goes away (every key at the top
/// of edge.yaml; durations as `5s`, `500ms`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resilience {
    /// Opening a connection (TCP, TLS, HTTP/2) and its `Info` call (`connect_timeout`).
    pub connect_timeout: Duration,
    /// From sending a request to its whole answer (`request_timeout`): later, the connection
    /// is taken for stalled, dropped and the request resent on a new one.
    pub request_timeout: Duration,
    /// HTTP/2 PING interval while connected (`keepalive_interval`).
    pub keepalive_interval: Duration,
    /// A PING unanswered this long breaks the connection (`keepalive_timeout`).
    pub keepalive_timeout: Duration,
    /// Reconnecting (`retry:`).
    pub retry: RetryPolicy,
    /// What becomes of requests while no server answers (`fallback:`).
    pub fallback: Fallback,
}

impl Default for Resilience {
    fn default() -> Self {
        let link = Link::default();
        Self {
            connect_timeout: link.connect_timeout,
            request_timeout: link.request_timeout,
            keepalive_interval: link.keepalive.0,
            keepalive_timeout: link.keepalive.1,
            retry: RetryPolicy::default(),
            fallback: Fallback::None,
        }
    }
}

/// `fallback:` in edge.yaml.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Fallback {
    /// A request no server answers is an error (`none`, the default).
    #[default]
    None,
    /// A request no server answers within the deadline runs wholly on the edge (the bundle is
    /// already there), and the run returns to the split once a server answers again (`edge`).
    Edge,
}

/// `train:` in edge.yaml.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTrain {
    #[serde(default)]
    mode: RawMode,
    #[serde(default)]
    tail: Option<SplitSpec>,
    data: RawTrainData,
    epochs: usize,
    batch_size: i64,
    #[serde(default)]
    eval_batch_size: Option<i64>,
    #[serde(default)]
    shuffle_seed: Option<u64>,
    #[serde(default)]
    seed: u64,
    optimizer: OptimizerConfig,
    #[serde(default)]
    schedule: Schedule,
    #[serde(default)]
    clip_grad_norm: Option<f64>,
    #[serde(default = "one_microbatch")]
    microbatches: u32,
    loss: String,
    #[serde(default)]
    resume: Option<String>,
    #[serde(default)]
    max_steps: Option<u64>,
    #[serde(default)]
    write_bundle: bool,
    #[serde(default)]
    clients: Option<RawClients>,
}

/// `train.clients:` as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawClients {
    mode: ClientMode,
    #[serde(default = "default_group")]
    group: String,
    edges: u32,
    edge: u32,
}

fn default_group() -> String {
    "default".into()
}

/// How the edges of a client group take turns on the server's shared part.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClientMode {
    /// Each edge in turn takes all its steps of an epoch, keeping its own weights.
    Sequential,
    /// One step each in turn; the edges' weights are averaged after every epoch (FedAvg).
    SplitFed,
}

impl ClientMode {
    /// `sequential` or `splitfed`, as the protocol names it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sequential => "sequential",
            Self::SplitFed => "splitfed",
        }
    }
}

/// `train.clients:`: this edge is one of several training one server part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientsConfig {
    /// How the edges take turns.
    pub mode: ClientMode,
    /// The group's name on the server (every edge names the same).
    pub group: String,
    /// How many edges train in the group.
    pub edges: u32,
    /// This edge's place among them, from 0: the order of the turns.
    pub edge: u32,
}

/// `train.data:`: safetensors files with tensors named like the bundle's inputs, plus the targets.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTrainData {
    train: PathBuf,
    test: PathBuf,
    #[serde(default = "label")]
    targets: String,
}

/// `train.mode:` as written; with `tail:`, it becomes a [`TrainMode`].
#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum RawMode {
    #[default]
    Split,
    UShaped,
    Monolithic,
}
fn label() -> String {
    "label".into()
}

/// Who holds which stages when training.
#[derive(Debug, Clone, PartialEq)]
pub enum TrainMode {
    /// The edge trains `[0, split)`, the server `[split, N)` and the loss.
    Split,
    /// Labels never leave the edge: it trains `[0, split)` and `[tail, N)` with the loss, the
    /// server the middle `[split, tail)`.
    UShaped {
        /// Where the edge's tail starts.
        tail: SplitSpec,
    },
    /// The whole model in this process (the reference split training is compared with).
    Monolithic,
}

impl TrainMode {
    /// `split`, `u-shaped` or `monolithic`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Split => "split",
            Self::UShaped { .. } => "u-shaped",
            Self::Monolithic => "monolithic",
        }
    }
}

/// `train:` in edge.yaml, validated: selects training instead of inference.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainConfig {
    /// Who holds which stages.
    pub mode: TrainMode,
    /// The training split (safetensors).
    pub train_data: PathBuf,
    /// The held-out split evaluated after each epoch.
    pub test_data: PathBuf,
    /// The tensor holding the targets in both files.
    pub targets: String,
    /// Passes over the training split.
    pub epochs: usize,
    /// Samples per step (the last step of an epoch takes the rest).
    pub batch_size: i64,
    /// Samples per evaluation request.
    pub eval_batch_size: i64,
    /// Shuffles the training split each epoch from this seed (none: file order).
    pub shuffle_seed: Option<u64>,
    /// Seeds the dropout masks (see `cleave_common::training::stage_seed`).
    pub seed: u64,
    /// The optimizer of both sides.
    pub optimizer: OptimizerConfig,
    /// The learning rate step by step, on both sides.
    pub schedule: Schedule,
    /// Clips the gradients of the whole model (both sides') to this global L2 norm.
    pub clip_grad_norm: Option<f64>,
    /// Micro-batches per step (`torch.chunk` of the batch): their gradients are summed and
    /// both sides step once.
    pub microbatches: u32,
    /// The loss.
    pub loss: LossKind,
    /// Resume from this checkpoint (a name under `<output>/checkpoints`).
    pub resume: Option<String>,
    /// Stop after this many steps in all (the run's checkpoint is written there).
    pub max_steps: Option<u64>,
    /// Write the trained weights into a new bundle, `<output>/bundle` (loopback and
    /// monolithic runs, where both sides' checkpoints are on this machine).
    pub write_bundle: bool,
    /// This edge is one of several training one server part (none: it trains alone).
    pub clients: Option<ClientsConfig>,
}

fn one() -> i64 {
    1
}
fn one_microbatch() -> u32 {
    1
}
fn two() -> usize {
    2
}
fn five() -> usize {
    5
}
fn ten() -> u64 {
    10
}

/// The in-process server `--loopback` starts. It holds the host's key and token; `tls`
/// gives it a certificate and key, so that the host's TLS settings are exercised too.
#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct LoopbackConfig {
    #[serde(default)]
    device: Option<String>,
    #[serde(default)]
    limits: Limits,
    #[serde(default)]
    tls: Option<RawTlsIdentity>,
}

/// `edge.yaml`, validated.
#[derive(Debug, Clone)]
pub struct EdgeConfig {
    /// The file it was read from.
    pub source: PathBuf,
    /// The server's URL (`http://host:port`): the first of `servers`.
    pub server: String,
    /// Every server's URL (`server:` as a list): each request goes to one of them.
    pub servers: Vec<String>,
    /// Resolve each server's name this often and send to every address it has
    /// (`resolve_every`; a headless Kubernetes Service): none, the URLs as they are.
    pub resolve_every: Option<Duration>,
    /// Bundle directory (a relative one is taken from the config's directory, see
    /// [`cleave_common::config::relative_to`]).
    pub bundle: PathBuf,
    /// Where to split.
    pub split: SplitSpec,
    /// Where the prefix runs.
    pub device: DeviceSpec,
    /// Samples per request.
    pub batch_size: i64,
    /// Requests to send.
    pub requests: u64,
    /// Requests in flight at once (the prefix of the next runs while earlier ones travel).
    pub in_flight: usize,
    /// Inference from `input:` or training with `train:`: one, never both.
    pub job: Job,
    /// Output directory (a relative one is taken from the working directory).
    pub output: PathBuf,
    /// Classes per prediction.
    pub top_k: usize,
    /// The loopback server.
    pub loopback_device: DeviceSpec,
    /// The loopback server's limits.
    pub loopback_limits: Limits,
    /// The loopback server's TLS identity.
    pub loopback_tls: Option<TlsIdentity>,
    /// How boundaries are encoded (results come back the same way). With `codec: auto`,
    /// `auto`'s per-tensor codec (raw, or shuffle+lz4 where a tensor's sample compresses),
    /// which what needs one codec uses (training, `host load`, `host plan`, the profiles).
    pub codec: Codec,
    /// `codec: auto`: inference requests travel with the codec the link and this machine's
    /// measured speeds make fastest (`planning::codec_choice`).
    pub codec_auto: bool,
    /// Key, TLS trust and token.
    pub security: EdgeSecurity,
    /// What `split: auto` optimises (`objective:`, default latency).
    pub objective: Objective,
    /// Deadlines, reconnects and fallback.
    pub resilience: Resilience,
    /// libtorch's threads per operator and the cores, on the edge (`threads:`, `cores:`).
    pub cpu: CpuUse,
    /// How log lines are written (`log_format: text | json`).
    pub log_format: LogFormat,
    /// Where traces go (`telemetry:`; none by default).
    pub telemetry: Telemetry,
}

/// What a config runs: inference on inputs, or training.
#[derive(Debug, Clone, PartialEq)]
pub enum Job {
    /// Inference: where the inputs come from (`input:`).
    Infer(InputSource),
    /// Training (`train:`).
    Train(Box<TrainConfig>),
}

impl EdgeConfig {
    /// How to reach its servers: the TLS trust, token, key and timeouts of this config.
    /// Servers reached by the addresses their name resolves to (`resolve_every`) are checked
    /// against that name.
    pub fn link(&self) -> Link {
        let r = &self.resilience;
        let link = Link {
            connect_timeout: r.connect_timeout,
            keepalive: (r.keepalive_interval, r.keepalive_timeout),
            request_timeout: r.request_timeout,
            ..Link::secured(&self.security)
        };
        match self.resolve_every {
            Some(_) => link.checking_name_of(&self.server),
            None => link,
        }
    }

    /// The training section, when this config trains.
    pub fn train(&self) -> Option<&TrainConfig> {
        match &self.job {
            Job::Train(train) => Some(train.as_ref()),
            Job::Infer(_) => None,
        }
    }

    /// Where inference inputs come from, when this config runs inference.
    pub fn input(&self) -> Option<&InputSource> {
        match &self.job {
            Job::Infer(input) => Some(input),
            Job::Train(_) => None,
        }
    }

    /// What the `--loopback` server enforces: exactly what this host brings (its key, its
    /// token, TLS when the loopback has a certificate).
    pub fn loopback_security(&self) -> ServerSecurity {
        let keys = self.security.ring();
        ServerSecurity {
            policy: CodecPolicy { require_encryption: !keys.is_empty(), ..CodecPolicy::default() },
            keys,
            tls: self.loopback_tls.clone(),
            tokens: self.security.token.clone().map_or(ServerTokens::None, ServerTokens::Shared),
        }
    }
}

/// The deadlines, retries and fallback of `raw` (each key's default where it is absent);
/// every duration positive, at least one attempt.
fn resilience(raw: &RawEdgeConfig, file: &ConfigFile) -> Result<Resilience, ConfigError> {
    let d = Resilience::default();
    let resilience = Resilience {
        connect_timeout: raw.connect_timeout.unwrap_or(d.connect_timeout),
        request_timeout: raw.request_timeout.unwrap_or(d.request_timeout),
        keepalive_interval: raw.keepalive_interval.unwrap_or(d.keepalive_interval),
        keepalive_timeout: raw.keepalive_timeout.unwrap_or(d.keepalive_timeout),
        retry: RetryPolicy {
            max_attempts: raw.retry.max_attempts.unwrap_or(d.retry.max_attempts),
            max_backoff: raw.retry.max_backoff.unwrap_or(d.retry.max_backoff),
        },
        fallback: raw.fallback,
    };
    for (key, value) in [
        ("connect_timeout", resilience.connect_timeout),
        ("request_timeout", resilience.request_timeout),
        ("keepalive_interval", resilience.keepalive_interval),
        ("keepalive_timeout", resilience.keepalive_timeout),
        ("retry.max_backoff", resilience.retry.max_backoff),
    ] {
        if value.is_zero() {
            return Err(file.invalid(key, "must be positive"));
        }
    }
    if resilience.retry.max_attempts == 0 {
        return Err(file.invalid("retry.max_attempts", "must be at least 1 (one attempt: no retry)"));
    }
    Ok(resilience)
}

impl EdgeConfig {
    /// Reads and validates an edge config file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let secrets = ConfigFile { path };
        let raw: RawEdgeConfig = secrets.read_yaml()?;
        let resilience = resilience(&raw, &secrets)?;
        let invalid = |key: &str, message: String| secrets.invalid(key, message);
        let codec_auto = raw.codec.as_deref() == Some("auto");
        let codec = raw.codec.as_deref().unwrap_or("raw").parse().map_err(|e| invalid("codec", e))?;
        let key = raw.encryption.map(|e| Ok::<_, ConfigError>((e.key_id, secrets.key("encryption", e.file, e.env)?))).transpose()?;
        let tls = match raw.tls {
            None => None,
            Some(t) => Some(ClientTls { ca_pem: secrets.file("tls.ca", &t.ca)?, domain: t.domain }),
        };
        let servers = server_urls(raw.server, tls.is_some()).map_err(|message| invalid("server", message))?;
        let resolve_every = raw
            .resolve_every
            .map(|every| checked_resolve_every(every, &servers, tls.as_ref()))
            .transpose()
            .map_err(|m| invalid("resolve_every", m))?;
        let security = EdgeSecurity { key, tls, token: secrets.token(raw.auth)? };
        let loopback_tls = secrets.identity("loopback.tls", raw.loopback.tls)?;
        let split = raw.split;
        let objective = raw.objective.as_deref().unwrap_or("latency").parse().map_err(|e| invalid("objective", e))?;
        let device = secrets.device("device", &raw.device)?;
        if raw.batch_size < 1 {
            return Err(invalid("batch_size", "must be at least 1".into()));
        }
        if raw.in_flight < 1 {
            return Err(invalid("in_flight", "must be at least 1".into()));
        }
        let loopback_device = secrets.device("loopback.device", raw.loopback.device.as_deref().unwrap_or("auto"))?;
        let loopback_limits = secrets.limits("loopback.", raw.loopback.limits)?;
        let input = raw.input.map(|input| match input {
            InputSource::File { path: p } => InputSource::File { path: secrets.resolve(&p) },
            InputSource::Images { dir } => InputSource::Images { dir: secrets.resolve(&dir) },
            other => other,
        });
        let train = raw.train.map(|t| train_config(path, t)).transpose()?;
        raw.telemetry.check().map_err(|e| invalid(e.key(), e.to_string()))?;
        let job = match (input, train) {
            (Some(input), None) => Job::Infer(input),
            (None, Some(train)) => Job::Train(Box::new(train)),
            (None, None) => return Err(invalid("input", "give `input` (inference) or `train` (training)".into())),
            (Some(_), Some(_)) => return Err(invalid("input", "`input` is for inference and `train` brings its own data: give one".into())),
        };
        Ok(Self {
            source: path.to_path_buf(),
            server: servers[0].clone(),
            servers,
            resolve_every,
            bundle: secrets.resolve(&raw.bundle),
            split,
            device,
            batch_size: raw.batch_size,
            requests: raw.requests,
            in_flight: raw.in_flight,
            job,
            objective,
            output: raw.output,
            top_k: raw.top_k,
            loopback_device,
            loopback_limits,
            loopback_tls,
            codec,
            codec_auto,
            security,
            resilience,
            cpu: secrets.cpu(raw.threads, raw.cores)?,
            log_format: raw.log_format,
            telemetry: raw.telemetry,
        })
    }
}

/// `resolve_every`: at least a second; with TLS, the certificate's name must be known when
/// the servers are reached by address (`tls.domain`, or the one server URL's host).
fn checked_resolve_every(every: Duration, servers: &[String], tls: Option<&ClientTls>) -> Result<Duration, String> {
    if every < Duration::from_secs(1) {
        return Err(format!("{every:?}: at least 1s (each resolution asks the DNS server)"));
    }
    if tls.is_some_and(|t| t.domain.is_none()) && servers.len() > 1 {
        return Err("with TLS and several server names, set `tls.domain`: the name the servers' certificates hold".into());
    }
    Ok(every)
}

/// `server:` as a list of URLs, each checked; with `tls`, each https://.
fn server_urls(raw: ServerUrls, tls: bool) -> Result<Vec<String>, String> {
    let urls = match raw {
        ServerUrls::One(url) => vec![url],
        ServerUrls::Many(urls) => urls,
    };
    if urls.is_empty() {
        return Err("give at least one server URL".into());
    }
    if urls.len() > MAX_SERVERS {
        return Err(format!("{} servers: at most {MAX_SERVERS}", urls.len()));
    }
    for (i, url) in urls.iter().enumerate() {
        if !url.starts_with("http://") && !url.starts_with("https://") {
            return Err(format!("{url:?}: expected a URL like http://gpu-host:50051"));
        }
        if tls && url.starts_with("http://") {
            return Err(format!("{url:?}: with `tls`, the URL starts with https://"));
        }
        if urls[..i].contains(url) {
            return Err(format!("{url:?} is listed twice"));
        }
    }
    Ok(urls)
}

fn train_config(path: &Path, raw: RawTrain) -> Result<TrainConfig, ConfigError> {
    let file = ConfigFile { path };
    let invalid = |key: &str, message: String| file.invalid(&format!("train.{key}"), message);
    let mode = match (raw.mode, raw.tail) {
        (RawMode::Split, None) => TrainMode::Split,
        (RawMode::Monolithic, None) => TrainMode::Monolithic,
        (RawMode::UShaped, Some(tail)) => TrainMode::UShaped { tail },
        (RawMode::UShaped, None) => return Err(invalid("tail", "u-shaped training needs `tail`: the cut where the edge's last stages start".into())),
        (RawMode::Split | RawMode::Monolithic, Some(_)) => return Err(invalid("tail", "only u-shaped training has a tail".into())),
    };
    if raw.epochs == 0 {
        return Err(invalid("epochs", "must be at least 1".into()));
    }
    if raw.batch_size < 1 {
        return Err(invalid("batch_size", "must be at least 1".into()));
    }
    let eval_batch_size = raw.eval_batch_size.unwrap_or(raw.batch_size);
    if eval_batch_size < 1 {
        return Err(invalid("eval_batch_size", "must be at least 1".into()));
    }
    raw.optimizer.validate().map_err(|e| invalid("optimizer", e.to_string()))?;
    raw.schedule.validate().map_err(|e| invalid("schedule", e.to_string()))?;
    let clip_grad_norm = raw.clip_grad_norm.map(check_clip_norm).transpose().map_err(|e| invalid("clip_grad_norm", e.to_string()))?;
    if raw.microbatches == 0 {
        return Err(invalid("microbatches", "must be at least 1".into()));
    }
    if raw.max_steps == Some(0) {
        return Err(invalid("max_steps", "must be at least 1".into()));
    }
    let clients =
        raw.clients.map(|c| clients_config(c, &mode, raw.resume.is_some(), raw.write_bundle)).transpose().map_err(|(key, m)| invalid(key, m))?;
    Ok(TrainConfig {
        mode,
        train_data: file.resolve(&raw.data.train),
        test_data: file.resolve(&raw.data.test),
        targets: raw.data.targets,
        epochs: raw.epochs,
        batch_size: raw.batch_size,
        eval_batch_size,
        shuffle_seed: raw.shuffle_seed,
        seed: raw.seed,
        optimizer: raw.optimizer,
        schedule: raw.schedule,
        clip_grad_norm,
        microbatches: raw.microbatches,
        loss: raw.loss.parse().map_err(|e| invalid("loss", e))?,
        resume: raw.resume,
        max_steps: raw.max_steps,
        write_bundle: raw.write_bundle,
        clients,
    })
}

/// `train.clients:` checked: a group of at least one edge, this one's place within it, and a
/// mode that trains a server part; refused with the key at fault.
fn clients_config(raw: RawClients, mode: &TrainMode, resumes: bool, writes_bundle: bool) -> Result<ClientsConfig, (&'static str, String)> {
    if *mode == TrainMode::Monolithic {
        return Err(("clients", "several edges train a server part together: use mode split or u-shaped".into()));
    }
    if raw.edges == 0 {
        return Err(("clients.edges", "must be at least 1".into()));
    }
    if raw.edge >= raw.edges {
        return Err(("clients.edge", format!("{} is not a place among {} edges: 0 to {}", raw.edge, raw.edges, raw.edges - 1)));
    }
    if resumes {
        return Err(("resume", "a client group's run cannot resume a checkpoint yet: start the group afresh".into()));
    }
    if writes_bundle {
        return Err(("write_bundle", "the server's part of a client group is trained by every edge: write it from the server's checkpoint".into()));
    }
    Ok(ClientsConfig { mode: raw.mode, group: raw.group, edges: raw.edges, edge: raw.edge })
}
