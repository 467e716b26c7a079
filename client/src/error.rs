//! Why a server cannot be reached, refuses, or breaks a stream. A variant's message includes its
//! cause and no variant reports that cause again as its `source`, so a printed chain names each
//! cause once.

use std::time::Duration;

use cleave_common::error::with_causes;
use cleave_common::protocol::ProtocolError;
use cleave_common::wire::{CodecError, PolicyError, WireError};

/// Why the link to a server failed.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// The server cannot be reached.
    #[error("cannot connect to {url}: {failure}{}", attempts_note(*attempts))]
    Connect {
        /// The server's URL.
        url: String,
        /// Why.
        failure: ConnectFailure,
        /// The attempts made in a row (`retry.max_attempts`), when more than one.
        attempts: u32,
    },
    /// The server cannot be reached for a reason that trying again cannot fix (a name that
    /// does not resolve, a TLS handshake refused, a URL the link cannot use).
    #[error("cannot connect to {url}: {failure} (trying again cannot fix this)")]
    Unreachable {
        /// The server's URL.
        url: String,
        /// Why.
        failure: ConnectFailure,
    },
    /// A call to the server failed with a gRPC status.
    #[error("{call}: {code:?}: {message}")]
    Rpc {
        /// The call (`Info`, `Infer`, `Train`, `Generate`, `Profile`, `Echo`).
        call: &'static str,
        /// The status code.
        code: tonic::Code,
        /// The server's message.
        message: String,
    },
    /// The server cannot serve this caller as configured (another bundle, a codec or key it
    /// refuses), or refused a call.
    #[error(transparent)]
    Refused(#[from] Refusal),
    /// The bearer token cannot go in an HTTP header.
    #[error("the bearer token is not a valid header value")]
    TokenNotAHeaderValue,
    /// The server broke the protocol (an answer out of order, a missing reply).
    #[error(transparent)]
    Breach(#[from] Breach),
    /// A message could not be sealed or opened with the link's key.
    #[error(transparent)]
    Seal(#[from] CodecError),
    /// A payload could not be encoded, or one received cannot be reassembled or decoded.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// The connection or stream to the server broke (a training link continues its session
    /// on a new one).
    #[error("the link to the server broke: {0}")]
    Lost(LinkLost),
    /// An `Infer` stream is of no more use.
    #[error(transparent)]
    Stream(#[from] StreamError),
    /// A list of servers to connect to the first of was empty.
    #[error("no server to connect to: the list of servers is empty")]
    NoServer,
}

impl LinkError {
    /// A failed call, from its status.
    pub fn rpc(call: &'static str, status: &tonic::Status) -> Self {
        Self::Rpc { call, code: status.code(), message: status.message().to_string() }
    }

    /// Whether trying again cannot change the outcome: the server is unreachable for good,
    /// refuses this caller, or refused its credentials or request.
    pub fn is_lasting(&self) -> bool {
        use tonic::Code::{InvalidArgument, PermissionDenied, Unauthenticated, Unimplemented};
        match self {
            Self::Unreachable { .. } | Self::Refused(_) | Self::TokenNotAHeaderValue | Self::NoServer => true,
            Self::Rpc { code, .. } => matches!(code, Unauthenticated | PermissionDenied | Unimplemented | InvalidArgument),
            Self::Connect { .. } | Self::Breach(_) | Self::Seal(_) | Self::Wire(_) | Self::Lost(_) | Self::Stream(_) => false,
        }
    }
}

/// Why a connection to the server failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnectFailure {
    /// The transport failed: refused, reset or timed out, a name that does not resolve, a
    /// TLS handshake refused, a URL tonic cannot use (the message names every cause).
    #[error("{}", with_causes(.0))]
    Transport(tonic::transport::Error),
    /// The connection was not made within `connect_timeout`.
    #[error("no answer within {0:?} (`connect_timeout`)")]
    NoAnswer(Duration),
    /// The server did not answer `Info` within `connect_timeout`.
    #[error("no answer to Info within {0:?} (`connect_timeout`)")]
    NoInfo(Duration),
    /// `Info` failed with a status that may pass.
    #[error("Info: {code:?}: {message}")]
    Info {
        /// The status code.
        code: tonic::Code,
        /// Its message.
        message: String,
    },
    /// The `Infer` stream did not open in time.
    #[error("the Infer stream did not open within {0:?}")]
    StreamNotOpened(Duration),
    /// The connection broke before it answered anything.
    #[error("the connection answered nothing: {0}")]
    AnsweredNothing(Box<StreamError>),
    /// An `https://` URL without the `tls:` section that says whom to trust.
    #[error("the URL starts with https:// but edge.yaml has no `tls:` (the CA to trust, and the `domain` its certificate names)")]
    HttpsWithoutTls,
    /// `tls:` with a URL that is not `https://`.
    #[error("TLS is configured, so the URL must start with https://")]
    TlsWithoutHttps,
    /// The TLS settings could not be applied.
    #[error("TLS configuration: {}", with_causes(.0))]
    TlsConfig(tonic::transport::Error),
}

/// ` (N attempts, `retry.max_attempts`)` after more than one attempt.
fn attempts_note(attempts: u32) -> String {
    if attempts > 1 {
        format!(" ({attempts} attempts, `retry.max_attempts`)")
    } else {
        String::new()
    }
}

/// Why an `Infer` stream is of no more use to the caller.
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
    /// Nothing came back within `request_timeout`.
    #[error("no answer within {0:?} (`request_timeout`)")]
    Stalled(Duration),
    /// The server's health service said the model was not SERVING for this long
    /// (`request_timeout`).
    #[error("the server did not serve the model for {0:?} (`request_timeout`)")]
    NotServing(Duration),
    /// The server answered UNAVAILABLE (it is draining), with this message.
    #[error("the server cannot take requests now: Unavailable: {0}")]
    Draining(String),
}

/// Why the server cannot serve the caller as configured, or what it refused.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// The server's `Info` describes a server the caller cannot work with.
    #[error("{url}: {error}")]
    Info {
        /// The server's URL.
        url: String,
        /// What does not fit.
        error: ProtocolError,
    },
    /// The server serves no bundle with the caller's id.
    #[error(transparent)]
    Bundle(#[from] BundleMismatch),
    /// A codec the server does not accept.
    #[error("codec {codec}: the server refuses it: {error}")]
    Codec {
        /// The codec.
        codec: String,
        /// The part refused.
        error: PolicyError,
    },
    /// `codec: auto`, and the server accepts none of the codecs it picks from.
    #[error("codec: auto: the server accepts none of {}", candidates.join(", "))]
    NoAutoCodec {
        /// The codecs `auto` picks from.
        candidates: Vec<String>,
    },
    /// Payloads in the clear to a server that requires them sealed.
    #[error("the server requires AES-256-GCM payloads: configure `encryption` with one of its key ids {held:?}")]
    EncryptionRequired {
        /// The server's key ids.
        held: Vec<u32>,
    },
    /// A key id the server does not hold.
    #[error("the server holds key ids {held:?}, not {id}: it could not open this host's payloads")]
    KeyNotHeld {
        /// The caller's key id.
        id: u32,
        /// The server's.
        held: Vec<u32>,
    },
    /// The server answered a training call with an error.
    #[error("the server refused call {call}: {code:?}: {message}")]
    Call {
        /// The call's id.
        call: u64,
        /// The status code.
        code: tonic::Code,
        /// The server's message.
        message: String,
    },
}

/// The server serves no bundle with the caller's id: the ids on each side (whole: they are
/// what is matched) and, for each served model of the same source, what differs between the
/// two exports.
#[derive(Debug, thiserror::Error)]
#[error("bundle mismatch: this host has {bundle_id} ({source_name}), the server at {url} serves {}{}", served.join(", "), self.other_exports())]
pub struct BundleMismatch {
    /// The caller's bundle id.
    pub bundle_id: String,
    /// Its model's source (`torchvision:resnet18`).
    pub source_name: String,
    /// The server's URL.
    pub url: String,
    /// What the server serves: `ID (SOURCE)`.
    pub served: Vec<String>,
    /// Served exports of the same model: their short id and what differs.
    pub same_model: Vec<(String, String)>,
}

impl BundleMismatch {
    fn other_exports(&self) -> String {
        self.same_model
            .iter()
            .map(|(id, differs)| format!("; {id} is another export of the same model ({differs}): copy one bundle directory to both sides"))
            .collect()
    }
}

/// How the server broke the protocol.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Breach {
    /// A training step whose loss the server computes came back without it.
    #[error("the server sent no loss")]
    NoLoss,
    /// The server checkpointed another step than the caller.
    #[error("the server checkpointed step {server}, this host step {host}")]
    CheckpointStep {
        /// The server's step.
        server: u64,
        /// The caller's.
        host: u64,
    },
    /// The first reply of a training stream is not the session's opening.
    #[error("the server did not open the session")]
    NotOpened,
    /// A generation step answered with another request's id, or an output that is not the
    /// tensor asked for.
    #[error("the server answered generation step {request_id} with {got}, expected {expected}")]
    GenerationAnswer {
        /// The step.
        request_id: u64,
        /// What came.
        got: String,
        /// What the step asked for.
        expected: String,
    },
    /// A checkpoint request answered without a checkpoint.
    #[error("the server answered a checkpoint request without saving")]
    NotSaved,
    /// An answer asked for with no call in flight (a bug of the caller, not the server's).
    #[error("an answer was awaited with no training call in flight")]
    NothingInFlight,
    /// A gradient-norm call answered without the step being taken.
    #[error("the server answered the clipping coefficient without taking the step")]
    NotStepped,
    /// The end of a client group's round answered without the round ended.
    #[error("the server answered the end of the round without ending it")]
    RoundNotEnded,
    /// A `splitfed` round's average lacks one of this edge's weights, or has another shape.
    #[error("the server's average of the edges' weights has no {name} of its shape and type")]
    Average {
        /// The weight.
        name: String,
    },
    /// The server took another step than the caller.
    #[error("the server took step {server}, this host step {host}")]
    StepApart {
        /// The server's step.
        server: u64,
        /// The caller's.
        host: u64,
    },
    /// A boundary at another cut than the call expects.
    #[error("the server answered with a boundary at cut {got}, expected cut {expected}")]
    WrongCut {
        /// The answer's cut.
        got: u32,
        /// The cut expected.
        expected: u32,
    },
    /// An answer to another call than the one waiting.
    #[error("the server answered call {answered} while call {waiting} was waiting")]
    OutOfOrder {
        /// The call answered.
        answered: u64,
        /// The call waiting.
        waiting: u64,
    },
}

/// How a training stream to the server broke.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkLost {
    /// The stream ended.
    #[error("the server closed the training stream")]
    Closed,
    /// The stream failed with a gRPC status.
    #[error("training stream failed: {code:?}: {message}")]
    Failed {
        /// The status code.
        code: tonic::Code,
        /// Its message.
        message: String,
    },
}
