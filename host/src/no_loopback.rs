//! `--loopback` in a host built without the `loopback` feature (and so without the server
//! crate): every use is refused, naming the feature.

use std::path::Path;

use crate::config::EdgeConfig;

/// Never made: a host without the feature cannot start a server.
pub(crate) struct LoopbackServer {
    pub(crate) url: String,
}

impl LoopbackServer {
    pub(crate) async fn shutdown(self) -> Result<(), LoopbackError> {
        Ok(())
    }
}

/// Why `--loopback` cannot be used here.
#[derive(Debug, thiserror::Error)]
pub enum LoopbackError {
    /// This host was built without the server.
    #[error("--loopback needs the host's `loopback` cargo feature (on by default); this host was built without it")]
    NotBuilt,
}

pub(crate) async fn for_inference(_: &EdgeConfig) -> Result<LoopbackServer, LoopbackError> {
    Err(LoopbackError::NotBuilt)
}

pub(crate) async fn for_training(_: &EdgeConfig, _: &Path) -> Result<LoopbackServer, LoopbackError> {
    Err(LoopbackError::NotBuilt)
}
