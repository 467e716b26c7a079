//! `--loopback`: the server, started in this process on 127.0.0.1 with the same code as the
//! `server` binary, so that one command on one machine exercises the whole path. The only
//! use the host makes of the server crate, behind the `loopback` feature (on by default).

use std::path::Path;

use cleave_common::config::Limits;
use cleave_common::security::ServerSecurity;
use cleave_common::DeviceSpec;
use cleave_server::{PreparedServer, ServerError, TrainingOptions};
use tokio::net::TcpListener;

use crate::config::EdgeConfig;

/// A server started in this process for `--loopback`; stops when dropped.
pub struct LoopbackServer {
    /// Its URL.
    pub url: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<Result<(), ServerError>>>,
}

/// Why the loopback server did not start, or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum LoopbackError {
    /// Preparing it (its config, bundle, device) or serving failed.
    #[error(transparent)]
    Server(#[from] ServerError),
    /// It cannot listen on its address.
    #[error("cannot listen on {addr}: {error}")]
    Listen {
        /// The address asked for.
        addr: String,
        /// Why.
        error: std::io::Error,
    },
    /// Its task panicked or was cancelled.
    #[error("its task failed: {0}")]
    Task(tokio::task::JoinError),
}

impl LoopbackServer {
    /// Loads the bundle and serves it on 127.0.0.1, in plaintext, accepting every codec.
    pub async fn start(bundle: &Path, device: DeviceSpec, limits: Limits) -> Result<Self, LoopbackError> {
        Self::start_secured(bundle, device, limits, ServerSecurity::default()).await
    }

    /// Like [`LoopbackServer::start`], enforcing `security` (TLS, token, keys, codecs).
    pub async fn start_secured(bundle: &Path, device: DeviceSpec, limits: Limits, security: ServerSecurity) -> Result<Self, LoopbackError> {
        Self::start_configured(bundle, device, limits, security, TrainingOptions::default()).await
    }

    /// Like [`LoopbackServer::start_secured`], with training sessions configured.
    pub async fn start_configured(
        bundle: &Path,
        device: DeviceSpec,
        limits: Limits,
        security: ServerSecurity,
        training: TrainingOptions,
    ) -> Result<Self, LoopbackError> {
        let bundle = bundle.to_path_buf();
        let prepared =
            tokio::task::spawn_blocking(move || PreparedServer::prepare(&bundle, device, limits, security).map(|p| p.with_training(training)))
                .await
                .map_err(LoopbackError::Task)??;
        Self::serve(prepared).await
    }

    /// Serves a server prepared by the caller (any limits) on 127.0.0.1.
    pub async fn serve(prepared: PreparedServer) -> Result<Self, LoopbackError> {
        Self::serve_at(prepared, "127.0.0.1:0").await
    }

    /// Like [`LoopbackServer::serve`], on `addr` (a server restarted where it was).
    pub async fn serve_at(prepared: PreparedServer, addr: &str) -> Result<Self, LoopbackError> {
        let scheme = if prepared.uses_tls() { "https" } else { "http" };
        let listen_error = |error| LoopbackError::Listen { addr: addr.to_string(), error };
        let listener = TcpListener::bind(addr).await.map_err(listen_error)?;
        let addr = listener.local_addr().map_err(listen_error)?;
        let url = format!("{scheme}://{addr}");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(prepared.serve(listener, async {
            let _ = stopped.await;
        }));
        Ok(Self { url, stop: Some(stop), task: Some(task) })
    }

    /// Stops it: the requests received are answered, every connection closed within the
    /// drain timeout.
    pub async fn shutdown(mut self) -> Result<(), LoopbackError> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.task.take() {
            Some(task) => Ok(task.await.map_err(LoopbackError::Task)??),
            None => Ok(()),
        }
    }
}

/// The loopback server of an inference run or a plan: the config's `loopback` section, and
/// exactly what the host brings (its key, its token, TLS when the loopback has a certificate).
pub(crate) async fn for_inference(config: &EdgeConfig) -> Result<LoopbackServer, LoopbackError> {
    LoopbackServer::start_secured(&config.bundle, config.loopback_device, config.loopback_limits, config.loopback_security()).await
}

/// The loopback server of a training run, writing its checkpoints into `checkpoints`.
/// Every epoch writes a checkpoint: the count quota holds them all (the disk is the host's own).
pub(crate) async fn for_training(config: &EdgeConfig, checkpoints: &Path) -> Result<LoopbackServer, LoopbackError> {
    let d = TrainingOptions::default();
    let epochs = config.train().map_or(0, |t| t.epochs);
    let options = TrainingOptions {
        checkpoint_dir: Some(checkpoints.to_path_buf()),
        concurrent_sessions: false,
        max_checkpoints: d.max_checkpoints.max(u32::try_from(epochs).unwrap_or(u32::MAX)),
        ..d
    };
    LoopbackServer::start_configured(&config.bundle, config.loopback_device, config.loopback_limits, config.loopback_security(), options).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostError;

    #[test]
    fn a_bundle_that_is_not_there_is_a_loopback_error_naming_it() {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let started = runtime.block_on(LoopbackServer::start(Path::new("/nonexistent/bundle"), DeviceSpec::Cpu, Limits::default()));
        let err = started.err().expect("there is no bundle to serve");
        assert!(matches!(&err, LoopbackError::Server(_)), "{err:?}");
        let message = HostError::from(err).to_string();
        assert!(message.starts_with("the loopback server: ") && message.contains("/nonexistent/bundle"), "{message}");
    }
}
