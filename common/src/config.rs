//! Configuration files. Each is read in two steps: the raw YAML (unknown keys refused), then
//! a validated config with typed values. An error names the file, the key and what was expected.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use cleave_codec::{Codec, CodecPolicy, Key, KeyRing, Precision};

use crate::device::DeviceSpec;
use crate::security::{ClientTls, EdgeSecurity, SecretSource, ServerSecurity, TlsIdentity, Token};

/// A configuration file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read.
    #[error("cannot read config {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The YAML does not fit the schema (serde_yaml names the key and the line).
    #[error("config {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What is wrong, and where.
        message: String,
    },
    /// A value that parses but is not valid.
    #[error("config {path}: `{key}`: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// What was expected.
        message: String,
    },
}

/// Limits a server enforces on every stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Largest gRPC message, either way (frames are split below it).
    pub max_message_bytes: u64,
    /// Largest boundary per request (sum of tensor bytes).
    pub max_payload_bytes: u64,
    /// Requests queued for the compute worker before streams wait.
    pub queue_depth: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Self { max_message_bytes: 8 << 20, max_payload_bytes: 1 << 30, queue_depth: 64 }
    }
}

impl Limits {
    /// Bytes of tensor data per frame: the message limit less room for the header.
    pub fn chunk_bytes(&self) -> usize {
        crate::wire::chunk_bytes_for(self.max_message_bytes)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServerConfig {
    listen: String,
    bundle: PathBuf,
    #[serde(default = "auto")]
    device: String,
    #[serde(default)]
    limits: Limits,
    #[serde(default)]
    codecs: Option<RawAcceptedCodecs>,
    #[serde(default)]
    encryption: Option<RawServerEncryption>,
    #[serde(default)]
    tls: Option<RawServerTls>,
    #[serde(default)]
    auth: Option<RawAuth>,
    #[serde(default)]
    training: Option<RawServerTraining>,
}

/// `training:` in server.yaml.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServerTraining {
    #[serde(default)]
    checkpoint_dir: Option<PathBuf>,
    #[serde(default)]
    concurrent_sessions: bool,
}

/// How a server runs training sessions.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TrainingOptions {
    /// Where sessions write checkpoints (`NAME.safetensors`) and resume from; none: a
    /// session cannot save.
    pub checkpoint_dir: Option<PathBuf>,
    /// Allow several sessions on the bundle at once, each training its own copy.
    pub concurrent_sessions: bool,
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

/// `tls:` of a server (and of the loopback server in edge.yaml).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServerTls {
    cert: PathBuf,
    key: PathBuf,
}

/// `auth:` on either side: the bearer token's source.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAuth {
    token: SecretSource,
}

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

/// Reads and checks a config's secrets and TLS files; errors name the key.
struct SecretReader<'a> {
    path: &'a Path,
}

impl SecretReader<'_> {
    fn invalid(&self, key: &str, message: String) -> ConfigError {
        ConfigError::Invalid { path: self.path.to_path_buf(), key: key.into(), message }
    }

    fn file(&self, key: &str, file: &Path) -> Result<Vec<u8>, ConfigError> {
        let file = relative_to(self.path, file);
        std::fs::read(&file).map_err(|e| self.invalid(key, format!("cannot read {}: {e}", file.display())))
    }

    fn key(&self, key: &str, file: Option<PathBuf>, env: Option<String>) -> Result<Key, ConfigError> {
        let source = SecretSource { file, env }.relative_to(|f| relative_to(self.path, f));
        let material = source.read().map_err(|e| self.invalid(key, e))?;
        Key::parse(&material).map_err(|e| self.invalid(key, e))
    }

    fn token(&self, auth: Option<RawAuth>) -> Result<Option<Token>, ConfigError> {
        let Some(auth) = auth else { return Ok(None) };
        let material = auth.token.relative_to(|f| relative_to(self.path, f)).read().map_err(|e| self.invalid("auth.token", e))?;
        Token::parse(&material).map(Some).map_err(|e| self.invalid("auth.token", e))
    }

    fn identity(&self, key: &str, tls: Option<RawServerTls>) -> Result<Option<TlsIdentity>, ConfigError> {
        let Some(tls) = tls else { return Ok(None) };
        let cert_pem = self.file(&format!("{key}.cert"), &tls.cert)?;
        let key_pem = zeroize::Zeroizing::new(self.file(&format!("{key}.key"), &tls.key)?);
        if !cert_pem.starts_with(b"-----BEGIN") {
            return Err(self.invalid(&format!("{key}.cert"), "expected a PEM certificate".into()));
        }
        Ok(Some(TlsIdentity { cert_pem, key_pem }))
    }

    fn server_security(&self, raw: &mut RawServerConfig) -> Result<ServerSecurity, ConfigError> {
        let mut policy = CodecPolicy::default();
        if let Some(codecs) = raw.codecs.take() {
            if let Some(names) = codecs.precisions {
                policy.precisions = names
                    .iter()
                    .map(|n| {
                        Precision::ALL.into_iter().find(|p| p.name() == n).ok_or_else(|| {
                            self.invalid("codecs.precisions", format!("{n:?} is not a precision (full, fp16, bf16, int8)"))
                        })
                    })
                    .collect::<Result<_, _>>()?;
            }
            if let Some(names) = codecs.compressions {
                if let Some(bad) = names.iter().find(|n| !["none", "lz4", "zstd"].contains(&n.as_str())) {
                    return Err(self.invalid("codecs.compressions", format!("{bad:?} is not a compression (none, lz4, zstd)")));
                }
                policy.compressions = names;
            }
        }
        let mut keys = KeyRing::default();
        if let Some(enc) = raw.encryption.take() {
            if enc.keys.is_empty() {
                return Err(self.invalid("encryption.keys", "list at least one key: { id: 1, file: path } or { id: 1, env: VAR }".into()));
            }
            let pairs = enc
                .keys
                .into_iter()
                .enumerate()
                .map(|(i, k)| Ok((k.id, self.key(&format!("encryption.keys[{i}]"), k.file, k.env)?)))
                .collect::<Result<Vec<_>, ConfigError>>()?;
            keys = KeyRing::new(pairs).map_err(|e| self.invalid("encryption.keys", e))?;
            policy.require_encryption = enc.required;
        }
        Ok(ServerSecurity { policy, keys, tls: self.identity("tls", raw.tls.take())?, token: self.token(raw.auth.take())? })
    }
}

fn auto() -> String {
    "auto".into()
}

/// `server.yaml`, validated.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// Bundle directory (relative paths are relative to the config file).
    pub bundle: PathBuf,
    /// Where the stages run.
    pub device: DeviceSpec,
    /// Limits on every stream.
    pub limits: Limits,
    /// Accepted codecs, keys, TLS and token.
    pub security: ServerSecurity,
    /// Training sessions (`training:`; checkpoints default to `checkpoints/` beside the file).
    pub training: TrainingOptions,
}

impl ServerConfig {
    /// Reads and validates a server config file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let mut raw: RawServerConfig = read_yaml(path)?;
        let security = SecretReader { path }.server_security(&mut raw)?;
        let invalid = |key: &str, message: String| ConfigError::Invalid { path: path.to_path_buf(), key: key.into(), message };
        let listen = raw.listen.parse().map_err(|_| invalid("listen", format!("{:?} is not an address like 0.0.0.0:50051", raw.listen)))?;
        let device = raw.device.parse().map_err(|e: crate::BundleError| invalid("device", e.to_string()))?;
        validate_limits(&raw.limits).map_err(|(key, message)| invalid(key, message))?;
        let training = match raw.training {
            None => TrainingOptions { checkpoint_dir: Some(relative_to(path, Path::new("checkpoints"))), concurrent_sessions: false },
            Some(t) => TrainingOptions {
                checkpoint_dir: Some(relative_to(path, t.checkpoint_dir.as_deref().unwrap_or(Path::new("checkpoints")))),
                concurrent_sessions: t.concurrent_sessions,
            },
        };
        Ok(Self { listen, bundle: relative_to(path, &raw.bundle), device, limits: raw.limits, security, training })
    }
}

fn validate_limits(l: &Limits) -> Result<(), (&'static str, String)> {
    if l.max_message_bytes < 64 << 10 {
        return Err(("limits.max_message_bytes", "must be at least 65536".into()));
    }
    if l.max_payload_bytes == 0 {
        return Err(("limits.max_payload_bytes", "must be positive".into()));
    }
    if l.queue_depth == 0 {
        return Err(("limits.queue_depth", "must be positive".into()));
    }
    Ok(())
}

/// Where the host splits the model.
#[derive(Debug, Clone, PartialEq)]
pub enum SplitSpec {
    /// `auto`: the planner picks the cut from measured profiles and moves it as the
    /// measured bandwidth changes.
    Auto,
    /// A cut index.
    Cut(usize),
    /// The cut after the stage with this name or module path.
    After(String),
    /// The first cut where the edge holds at least this share (percent) of the model's FLOPs.
    CostPercent(f64),
}

impl std::fmt::Display for SplitSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Auto => write!(f, "auto"),
            Self::Cut(i) => write!(f, "{i}"),
            Self::After(path) => write!(f, "after:{path}"),
            Self::CostPercent(p) => write!(f, "{p}%"),
        }
    }
}

impl std::str::FromStr for SplitSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s == "auto" {
            return Ok(Self::Auto);
        }
        if let Some(path) = s.strip_prefix("after:") {
            return Ok(Self::After(path.to_string()));
        }
        if let Some(p) = s.strip_suffix('%') {
            return match p.trim().parse::<f64>() {
                Ok(p) if (0.0..=100.0).contains(&p) => Ok(Self::CostPercent(p)),
                _ => Err(format!("{s:?}: a percentage must be between 0% and 100%")),
            };
        }
        s.parse().map(Self::Cut).map_err(|_| format!("{s:?} is not a cut index, after:<module path>, a percentage like 40% or auto"))
    }
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

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEdgeConfig {
    server: String,
    bundle: PathBuf,
    split: serde_yaml::Value,
    #[serde(default)]
    objective: Option<String>,
    #[serde(default = "auto")]
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
}

/// `train:` in edge.yaml.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTrain {
    #[serde(default = "split_mode")]
    mode: String,
    #[serde(default)]
    tail: Option<serde_yaml::Value>,
    data: RawTrainData,
    epochs: usize,
    batch_size: i64,
    #[serde(default)]
    eval_batch_size: Option<i64>,
    #[serde(default)]
    shuffle_seed: Option<u64>,
    #[serde(default)]
    seed: u64,
    optimizer: crate::training::optim::OptimizerConfig,
    loss: String,
    #[serde(default)]
    resume: Option<String>,
    #[serde(default)]
    max_steps: Option<u64>,
    #[serde(default)]
    write_bundle: bool,
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

fn split_mode() -> String {
    "split".into()
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
    pub optimizer: crate::training::optim::OptimizerConfig,
    /// The loss.
    pub loss: crate::training::loss::LossKind,
    /// Resume from this checkpoint (a name under `<output>/checkpoints`).
    pub resume: Option<String>,
    /// Stop after this many steps in all (the run's checkpoint is written there).
    pub max_steps: Option<u64>,
    /// Write the trained weights into a new bundle, `<output>/bundle` (loopback and
    /// monolithic runs, where both sides' checkpoints are on this machine).
    pub write_bundle: bool,
}

fn one() -> i64 {
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
    tls: Option<RawServerTls>,
}

/// `edge.yaml`, validated.
#[derive(Debug, Clone)]
pub struct EdgeConfig {
    /// The server's URL (`http://host:port`).
    pub server: String,
    /// Bundle directory (relative to the config file).
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
    /// Where inference inputs come from (absent when training).
    pub input: Option<InputSource>,
    /// Output directory (relative to the working directory).
    pub output: PathBuf,
    /// Classes per prediction.
    pub top_k: usize,
    /// The loopback server.
    pub loopback_device: DeviceSpec,
    /// The loopback server's limits.
    pub loopback_limits: Limits,
    /// The loopback server's TLS identity.
    pub loopback_tls: Option<TlsIdentity>,
    /// How boundaries are encoded (results come back the same way).
    pub codec: Codec,
    /// Key, TLS trust and token.
    pub security: EdgeSecurity,
    /// Training instead of inference.
    pub train: Option<TrainConfig>,
    /// What `split: auto` optimises (`objective:`, default latency).
    pub objective: crate::planner::Objective,
}

impl EdgeConfig {
    /// What the `--loopback` server enforces: exactly what this host brings (its key, its
    /// token, TLS when the loopback has a certificate).
    pub fn loopback_security(&self) -> ServerSecurity {
        let keys = self.security.ring();
        ServerSecurity {
            policy: CodecPolicy { require_encryption: !keys.is_empty(), ..CodecPolicy::default() },
            keys,
            tls: self.loopback_tls.clone(),
            token: self.security.token.clone(),
        }
    }
}

impl EdgeConfig {
    /// Reads and validates an edge config file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let raw: RawEdgeConfig = read_yaml(path)?;
        let secrets = SecretReader { path };
        let invalid = |key: &str, message: String| ConfigError::Invalid { path: path.to_path_buf(), key: key.into(), message };
        let codec = raw.codec.as_deref().unwrap_or("raw").parse().map_err(|e| invalid("codec", e))?;
        let key = raw.encryption.map(|e| Ok::<_, ConfigError>((e.key_id, secrets.key("encryption", e.file, e.env)?))).transpose()?;
        let tls = match raw.tls {
            None => None,
            Some(t) => Some(ClientTls { ca_pem: secrets.file("tls.ca", &t.ca)?, domain: t.domain }),
        };
        if tls.is_some() && raw.server.starts_with("http://") {
            return Err(invalid("server", format!("{:?}: with `tls`, the URL starts with https://", raw.server)));
        }
        let security = EdgeSecurity { key, tls, token: secrets.token(raw.auth)? };
        let loopback_tls = secrets.identity("loopback.tls", raw.loopback.tls)?;
        let split = split_spec(&raw.split).map_err(|e| invalid("split", e))?;
        let objective = raw.objective.as_deref().unwrap_or("latency").parse().map_err(|e| invalid("objective", e))?;
        let device = raw.device.parse().map_err(|e: crate::BundleError| invalid("device", e.to_string()))?;
        if !raw.server.starts_with("http://") && !raw.server.starts_with("https://") {
            return Err(invalid("server", format!("{:?}: expected a URL like http://gpu-host:50051", raw.server)));
        }
        if raw.batch_size < 1 {
            return Err(invalid("batch_size", "must be at least 1".into()));
        }
        if raw.in_flight < 1 {
            return Err(invalid("in_flight", "must be at least 1".into()));
        }
        let loopback_device = raw
            .loopback
            .device
            .as_deref()
            .unwrap_or("auto")
            .parse()
            .map_err(|e: crate::BundleError| invalid("loopback.device", e.to_string()))?;
        validate_limits(&raw.loopback.limits).map_err(|(key, message)| invalid(&format!("loopback.{key}"), message))?;
        let input = raw.input.map(|input| match input {
            InputSource::File { path: p } => InputSource::File { path: relative_to(path, &p) },
            InputSource::Images { dir } => InputSource::Images { dir: relative_to(path, &dir) },
            other => other,
        });
        let train = raw.train.map(|t| train_config(path, t)).transpose()?;
        match (&input, &train) {
            (None, None) => return Err(invalid("input", "give `input` (inference) or `train` (training)".into())),
            (Some(_), Some(_)) => return Err(invalid("input", "`input` is for inference and `train` brings its own data: give one".into())),
            _ => {}
        }
        Ok(Self {
            server: raw.server,
            bundle: relative_to(path, &raw.bundle),
            split,
            device,
            batch_size: raw.batch_size,
            requests: raw.requests,
            in_flight: raw.in_flight,
            input,
            train,
            objective,
            output: raw.output,
            top_k: raw.top_k,
            loopback_device,
            loopback_limits: raw.loopback.limits,
            loopback_tls,
            codec,
            security,
        })
    }
}

fn read_yaml<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })?;
    serde_yaml::from_str(&text).map_err(|e| ConfigError::Parse { path: path.to_path_buf(), message: e.to_string() })
}

fn train_config(path: &Path, raw: RawTrain) -> Result<TrainConfig, ConfigError> {
    let invalid = |key: &str, message: String| ConfigError::Invalid { path: path.to_path_buf(), key: format!("train.{key}"), message };
    let mode = match (raw.mode.as_str(), raw.tail) {
        ("split", None) => TrainMode::Split,
        ("monolithic", None) => TrainMode::Monolithic,
        ("u-shaped", Some(tail)) => TrainMode::UShaped { tail: split_spec(&tail).map_err(|e| invalid("tail", e))? },
        ("u-shaped", None) => return Err(invalid("tail", "u-shaped training needs `tail`: the cut where the edge's last stages start".into())),
        ("split" | "monolithic", Some(_)) => return Err(invalid("tail", "only u-shaped training has a tail".into())),
        (other, _) => return Err(invalid("mode", format!("{other:?} is not a mode (split, u-shaped, monolithic)"))),
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
    raw.optimizer.validate().map_err(|e| invalid("optimizer", e))?;
    if raw.max_steps == Some(0) {
        return Err(invalid("max_steps", "must be at least 1".into()));
    }
    Ok(TrainConfig {
        mode,
        train_data: relative_to(path, &raw.data.train),
        test_data: relative_to(path, &raw.data.test),
        targets: raw.data.targets,
        epochs: raw.epochs,
        batch_size: raw.batch_size,
        eval_batch_size,
        shuffle_seed: raw.shuffle_seed,
        seed: raw.seed,
        optimizer: raw.optimizer,
        loss: raw.loss.parse().map_err(|e| invalid("loss", e))?,
        resume: raw.resume,
        max_steps: raw.max_steps,
        write_bundle: raw.write_bundle,
    })
}

fn split_spec(value: &serde_yaml::Value) -> Result<SplitSpec, String> {
    match value {
        serde_yaml::Value::Number(n) => n.to_string().parse(),
        serde_yaml::Value::String(s) => s.parse(),
        other => Err(format!("{other:?}: expected a cut index, after:<module path> or a percentage")),
    }
}

/// Paths in a config are relative to the directory of the config file... except when the
/// config sits in `config/`, where they are relative to the project root (its parent), so
/// the example configs work from a checkout.
fn relative_to(config: &Path, p: &Path) -> PathBuf {
    if p.is_absolute() {
        return p.to_path_buf();
    }
    let dir = config.parent().unwrap_or(Path::new("."));
    let base = if dir.file_name().is_some_and(|n| n == "config") { dir.parent().unwrap_or(Path::new(".")) } else { dir };
    base.join(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_specs_parse() {
        assert_eq!("3".parse::<SplitSpec>().unwrap(), SplitSpec::Cut(3));
        assert_eq!("after:layer2.1".parse::<SplitSpec>().unwrap(), SplitSpec::After("layer2.1".into()));
        assert_eq!("40%".parse::<SplitSpec>().unwrap(), SplitSpec::CostPercent(40.0));
        assert!("140%".parse::<SplitSpec>().unwrap_err().contains("between 0% and 100%"));
        assert!("middle".parse::<SplitSpec>().unwrap_err().contains("not a cut index"));
    }
}
