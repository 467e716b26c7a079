//! The host library's error type: one variant per kind of failure, each naming what failed
//! and carrying what a user needs to fix it. A variant's message includes its cause and no
//! variant reports that cause again as its `source`, so a printed chain names each cause once.

use std::path::PathBuf;
use std::sync::Arc;

use cleave_common::config::ConfigError;
use cleave_common::training::TrainError;
use cleave_common::wire::{CodecError, WireError};
use cleave_common::BundleError;

use crate::loopback::LoopbackError;
use crate::planning::planner::ProfileError;
use crate::plots::PlotError;

/// Result alias for the host library.
pub type Result<T, E = HostError> = std::result::Result<T, E>;

/// Everything that can stop a host run, plan or training.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// `edge.yaml` cannot be used.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The bundle cannot be opened, loaded or run.
    #[error(transparent)]
    Bundle(#[from] BundleError),
    /// A training part failed.
    #[error(transparent)]
    Training(#[from] TrainError),
    /// A payload cannot be encoded or decoded.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// A payload sender cannot be made (a key the ring does not hold, say).
    #[error(transparent)]
    Codec(#[from] CodecError),
    /// Profiles that cannot be planned from.
    #[error(transparent)]
    Profile(#[from] ProfileError),
    /// A plot cannot be drawn or written.
    #[error(transparent)]
    Plot(#[from] PlotError),
    /// The server started in this process (`--loopback`) failed.
    #[error("the loopback server: {0}")]
    Loopback(LoopbackError),
    /// The server cannot be reached.
    #[error("cannot connect to {url}: {reason}")]
    Connect {
        /// The server's URL.
        url: String,
        /// Why, with every cause.
        reason: String,
    },
    /// The server cannot be reached for a reason that trying again cannot fix (a name that
    /// does not resolve, a TLS handshake refused, a URL the link cannot use).
    #[error("cannot connect to {url}: {reason} (trying again cannot fix this)")]
    Unreachable {
        /// The server's URL.
        url: String,
        /// Why, with every cause.
        reason: String,
    },
    /// A call to the server failed with a gRPC status.
    #[error("{call}: {code:?}: {message}")]
    Rpc {
        /// The call (`Info`, `Infer`, `Train`, `Profile`, `Echo`).
        call: &'static str,
        /// The status code.
        code: tonic::Code,
        /// The server's message.
        message: String,
    },
    /// The server cannot serve this host as configured (another bundle, a codec or key it
    /// refuses).
    #[error("{0}")]
    Refused(String),
    /// The server broke the protocol (an answer out of order, a missing reply).
    #[error("{0}")]
    Stream(String),
    /// The connection or stream to the server broke (a training link continues its session
    /// on a new one).
    #[error("the link to the server broke: {0}")]
    Lost(String),
    /// The run cannot work as configured (a batch too large, a split after the tail...).
    #[error("{0}")]
    Invalid(String),
    /// A file or directory the run needs does not exist.
    #[error("{what} {path} does not exist{hint}")]
    Missing {
        /// What it is (`bundle`, `dataset`).
        what: &'static str,
        /// Where it was looked for.
        path: PathBuf,
        /// How to make it (`: run make X, which creates it`), or nothing.
        hint: String,
    },
    /// A file cannot be read or written.
    #[error("{action} {path}: {error}")]
    Io {
        /// `cannot read`, `cannot write`, `cannot create`, `image directory`.
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        error: std::io::Error,
    },
    /// An image cannot be read or decoded.
    #[error("image {path}: {error}")]
    Image {
        /// The image file.
        path: PathBuf,
        /// Why.
        error: image::ImageError,
    },
    /// A tensor file (safetensors, npz, npy) cannot be read.
    #[error("{what} {path}: {error}")]
    TensorFile {
        /// What it is to the run (`input file`, `cannot read training data`).
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// libtorch's error.
        error: tch::TchError,
    },
    /// A file's content cannot be used.
    #[error("{path}: {message}")]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// The stage graph cannot be written or drawn (the message names the file).
    #[error("the stage graph: {0}")]
    Graph(std::io::Error),
    /// libtorch refused an operation on the edge.
    #[error("{0}")]
    Torch(String),
    /// A task of the host's own (on the blocking pool or the runtime) panicked or was
    /// cancelled.
    #[error("{what}: {error}")]
    Task {
        /// What it was doing (`loading the datasets`).
        what: &'static str,
        /// How it ended.
        error: tokio::task::JoinError,
    },
    /// A thread of the host's own cannot start.
    #[error("cannot start {what}: {error}")]
    ThreadStart {
        /// The thread (`the prefix thread`).
        what: &'static str,
        /// Why.
        error: std::io::Error,
    },
    /// A thread of the host's own panicked (its message is in the log).
    #[error("{what} panicked")]
    ThreadPanicked {
        /// The thread.
        what: &'static str,
    },
    /// A report cannot be written as JSON.
    #[error("{what}: {error}")]
    Json {
        /// What was being written (`the summary as JSON`).
        what: &'static str,
        /// Why.
        error: serde_json::Error,
    },
    /// A step of a longer job failed; `context` says which.
    #[error("{context}: {error}")]
    During {
        /// What was being done (`training step 12`, `evaluation`).
        context: String,
        /// What failed.
        error: Box<HostError>,
    },
}

impl HostError {
    /// A failure to write `path`.
    pub fn write(path: impl Into<PathBuf>, error: std::io::Error) -> Self {
        Self::Io { action: "cannot write", path: path.into(), error }
    }

    /// A failure to read `path`.
    pub fn read(path: impl Into<PathBuf>, error: std::io::Error) -> Self {
        Self::Io { action: "cannot read", path: path.into(), error }
    }

    /// A failed call, from its status.
    pub fn rpc(call: &'static str, status: &tonic::Status) -> Self {
        Self::Rpc { call, code: status.code(), message: status.message().to_string() }
    }

    /// Whether trying again cannot change the outcome: the server is unreachable for good,
    /// refuses this host, or refused its credentials or request.
    pub fn is_lasting(&self) -> bool {
        use tonic::Code::{InvalidArgument, PermissionDenied, Unauthenticated, Unimplemented};
        match self {
            Self::Unreachable { .. } | Self::Refused(_) | Self::Invalid(_) => true,
            Self::Rpc { code, .. } => matches!(code, Unauthenticated | PermissionDenied | Unimplemented | InvalidArgument),
            Self::During { error, .. } => error.is_lasting(),
            _ => false,
        }
    }

    /// This error, as what failed while doing `context`.
    pub fn during(self, context: impl Into<String>) -> Self {
        Self::During { context: context.into(), error: Box::new(self) }
    }
}

impl From<LoopbackError> for HostError {
    fn from(e: LoopbackError) -> Self {
        Self::Loopback(e)
    }
}

impl From<tch::TchError> for HostError {
    fn from(e: tch::TchError) -> Self {
        Self::Torch(e.to_string())
    }
}

/// Why a request has no result.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RequestFailure {
    /// The server answered it with an error status.
    #[error("{code:?}: {message}")]
    Refused {
        /// The answer's status code.
        code: tonic::Code,
        /// The server's message.
        message: String,
    },
    /// Its result came back and cannot be opened or decoded.
    #[error("result: {0}")]
    Undecodable(WireError),
    /// The run stopped before its answer came.
    #[error("Cancelled: {reason}")]
    Cancelled {
        /// Why the run stopped.
        reason: String,
    },
    /// The run gave up on it: no server took it.
    #[error("Unavailable: {reason}")]
    Unavailable {
        /// Why the last connection was lost.
        reason: String,
    },
    /// Finishing it on the edge (`fallback: edge`) failed.
    #[error("on the edge: {0}")]
    OnEdge(Arc<BundleError>),
    /// The edge's prefix thread stopped before it finished the request there.
    #[error("the edge could not finish this request: the prefix thread stopped")]
    EdgeStopped,
}

impl RequestFailure {
    /// The status code of the server's error answer.
    pub fn server_code(&self) -> Option<tonic::Code> {
        match self {
            Self::Refused { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// Whether both are the same error answer from the server.
    pub fn same_refusal(&self, other: &Self) -> bool {
        matches!((self, other), (Self::Refused { code: a, message: m }, Self::Refused { code: b, message: n }) if a == b && m == n)
    }
}

/// Why an `Infer` stream is of no more use to the host.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// The server ended it.
    #[error("the server ended the stream")]
    Ended,
    /// It failed with a status.
    #[error("the stream failed: {:?}: {}", .0.code(), .0.message())]
    Failed(tonic::Status),
    /// A result's frames do not make a payload: the server broke the framing.
    #[error("the result of request {id} cannot be reassembled: {error}")]
    Unassembled {
        /// The request.
        id: u64,
        /// What is wrong with its frames.
        error: WireError,
    },
    /// An answer to a request this stream never carried.
    #[error("the server answered request {0}, which this connection never sent")]
    NeverSent(u64),
    /// The server answered UNAVAILABLE (it is draining), with this message.
    #[error("the server cannot take requests now: Unavailable: {0}")]
    Draining(String),
}
