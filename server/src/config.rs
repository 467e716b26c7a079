//! `server.yaml`: read raw (unknown keys refused), then validated into a [`ServerConfig`]
//! with typed values; every error names the file, the key and what was expected.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use cleave_common::config::{auto_device, ConfigError, ConfigFile, Limits, RawAuth, RawTlsIdentity};
use cleave_common::security::ServerSecurity;
use cleave_common::wire::{CodecPolicy, KeyRing, Precision};
use cleave_common::DeviceSpec;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServerConfig {
    listen: String,
    bundle: PathBuf,
    #[serde(default = "auto_device")]
    device: String,
    #[serde(default)]
    limits: Limits,
    #[serde(default)]
    codecs: Option<RawAcceptedCodecs>,
    #[serde(default)]
    encryption: Option<RawServerEncryption>,
    #[serde(default)]
    tls: Option<RawTlsIdentity>,
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
        let file = ConfigFile { path };
        let mut raw: RawServerConfig = file.read_yaml()?;
        let security = server_security(&file, &mut raw)?;
        let listen = raw.listen.parse().map_err(|_| file.invalid("listen", format!("{:?} is not an address like 0.0.0.0:50051", raw.listen)))?;
        let device = file.device("device", &raw.device)?;
        let limits = file.limits("", raw.limits)?;
        let training = match raw.training {
            None => TrainingOptions { checkpoint_dir: Some(file.resolve(Path::new("checkpoints"))), concurrent_sessions: false },
            Some(t) => TrainingOptions {
                checkpoint_dir: Some(file.resolve(t.checkpoint_dir.as_deref().unwrap_or(Path::new("checkpoints")))),
                concurrent_sessions: t.concurrent_sessions,
            },
        };
        Ok(Self { listen, bundle: file.resolve(&raw.bundle), device, limits, security, training })
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
        keys = KeyRing::new(pairs).map_err(|e| file.invalid("encryption.keys", e))?;
        policy.require_encryption = enc.required;
    }
    Ok(ServerSecurity { policy, keys, tls: file.identity("tls", raw.tls.take())?, token: file.token(raw.auth.take())? })
}
