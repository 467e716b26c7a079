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
    #[serde(default)]
    insecure: bool,
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
    /// `insecure: true`: serve another machine without TLS or without a token, on purpose.
    pub insecure: bool,
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
        if !listen.ip().is_loopback() && !raw.insecure && (security.tls.is_none() || security.token.is_none()) {
            let missing = match (security.tls.is_none(), security.token.is_none()) {
                (true, true) => "`tls` and `auth`",
                (true, false) => "`tls`",
                _ => "`auth` (a bearer token)",
            };
            return Err(file.invalid(
                "listen",
                format!("{listen} is reachable from other machines: configure {missing}, or write `insecure: true` to serve it as it is"),
            ));
        }
        let device = file.device("device", &raw.device)?;
        let limits = file.limits("", raw.limits)?;
        let training = match raw.training {
            None => TrainingOptions { checkpoint_dir: Some(file.resolve(Path::new("checkpoints"))), concurrent_sessions: false },
            Some(t) => TrainingOptions {
                checkpoint_dir: Some(file.resolve(t.checkpoint_dir.as_deref().unwrap_or(Path::new("checkpoints")))),
                concurrent_sessions: t.concurrent_sessions,
            },
        };
        Ok(Self { listen, bundle: file.resolve(&raw.bundle), device, limits, security, training, insecure: raw.insecure })
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

#[cfg(test)]
mod tests {
    use super::*;

    fn load(yaml: &str) -> Result<ServerConfig, String> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("server.yaml");
        std::fs::write(&path, format!("bundle: b\n{yaml}")).unwrap();
        ServerConfig::load(&path).map_err(|e| e.to_string())
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
}
