//! Link security: where secrets come from (a file or an environment variable, never the YAML
//! itself), the bearer token, TLS material, and what each side ends up with.
//!
//! Secrets never reach a log, an error message or a result file: their types print as
//! `<redacted>`, and errors name the file or variable, never the content.

use std::fmt;
use std::path::{Path, PathBuf};

use cleave_codec::{CodecPolicy, Key, KeyRing};
use serde::Deserialize;
use subtle::ConstantTimeEq;
use zeroize::Zeroizing;

/// Where a secret is read from.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretSource {
    /// A file holding it.
    #[serde(default)]
    pub file: Option<PathBuf>,
    /// An environment variable holding it.
    #[serde(default)]
    pub env: Option<String>,
}

impl SecretSource {
    /// Reads the secret; the error names where it looked and what is wrong, never the secret.
    pub fn read(&self) -> Result<Zeroizing<Vec<u8>>, String> {
        match (&self.file, &self.env) {
            (Some(path), None) => std::fs::read(path).map(Zeroizing::new).map_err(|e| format!("cannot read {}: {e}", path.display())),
            (None, Some(var)) => {
                std::env::var_os(var).map(|v| Zeroizing::new(v.into_encoded_bytes())).ok_or_else(|| format!("environment variable {var} is not set"))
            }
            _ => Err("give exactly one of `file` and `env` (secrets never go in the YAML itself)".into()),
        }
    }

    /// Resolves a relative file against `base`.
    pub(crate) fn relative_to(mut self, base: impl Fn(&Path) -> PathBuf) -> Self {
        self.file = self.file.map(|f| base(&f));
        self
    }
}

/// A bearer token. Compared in constant time; never printed.
#[derive(Clone)]
pub struct Token(Zeroizing<String>);

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

impl Token {
    /// From a secret's bytes (surrounding whitespace ignored; at least 16 characters of
    /// printable ASCII, so that it fits an HTTP header and is not trivially guessed).
    pub fn parse(material: &[u8]) -> Result<Self, String> {
        let text = std::str::from_utf8(material).map_err(|_| "the token is not UTF-8".to_string())?.trim();
        if text.len() < 16 || !text.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(format!("a token is at least 16 printable ASCII characters without spaces; this one has {} characters", text.len()));
        }
        Ok(Self(Zeroizing::new(text.to_string())))
    }

    /// The `authorization` header value.
    pub fn bearer(&self) -> Zeroizing<String> {
        Zeroizing::new(format!("Bearer {}", &*self.0))
    }

    /// Whether an `authorization` header value carries this token.
    pub fn matches_header(&self, header: &[u8]) -> bool {
        header.strip_prefix(b"Bearer ").is_some_and(|t| bool::from(t.ct_eq(self.0.as_bytes())))
    }
}

/// A server's certificate chain and private key (PEM).
#[derive(Clone)]
pub struct TlsIdentity {
    /// Certificate chain, PEM.
    pub cert_pem: Vec<u8>,
    /// Private key, PEM.
    pub key_pem: Zeroizing<Vec<u8>>,
}

impl fmt::Debug for TlsIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("TlsIdentity(<certificate and key>)")
    }
}

/// What a host trusts to verify the server (PEM) and the name it expects.
#[derive(Debug, Clone)]
pub struct ClientTls {
    /// CA certificate(s), PEM.
    pub ca_pem: Vec<u8>,
    /// The server name to verify (defaults to the URL's host).
    pub domain: Option<String>,
}

/// Everything a server enforces beyond the bundle: accepted codecs, keys, TLS, token.
#[derive(Debug, Clone, Default)]
pub struct ServerSecurity {
    /// Codecs accepted, and whether payloads must be sealed.
    pub policy: CodecPolicy,
    /// Keys held (the current one and, during rotation, the previous one).
    pub keys: KeyRing,
    /// TLS identity; plaintext when absent.
    pub tls: Option<TlsIdentity>,
    /// Bearer token every call must carry; none when absent.
    pub token: Option<Token>,
}

/// Everything a host uses beyond the bundle: its key, TLS trust, token.
#[derive(Debug, Clone, Default)]
pub struct EdgeSecurity {
    /// The key id and key payloads are sealed with; plaintext payloads when absent.
    pub key: Option<(u32, Key)>,
    /// TLS trust; plaintext when absent.
    pub tls: Option<ClientTls>,
    /// Bearer token sent with every call.
    pub token: Option<Token>,
}

impl EdgeSecurity {
    /// The host's key ring (empty without a key).
    pub fn ring(&self) -> KeyRing {
        KeyRing::new(self.key.iter().map(|(id, key)| (*id, key.clone()))).expect("one key")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_compare_whole_and_never_print() {
        let token = Token::parse(b"0123456789abcdef\n").unwrap();
        assert!(token.matches_header(b"Bearer 0123456789abcdef"));
        assert!(!token.matches_header(b"Bearer 0123456789abcde"));
        assert!(!token.matches_header(b"0123456789abcdef"));
        assert_eq!(format!("{token:?}"), "Token(<redacted>)");
        assert!(Token::parse(b"short").unwrap_err().contains("at least 16"));
        assert!(Token::parse(b"has a space inside it").is_err());
    }

    #[test]
    fn secrets_come_from_exactly_one_place() {
        let both = SecretSource { file: Some("k".into()), env: Some("K".into()) };
        assert!(both.read().unwrap_err().contains("exactly one"));
        let missing = SecretSource { file: None, env: Some("CLEAVE_TEST_SURELY_UNSET_VARIABLE".into()) };
        assert_eq!(missing.read().unwrap_err(), "environment variable CLEAVE_TEST_SURELY_UNSET_VARIABLE is not set");
    }
}
