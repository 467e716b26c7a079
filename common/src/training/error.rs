//! Why a training step, or setting one up, failed.

use crate::error::BundleError;

/// Why a training step, or setting one up, failed.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// Loading or running the stages failed, or a boundary does not fit the manifest.
    #[error(transparent)]
    Bundle(#[from] BundleError),
    /// The bundle cannot be trained as it is.
    #[error("the bundle cannot be trained: {0}")]
    NotTrainable(String),
    /// A configuration value that cannot work (optimizer, loss, split).
    #[error("{0}")]
    Invalid(String),
    /// The loss cannot be computed from this output and these targets.
    #[error("loss: {0}")]
    Loss(String),
    /// Gradients that do not fit the boundary they belong to.
    #[error("gradients: {0}")]
    Gradients(String),
    /// libtorch refused an operation.
    #[error("{step}: {message}")]
    Torch {
        /// What was being done.
        step: &'static str,
        /// libtorch's message (first line).
        message: String,
    },
    /// A checkpoint cannot be written or read, or does not fit these stages.
    #[error("checkpoint {path}: {message}")]
    Checkpoint {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong.
        message: String,
    },
}

impl TrainError {
    pub(crate) fn torch(step: &'static str, err: tch::TchError) -> Self {
        let text = err.to_string();
        let message = text.lines().find(|l| !l.trim().is_empty()).unwrap_or(&text).trim().to_string();
        Self::Torch { step, message }
    }
}
