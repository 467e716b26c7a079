//! `--loopback` in a host built without the `loopback` feature (and so without the server
//! crate): every use is refused, naming the feature.

use std::path::Path;

use crate::config::EdgeConfig;
use crate::error::{HostError, Result};

/// Never made: a host without the feature cannot start a server.
pub(crate) struct LoopbackServer {
    pub(crate) url: String,
}

impl LoopbackServer {
    pub(crate) async fn shutdown(self) -> Result<()> {
        Ok(())
    }
}

fn refused() -> HostError {
    HostError::Invalid("--loopback needs the host's `loopback` cargo feature (on by default); this host was built without it".into())
}

pub(crate) async fn for_inference(_: &EdgeConfig) -> Result<LoopbackServer> {
    Err(refused())
}

pub(crate) async fn for_training(_: &EdgeConfig, _: &Path) -> Result<LoopbackServer> {
    Err(refused())
}
