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
    pub fn read(&self) -> Result<Zeroizing<Vec<u8>>, SecretError> {
        match (&self.file, &self.env) {
            (Some(path), None) => std::fs::read(path).map(Zeroizing::new).map_err(|error| SecretError::Unreadable { path: path.clone(), error }),
            (None, Some(var)) => {
                std::env::var_os(var).map(|v| Zeroizing::new(v.into_encoded_bytes())).ok_or_else(|| SecretError::Unset { var: var.clone() })
            }
            _ => Err(SecretError::NotOneSource),
        }
    }

    /// Resolves a relative file against `base`.
    pub(crate) fn relative_to(mut self, base: impl Fn(&Path) -> PathBuf) -> Self {
        self.file = self.file.map(|f| base(&f));
        self
    }
}

/// Why a secret could not be read; it names where it looked, never the secret.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// Its file cannot be read.
    #[error("cannot read {}: {error}", path.display())]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        error: std::io::Error,
    },
    /// Its environment variable is not set.
    #[error("environment variable {var} is not set")]
    Unset {
        /// The variable.
        var: String,
    },
    /// Both a file and a variable, or neither.
    #[error("give exactly one of `file` and `env` (secrets never go in the YAML itself)")]
    NotOneSource,
}

/// Why a token is refused; it says how long the token is, never what it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// Not text.
    #[error("the token is not UTF-8")]
    NotUtf8,
    /// Too short, or with spaces or control characters.
    #[error("a token is at least 16 printable ASCII characters without spaces; this one has {characters} characters")]
    Weak {
        /// Its length.
        characters: usize,
    },
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
    pub fn parse(material: &[u8]) -> Result<Self, TokenError> {
        let text = std::str::from_utf8(material).map_err(|_| TokenError::NotUtf8)?.trim();
        if text.len() < 16 || !text.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(TokenError::Weak { characters: text.len() });
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

/// The bearer tokens a server takes (`auth:` in server.yaml).
#[derive(Debug, Clone, Default)]
pub enum ServerTokens {
    /// None: calls carry no token.
    #[default]
    None,
    /// One token that every client carries (`auth.token`).
    Shared(Token),
    /// A token for each client, by name (`auth.tokens`): what a client may hold of the
    /// server's shares for its peers is counted by its token, wherever it connects from.
    Named(Vec<(String, Token)>),
}

impl ServerTokens {
    /// Whether every call must carry a token.
    pub fn required(&self) -> bool {
        !matches!(self, Self::None)
    }

    /// Whether an `authorization` header value carries a token taken here.
    pub fn take(&self, header: &[u8]) -> bool {
        match self {
            Self::None => true,
            Self::Shared(token) => token.matches_header(header),
            Self::Named(_) => self.name_of(header).is_some(),
        }
    }

    /// The name of the client whose token an `authorization` header value carries (named
    /// tokens only). Every token is compared, in constant time.
    pub fn name_of(&self, header: &[u8]) -> Option<&str> {
        let Self::Named(tokens) = self else { return None };
        tokens.iter().fold(None, |found, (name, token)| if token.matches_header(header) { Some(name.as_str()) } else { found })
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
    /// The bearer tokens a call may carry, one of which it must where there are any.
    pub tokens: ServerTokens,
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
        assert_eq!(Token::parse(b"short").unwrap_err(), TokenError::Weak { characters: 5 });
        assert!(Token::parse(b"short").unwrap_err().to_string().contains("at least 16"));
        assert!(Token::parse(b"has a space inside it").is_err());
    }

    #[test]
    fn secrets_come_from_exactly_one_place() {
        let both = SecretSource { file: Some("k".into()), env: Some("K".into()) };
        assert!(matches!(both.read().unwrap_err(), SecretError::NotOneSource));
        let missing = SecretSource { file: None, env: Some("CLEAVE_TEST_SURELY_UNSET_VARIABLE".into()) };
        assert_eq!(missing.read().unwrap_err().to_string(), "environment variable CLEAVE_TEST_SURELY_UNSET_VARIABLE is not set");
    }
}
