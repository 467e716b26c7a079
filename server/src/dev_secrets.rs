//! `server dev-secrets`: a development CA, a server certificate, a payload key and a token,
//! for tests and demos (production secrets come from your own PKI and secret store).

use std::path::{Path, PathBuf};

use cleave_common::wire::Key;

/// Why `server dev-secrets` could not write its files.
#[derive(Debug, thiserror::Error)]
pub enum DevSecretsError {
    /// A key or certificate could not be made.
    #[error("certificate generation failed: {0}")]
    Certificate(rcgen::Error),
    /// A directory or file could not be written.
    #[error("cannot {action} {}: {error}", path.display())]
    Write {
        /// `create` or `write`.
        action: &'static str,
        /// The directory or file.
        path: PathBuf,
        /// The operating system's error.
        error: std::io::Error,
    },
}

/// Files `server dev-secrets` writes.
#[derive(Debug)]
pub struct DevSecrets {
    /// The directory.
    pub dir: PathBuf,
}

/// Writes a development CA, a server certificate for `localhost`/`127.0.0.1` signed by it,
/// the server's key, a payload key and a token into `dir` (created; files readable only by
/// the owner). For testing and demos: production keys come from your own PKI and secret store.
pub fn write_dev_secrets(dir: &Path) -> Result<DevSecrets, DevSecretsError> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
    let fail = DevSecretsError::Certificate;
    std::fs::create_dir_all(dir).map_err(|error| DevSecretsError::Write { action: "create", path: dir.into(), error })?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).map_err(fail)?;
    ca_params.distinguished_name.push(DnType::CommonName, "cleave development CA");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_key = KeyPair::generate().map_err(fail)?;
    let ca_cert = ca_params.self_signed(&ca_key).map_err(fail)?;
    let issuer = Issuer::new(ca_params, &ca_key);
    let mut server_params = CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).map_err(fail)?;
    server_params.distinguished_name.push(DnType::CommonName, "cleave development server");
    let server_key = KeyPair::generate().map_err(fail)?;
    let server_cert = server_params.signed_by(&server_key, &issuer).map_err(fail)?;
    let token: String = {
        let key = Key::random();
        key.to_hex()[..40].to_string()
    };
    let payload_key = Key::random().to_hex();
    let files: [(&str, String); 5] = [
        ("ca.pem", ca_cert.pem()),
        ("server.pem", server_cert.pem()),
        ("server.key", server_key.serialize_pem()),
        ("payload.key", payload_key.to_string()),
        ("token", token),
    ];
    for (name, content) in files {
        write_private(&dir.join(name), content.as_bytes())?;
    }
    Ok(DevSecrets { dir: dir.to_path_buf() })
}

fn write_private(path: &Path, content: &[u8]) -> Result<(), DevSecretsError> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let failed = |error| DevSecretsError::Write { action: "write", path: path.into(), error };
    let mut file = options.open(path).map_err(failed)?;
    file.write_all(content).map_err(failed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cleave_common::security::Token;

    #[test]
    fn dev_secrets_are_written_and_parse() {
        let dir = tempfile::tempdir().unwrap();
        write_dev_secrets(dir.path()).unwrap();
        for name in ["ca.pem", "server.pem", "server.key", "payload.key", "token"] {
            assert!(dir.path().join(name).is_file(), "{name}");
        }
        Key::parse(&std::fs::read(dir.path().join("payload.key")).unwrap()).unwrap();
        Token::parse(&std::fs::read(dir.path().join("token")).unwrap()).unwrap();
        assert!(std::fs::read_to_string(dir.path().join("ca.pem")).unwrap().starts_with("-----BEGIN CERTIFICATE-----"));
    }
}
