//! What both sides' configuration files share: the error type, the limits a server enforces
//! (in `server.yaml`, and in `edge.yaml` for the `--loopback` server), and the reading of
//! secrets, TLS identities and paths. Each side owns its own file's schema: `server.yaml` in
//! the server crate, `edge.yaml` in the host crate. Both are read in two steps: the raw YAML
//! (unknown keys refused), then a validated config with typed values. An error names the
//! file, the key and what was expected.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use cleave_codec::Key;

use crate::device::DeviceSpec;
use crate::security::{SecretSource, ServerTokens, TlsIdentity, Token};
pub use crate::yaml_errors::SchemaError;

/// A configuration file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read.
    #[error("cannot read config {path}: {error}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        error: std::io::Error,
    },
    /// The YAML does not fit the schema.
    #[error("config {path}: {error}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What is wrong, and where.
        error: SchemaError,
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
    /// The smallest message limit a server accepts: a frame must hold its envelope.
    pub const MIN_MESSAGE_BYTES: u64 = 64 << 10;

    /// Bytes of tensor data per frame: the message limit less room for the header.
    pub fn chunk_bytes(&self) -> usize {
        crate::wire::chunk_bytes_for(self.max_message_bytes)
    }

    /// Checks every limit; an error names the key (under `limits.`) and what it must be.
    pub fn validate(&self) -> Result<(), LimitError> {
        if self.max_message_bytes < Self::MIN_MESSAGE_BYTES {
            return Err(LimitError::new("limits.max_message_bytes", LimitRule::AtLeast(Self::MIN_MESSAGE_BYTES)));
        }
        if self.max_payload_bytes == 0 {
            return Err(LimitError::new("limits.max_payload_bytes", LimitRule::Positive));
        }
        if self.queue_depth == 0 {
            return Err(LimitError::new("limits.queue_depth", LimitRule::Positive));
        }
        Ok(())
    }
}

/// A limit no server can enforce: its key (under `limits.`) and the rule it breaks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{rule}")]
pub struct LimitError {
    /// The key, `limits.` included.
    pub key: &'static str,
    /// What the value must be.
    pub rule: LimitRule,
}

/// What a limit's value must be.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitRule {
    /// Above zero.
    #[error("must be positive")]
    Positive,
    /// At least this.
    #[error("must be at least {0}")]
    AtLeast(u64),
    /// At least another limit.
    #[error("must be at least {key} ({value})")]
    AtLeastLimit {
        /// The other limit's key.
        key: &'static str,
        /// Its value.
        value: u64,
    },
    /// Within HTTP/2's range for a window or a frame.
    #[error("must be from {min} to {max} (HTTP/2's range)")]
    Http2Range {
        /// The least HTTP/2 allows.
        min: u64,
        /// The most.
        max: u64,
    },
    /// Room for the largest request as received and decoded, and its call's message buffer.
    #[error(
        "must hold the largest request as received and decoded, and its call's message buffer: at least 2.1 x \
         limits.max_payload_bytes + 1 MiB + the smaller of limits.max_message_bytes and 1.1 x limits.max_payload_bytes + 1 MiB = {0}"
    )]
    LargestRequest(u64),
}

impl LimitError {
    /// `key` breaking `rule`.
    pub fn new(key: &'static str, rule: LimitRule) -> Self {
        Self { key, rule }
    }
}

/// `tls:` of a server (and of the loopback server in edge.yaml): a certificate and its key.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTlsIdentity {
    /// The PEM certificate chain.
    pub cert: PathBuf,
    /// Its PEM private key.
    pub key: PathBuf,
}

/// `auth:` on either side: the bearer token's source.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAuth {
    /// A file or an environment variable.
    pub token: SecretSource,
}

/// `auth:` of a server: one token every client carries, or one for each client by name.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServerAuth {
    /// The one token, a file or an environment variable.
    #[serde(default)]
    pub token: Option<SecretSource>,
    /// Each client's token, by its name.
    #[serde(default)]
    pub tokens: Option<std::collections::BTreeMap<String, SecretSource>>,
}

/// One config file being validated: reads its secrets and files (relative to it) and names
/// the file and the key in every error.
pub struct ConfigFile<'a> {
    /// The config file.
    pub path: &'a Path,
}

impl ConfigFile<'_> {
    /// Reads and parses the raw YAML.
    pub fn read_yaml<T: serde::de::DeserializeOwned>(&self) -> Result<T, ConfigError> {
        let path = self.path.to_path_buf();
        let text = std::fs::read_to_string(self.path).map_err(|error| ConfigError::Read { path: path.clone(), error })?;
        crate::yaml_errors::parse(&text).map_err(|error| ConfigError::Parse { path, error })
    }

    /// An invalid value at `key`.
    pub fn invalid(&self, key: &str, message: impl Into<String>) -> ConfigError {
        ConfigError::Invalid { path: self.path.to_path_buf(), key: key.into(), message: message.into() }
    }

    /// A path of the config, resolved (see [`relative_to`]).
    pub fn resolve(&self, p: &Path) -> PathBuf {
        relative_to(self.path, p)
    }

    /// A device (`auto`, `cpu`, `cuda:N`) at `key`.
    pub fn device(&self, key: &str, text: &str) -> Result<DeviceSpec, ConfigError> {
        text.parse().map_err(|e: crate::BundleError| self.invalid(key, e.to_string()))
    }

    /// The bytes of a file the config names at `key`.
    pub fn file(&self, key: &str, file: &Path) -> Result<Vec<u8>, ConfigError> {
        let file = self.resolve(file);
        std::fs::read(&file).map_err(|e| self.invalid(key, format!("cannot read {}: {e}", file.display())))
    }

    /// A payload key from a file or an environment variable.
    pub fn key(&self, key: &str, file: Option<PathBuf>, env: Option<String>) -> Result<Key, ConfigError> {
        let source = SecretSource { file, env }.relative_to(|f| self.resolve(f));
        let material = source.read().map_err(|e| self.invalid(key, e.to_string()))?;
        Key::parse(&material).map_err(|e| self.invalid(key, e.to_string()))
    }

    /// The bearer token of `auth:`, if any.
    pub fn token(&self, auth: Option<RawAuth>) -> Result<Option<Token>, ConfigError> {
        auth.map(|auth| self.secret_token("auth.token", auth.token)).transpose()
    }

    /// The bearer tokens of a server's `auth:`: `token` (one, shared) or `tokens` (one a
    /// client, named with letters, digits, `.`, `_` and `-`, each a different token).
    pub fn server_tokens(&self, auth: Option<RawServerAuth>) -> Result<ServerTokens, ConfigError> {
        let Some(auth) = auth else { return Ok(ServerTokens::None) };
        let named = match (auth.token, auth.tokens) {
            (Some(token), None) => return Ok(ServerTokens::Shared(self.secret_token("auth.token", token)?)),
            (None, Some(named)) if !named.is_empty() => named,
            (Some(_), Some(_)) => {
                return Err(self.invalid("auth", "give `token` (one, every client's) or `tokens` (one a client, by name), not both"))
            }
            (None, _) => return Err(self.invalid("auth", "give `token: {file: F}` (one, every client's) or `tokens: {NAME: {file: F}, ...}`")),
        };
        let mut tokens: Vec<(String, Token)> = Vec::with_capacity(named.len());
        for (name, source) in named {
            let key = format!("auth.tokens.{name}");
            if name.is_empty() || name.len() > 64 || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)) {
                return Err(self.invalid(&key, "a client's name is 1 to 64 letters, digits, `.`, `_` or `-`"));
            }
            let token = self.secret_token(&key, source)?;
            if let Some((other, _)) = tokens.iter().find(|(_, t)| t.matches_header(token.bearer().as_bytes())) {
                return Err(self.invalid(&key, format!("the same token as `{other}`: each client's token names it alone")));
            }
            tokens.push((name, token));
        }
        Ok(ServerTokens::Named(tokens))
    }

    /// The token at `key`, read from `source`.
    fn secret_token(&self, key: &str, source: SecretSource) -> Result<Token, ConfigError> {
        let material = source.relative_to(|f| self.resolve(f)).read().map_err(|e| self.invalid(key, e.to_string()))?;
        Token::parse(&material).map_err(|e| self.invalid(key, e.to_string()))
    }

    /// A server's TLS identity at `key`, if any.
    pub fn identity(&self, key: &str, tls: Option<RawTlsIdentity>) -> Result<Option<TlsIdentity>, ConfigError> {
        let Some(tls) = tls else { return Ok(None) };
        let cert_pem = self.file(&format!("{key}.cert"), &tls.cert)?;
        let key_pem = zeroize::Zeroizing::new(self.file(&format!("{key}.key"), &tls.key)?);
        if !cert_pem.starts_with(b"-----BEGIN") {
            return Err(self.invalid(&format!("{key}.cert"), "expected a PEM certificate"));
        }
        Ok(Some(TlsIdentity { cert_pem, key_pem }))
    }

    /// `threads:` and `cores:`, checked (absent: libtorch's default threads, every core the
    /// process may use).
    pub fn cpu(&self, threads: Option<usize>, cores: Option<Vec<usize>>) -> Result<CpuUse, ConfigError> {
        if let Some(n) = threads.filter(|n| !(1..=CpuUse::MAX_THREADS).contains(n)) {
            return Err(self.invalid("threads", format!("{n} threads: expected 1 to {}", CpuUse::MAX_THREADS)));
        }
        if let Some(cores) = &cores {
            if cores.is_empty() {
                return Err(self.invalid("cores", "an empty list: give the cores to run on, or leave the key out"));
            }
            if let Some(c) = cores.iter().find(|&&c| c >= CpuUse::MAX_CORE) {
                return Err(self.invalid("cores", format!("core {c}: expected 0 to {}", CpuUse::MAX_CORE - 1)));
            }
        }
        Ok(CpuUse { threads, cores })
    }

    /// Limits, checked; `prefix` is where they sit in the file (`""` or `"loopback."`).
    pub fn limits(&self, prefix: &str, limits: Limits) -> Result<Limits, ConfigError> {
        limits.validate().map_err(|e| self.invalid(&format!("{prefix}{}", e.key), e.to_string()))?;
        Ok(limits)
    }
}

/// `threads:` and `cores:` in either config: how many threads libtorch runs one operator on
/// (its intra-op pool, and the codec's pool of block workers) and the cores the process runs
/// on. Absent: libtorch's default, one
/// thread per core the process may use, on every core. An edge and a server sharing a
/// machine each want their own share, or their pools fight over the cores.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CpuUse {
    /// Threads per operator.
    pub threads: Option<usize>,
    /// Cores to run on.
    pub cores: Option<Vec<usize>>,
}

impl CpuUse {
    /// The most threads a config may ask for.
    pub const MAX_THREADS: usize = 1024;
    /// Cores are numbered below this (the kernel's `CPU_SETSIZE`).
    pub const MAX_CORE: usize = 1024;

    /// Pins the calling thread to the cores (threads it starts later inherit them: call it
    /// before any other starts) and sets libtorch's intra-op threads.
    pub fn apply(&self) -> std::io::Result<()> {
        if let Some(cores) = &self.cores {
            // The kernel takes a set with some cores it has (and ignores the rest), and says
            // only EINVAL for one with none: name the cores that exist instead.
            let allowed = allowed_cores()?;
            if let Some(c) = cores.iter().find(|c| !allowed.contains(c)) {
                return Err(std::io::Error::other(format!(
                    "`cores`: core {c} is not one this process may run on: it may use cores {}",
                    core_ranges(&allowed)
                )));
            }
            pin_thread(0, cores)?;
        }
        if let Some(n) = self.threads {
            tch::set_num_threads(n as i32);
            // The codec's block workers take the same share. Only the first call sizes the
            // pool (a process applies its config once; tests in one process share it).
            let _ = rayon::ThreadPoolBuilder::new().num_threads(n).build_global();
        }
        Ok(())
    }
}

/// Restricts thread `tid` (0: the caller) to `cores`.
pub fn pin_thread(tid: i32, cores: &[usize]) -> std::io::Result<()> {
    use nix::sched::{sched_setaffinity, CpuSet};
    let mut set = CpuSet::new();
    for &c in cores {
        set.set(c).map_err(|e| std::io::Error::other(format!("core {c}: {e}")))?;
    }
    sched_setaffinity(nix::unistd::Pid::from_raw(tid), &set).map_err(|e| std::io::Error::other(format!("cannot run on cores {cores:?}: {e}")))
}

/// The cores this process may run on.
pub fn allowed_cores() -> std::io::Result<Vec<usize>> {
    use nix::sched::{sched_getaffinity, CpuSet};
    let set = sched_getaffinity(nix::unistd::Pid::from_raw(0)).map_err(std::io::Error::other)?;
    Ok((0..CpuSet::count()).filter(|&c| set.is_set(c).unwrap_or(false)).collect())
}

/// Cores as ranges, `0-3,8,10-11`.
fn core_ranges(cores: &[usize]) -> String {
    let mut ranges: Vec<(usize, usize)> = Vec::new();
    for &c in cores {
        match ranges.last_mut() {
            Some((_, end)) if *end + 1 == c => *end = c,
            _ => ranges.push((c, c)),
        }
    }
    ranges.iter().map(|&(a, b)| if a == b { a.to_string() } else { format!("{a}-{b}") }).collect::<Vec<_>>().join(",")
}

/// The default device: `auto`.
pub fn auto_device() -> String {
    "auto".into()
}

/// Paths in a config are relative to the directory of the config file... except when the
/// config sits in `config/`, where they are relative to the project root (its parent), so
/// the example configs work from a checkout.
pub fn relative_to(config: &Path, p: &Path) -> PathBuf {
    if p.is_absolute() {
        return p.to_path_buf();
    }
    base_of(config).join(p)
}

/// Said of a missing path that `config` names: where its relative paths start.
pub fn relative_paths_note(config: &Path) -> String {
    format!(
        " (relative paths in {} start at {}: a config's own directory, or the project root for a config in a `config/` directory)",
        config.display(),
        base_of(config).display()
    )
}

/// Where the relative paths of `config` start (see [`relative_to`]).
fn base_of(config: &Path) -> &Path {
    let dir = config.parent().unwrap_or(Path::new("."));
    let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
    if dir.file_name().is_some_and(|n| n == "config") {
        match dir.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent,
            _ => Path::new("."),
        }
    } else {
        dir
    }
}

#[cfg(test)]
mod tests {
    use super::core_ranges;

    #[test]
    fn cores_are_named_as_ranges() {
        assert_eq!(core_ranges(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(core_ranges(&[5]), "5");
        assert_eq!(core_ranges(&[]), "");
    }
}
