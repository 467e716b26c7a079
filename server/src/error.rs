//! Why a call failed, by the phase that failed, and the one place that maps such an error
//! to a gRPC status: for a request or training call answered in its stream, for a stream
//! refused before it starts, and for the unary calls (`Profile`, `Echo`) and the token check.
//!
//! A variant's message includes its cause, and no variant reports the cause again as its
//! `source`, so a printed chain names each cause once.

use cleave_common::error::Shared;
use cleave_common::training::TrainError;
use cleave_common::wire::{CodecError, WireError};
use cleave_common::BundleError;
use tonic::{Code, Status};

/// Why a request, a call or a stream failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RequestError {
    /// The payload is malformed.
    #[error("decode: {0}")]
    Wire(WireError),
    /// The split point does not exist.
    #[error("split {split} is out of range: the bundle has cuts 0..={cuts}")]
    SplitOutOfRange { split: u32, cuts: usize },
    /// The boundary does not fit the manifest, or a stage failed.
    #[error("compute: {0}")]
    Bundle(BundleError),
    /// The result cannot be encoded (a lossy precision cannot carry it, say).
    #[error("encode: {0}")]
    Encode(WireError),
    /// The answer is larger than the payload limit (the host accepts answers up to it).
    #[error("the answer holds {bytes} tensor bytes, above this server's limit of {limit} (`limits.max_payload_bytes`)")]
    AnswerTooLarge { bytes: u64, limit: u64 },
    /// A part of the server this call needs has failed: our bug, never the caller's.
    #[error("internal error: {0}")]
    Internal(Internal),
    /// A training call failed (setting up, a step, a checkpoint).
    #[error("training: {0}")]
    Training(TrainError),
    /// A training call out of order (no session yet, a backward without its forward...).
    #[error("training session: {0}")]
    Session(SessionError),
    /// A session of a client group refused, or its turn not come in time.
    #[error("client group: {0}")]
    Group(GroupError),
    /// A generation session refused, or one of its steps.
    #[error("generation: {0}")]
    Generation(GenerationError),
    /// The checkpoint namespace a session would resume is held by another open session.
    #[error(
        "checkpoint namespace {namespace} is held by session {holder}, which is still open: one session at a time writes a \
         namespace; resume once it has closed"
    )]
    AlreadyTraining { namespace: String, holder: String },
    /// The call names a bundle id this server does not serve (or none, where it must).
    #[error("bundle mismatch: the host has bundle {host}, this server serves {}", served.join(", "))]
    UnknownModel { host: String, served: Vec<String> },
    /// Requests merged into one batch could not be concatenated or split back.
    #[error("batching: {0}")]
    Batching(cleave_common::value::BatchMergeError),
    /// A `Profile` or `Echo` call, or a stream's metadata, asks for what the server does not give.
    #[error(transparent)]
    BadCall(BadCall),
    /// Timing the stages failed.
    #[error("profile: {0}")]
    Profile(BundleError),
    /// The call has no bearer token, or the wrong one.
    #[error("{0}")]
    Unauthenticated(&'static str),
    /// The request's bytes do not fit in the memory budget in time.
    #[error(transparent)]
    OverBudget(#[from] crate::budget::OverBudget),
    /// The rest of a request's frames did not come in time; what it held is freed.
    #[error("request stalled: its frames did not all arrive within {0:?} (`limits.request_timeout`); what it held is freed")]
    Stalled(std::time::Duration),
    /// The server is draining: this request was not started; resend it to a server.
    #[error("the server is shutting down: this request was not started, resend it")]
    Draining,
    /// The call's request bytes were refused as they came (see [`crate::inbound`]): no room
    /// for a message in its peer's share of the budget, or a message begun and not ended in
    /// time. The call ends.
    #[error("{message}")]
    Inbound { code: Code, message: String },
    /// A shared resource is taken or a quota full (a profile running, training sessions,
    /// checkpoints).
    #[error(transparent)]
    Busy(Busy),
    /// A bug: something panicked while serving this request; the stream goes on.
    #[error("internal error: {0}")]
    Panicked(String),
    /// A new connection's first call finds every place taken.
    #[error("the server has {open} connections open, its limit (`limits.max_connections`): try again later")]
    ConnectionLimit { open: usize },
    /// A call on a connection the server is closing.
    #[error("the connection is closing")]
    ConnectionClosing,
}

/// Why a training call does not fit its session.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SessionError {
    /// A stream's first frame is not the one that opens a session.
    #[error("the first frame of a Train stream opens the session")]
    NotOpened,
    /// A second opening frame on a stream with a session.
    #[error("this stream already has a session open")]
    AlreadyOpen,
    /// A frame with nothing in it.
    #[error("an empty frame")]
    EmptyFrame,
    /// A payload whose first frame does not say which call it is.
    #[error("a payload's first frame names its phase (forward, backward, evaluate)")]
    NoPhase,
    /// A payload at another cut than the call's.
    #[error("the payload is at cut {cut}, this session expects cut {expected} for {phase:?}")]
    WrongCut { cut: u32, expected: u32, phase: cleave_common::pb::Phase },
    /// The host sent nothing for the idle timeout: the server closed the session.
    #[error("nothing came for {idle:?} (`training.session_idle_timeout`): session {session} is closed")]
    Idle { idle: std::time::Duration, session: String },
    /// A reattach names a session the server does not keep.
    #[error(
        "session {session} {}: it was not opened reattachable, it closed (its stream ended cleanly, or nothing came for \
         `training.session_idle_timeout`, or the server restarted), or its broken stream has not been noticed yet (within the \
         server's keepalive); try again, or open a new session resuming from a checkpoint",
        cleave_common::protocol::SESSION_NOT_WAITING
    )]
    NotWaiting { session: String },
    /// A reattach from a stream of another model.
    #[error("session {session} trains bundle {trains}, not {asked}")]
    OtherBundle { session: String, trains: String, asked: String },
    /// A checkpoint call on a server without a checkpoint directory.
    #[error("this server has no checkpoint directory (`training.checkpoint_dir`)")]
    NoCheckpointDir,
    /// What a forward leaves for its backward does not fit in the memory budget.
    #[error("the forward's graph at batch {batch} (what it keeps for its backward) does not fit: {over}")]
    GraphOverBudget { batch: i64, over: crate::budget::OverBudget },
    /// The checkpoint directory or a namespace in it cannot be listed.
    #[error("cannot list {what} {}: {error}", dir.display())]
    CheckpointsUnlisted { what: &'static str, dir: std::path::PathBuf, error: std::io::Error },
}

/// Why a generation session or one of its steps is refused.
#[derive(Debug, thiserror::Error)]
pub(crate) enum GenerationError {
    /// A stream's first frame is not the one that opens a session.
    #[error("the first frame of a Generate stream opens the session")]
    NotOpened,
    /// A second opening frame on a stream with a session.
    #[error("this stream already has a session open")]
    AlreadyOpen,
    /// A frame with nothing in it.
    #[error("an empty frame")]
    EmptyFrame,
    /// The bundle has no generation stages.
    #[error("bundle {bundle} was exported without --generation: it has no generation stages")]
    NotExported { bundle: String },
    /// The range asked for does not fit the model.
    #[error("stages {start}..{end}: {reason}")]
    Range { start: u32, end: u32, reason: String },
    /// Rows outside the bundle's batch range.
    #[error("a batch of {batch} rows: this bundle takes {min} to {max}")]
    Batch { batch: u32, min: i64, max: i64 },
    /// A cache length outside what the model has positions for.
    #[error("max_len {max_len}: the model has positions for 1 to {max_positions}")]
    MaxLen { max_len: u32, max_positions: i64 },
    /// Every place is taken.
    #[error("{max} generation sessions are open, the server's limit (`generation.max_sessions`): try again later")]
    Sessions { max: u32 },
    /// The session's caches do not fit in what the others leave of the cache budget.
    #[error(
        "the session's key/value caches take {bytes} bytes, and the cache budget of {budget} bytes (`limits.kv_cache_bytes`) has \
         {free} free: ask for fewer rows or a shorter max_len, or try again later"
    )]
    CacheBudget { bytes: u64, free: u64, budget: u64 },
    /// The peer holds its share of the places.
    #[error("this peer ({peer}) holds {max} generation sessions, its share (`generation.max_sessions_per_peer`): close one, or try again later")]
    PeerSessions { peer: String, max: u32 },
    /// The session's caches do not fit in what the peer's share of the cache budget leaves.
    #[error(
        "the session's key/value caches take {bytes} bytes, and this peer ({peer}) holds {held} of its share of {share} bytes \
         (`limits.kv_cache_bytes_per_peer`): ask for fewer rows or a shorter max_len, or close a session"
    )]
    PeerCache { peer: String, bytes: u64, held: u64, share: u64 },
    /// A step whose rows do not stand where the server's do.
    #[error("{0}")]
    Step(String),
    /// A step that would run past a row's cache.
    #[error("row {row} stands at position {at}: {tokens} more tokens do not fit its cache of {max_len} positions")]
    CacheFull { row: usize, at: i64, tokens: i64, max_len: i64 },
    /// A step whose answer would not fit in one message.
    #[error("the answer would take {bytes} bytes, above the message limit of {limit} (`limits.max_message_bytes`): send fewer tokens a step, or ask for the last token only")]
    AnswerTooLarge { bytes: u64, limit: u64 },
    /// The host sent nothing for the idle timeout: the server closed the session.
    #[error(
        "no step ran for {idle:?} (`generation.session_idle_timeout`; refused steps do not count): session {session} is closed and its caches freed"
    )]
    Idle { idle: std::time::Duration, session: String },
}

/// Several edges training one server part (`OpenSession.clients`).
#[derive(Debug, thiserror::Error)]
pub(crate) enum GroupError {
    #[error("group name {0:?}: use 1 to 64 letters, digits, '-', '_' or '.'")]
    Name(String),
    #[error("unknown mode {0:?}: sequential or splitfed")]
    Mode(String),
    #[error("a group of {edges} edges: this server trains 1 to {max} at once (`training.max_sessions`)")]
    Edges { edges: u32, max: u32 },
    #[error("edge {edge} of a group of {edges}: the places are 0 to {}", edges - 1)]
    Place { edge: u32, edges: u32 },
    #[error("group {group} trains with another {term} than this session asks: every edge of a group asks the same")]
    Differs { group: String, term: &'static str },
    #[error("edge {edge}'s place in group {group} is held by an open session")]
    EdgeTaken { group: String, edge: usize },
    #[error("waited {waited:?} (`training.client_wait_timeout`) in group {group} for edges {waiting_for:?}")]
    WaitedTooLong { group: String, waited: std::time::Duration, waiting_for: Vec<usize> },
    #[error("this session is not in a client group: EndRound is for group sessions")]
    NotInAGroup,
    #[error("a client group's session cannot resume a checkpoint (not supported yet): start the group afresh")]
    NoResume,
    #[error("a splitfed edge's samples each round (`ClientGroup.samples`, its weight in the average) must be 1 to {max}, not {samples}")]
    Samples { samples: u64, max: u64 },
    #[error("the edge's weights are not its stages' tensors: {0}")]
    Weights(String),
    #[error("the edges of this splitfed group hold no floating-point weights to average: give them stages (a split after 0)")]
    NothingToAverage,
    #[error("PHASE_AVERAGE is for the sessions of a splitfed group")]
    NotSplitFed,
    #[error("a {mode} group's round ends with {expected}")]
    RoundEndsOtherwise { mode: &'static str, expected: &'static str },
    #[error("step {step} is under way: a round ends after its edge's last step")]
    StepUnderWay { step: u64 },
}

/// A shared resource taken, or a quota full: the call may succeed later or elsewhere.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Busy {
    /// `Profile` calls run one at a time per server.
    #[error("another Profile is running: this server runs one at a time, try again")]
    Profile,
    /// A profile reached a device that is running another.
    #[error("another profile is running on this device: profiles run one at a time")]
    ProfileOnDevice,
    /// Every training session place is taken.
    #[error("{open} training sessions are open, this server's most (`training.max_sessions`): try again when one closes")]
    Sessions { open: usize },
    /// The peer holds its share of the training session places.
    #[error(
        "this peer ({peer}) holds {max} training sessions, its share (`training.max_sessions_per_peer`; a client group's \
         sessions count once): close one, or try again later"
    )]
    PeerSessions { peer: String, max: u32 },
    /// The bundle has a session and the server keeps one per bundle.
    #[error(
        "bundle {bundle} is already being trained by session {holder} (open for {open_s} s, its host last heard from {heard_s} s \
         ago; a session whose host sends nothing for {idle_timeout_s} s, `training.session_idle_timeout`, is closed): this \
         server allows one training session per bundle: try again once it has closed, or set `training.concurrent_sessions: \
         true` in server.yaml to train separate copies"
    )]
    BundleTrained { bundle: String, holder: String, open_s: u64, heard_s: u64, idle_timeout_s: u64 },
    /// A new checkpoint over the namespace's count quota.
    #[error(
        "checkpoint {name} refused: namespace {namespace} holds {held} checkpoints, the most `training.max_checkpoints` ({max}) \
         allows; save under one of their names to replace it, or ask the operator for a larger quota"
    )]
    CheckpointCount { name: String, namespace: String, held: usize, max: u32 },
    /// A checkpoint over the namespace's byte quota (`what`: `holds` or `would hold at least`).
    #[error(
        "checkpoint {name} refused: it {what} {bytes} bytes and namespace {namespace}'s other checkpoints hold {others}, above \
         `training.max_checkpoint_bytes` ({max})"
    )]
    CheckpointBytes { name: String, what: &'static str, bytes: u64, namespace: String, others: u64, max: u64 },
    /// A checkpoint over the server's byte quota for every namespace together.
    #[error(
        "checkpoint {name} refused: it {what} {bytes} bytes and the server's other checkpoints (every namespace) hold {others}, \
         above `training.max_checkpoint_bytes_total` ({max}); an operator must remove old checkpoints or raise the quota"
    )]
    CheckpointBytesTotal { name: String, what: &'static str, bytes: u64, others: u64, max: u64 },
}

/// A call that asks for what the server does not give.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BadCall {
    /// A profile at a batch size the bundle does not take.
    #[error("batch size {size} is outside the bundle's range {min}..={max}")]
    BatchSize { size: i64, min: i64, max: i64 },
    /// A profile asking for more repeats than the server allows.
    #[error("{repeats} repeats: at most {max} (`limits.max_profile_repeats`)")]
    Repeats { repeats: u32, max: u32 },
    /// An echo asking for a reply larger than one message can be.
    #[error("reply_bytes {asked} is above {cap} (the server's message limit less framing)")]
    ReplyBytes { asked: u64, cap: u64 },
    /// A host session id that is not one.
    #[error("the host session id must be 1 to {max} letters, digits, '-' or '_' (`{}` metadata)", cleave_common::protocol::HOST_SESSION_METADATA)]
    HostSession { max: usize },
}

impl From<SessionError> for RequestError {
    fn from(e: SessionError) -> Self {
        Self::Session(e)
    }
}

impl From<GroupError> for RequestError {
    fn from(e: GroupError) -> Self {
        Self::Group(e)
    }
}

impl From<Busy> for RequestError {
    fn from(e: Busy) -> Self {
        Self::Busy(e)
    }
}

impl From<BadCall> for RequestError {
    fn from(e: BadCall) -> Self {
        Self::BadCall(e)
    }
}

/// Which part of the server failed a call. UNAVAILABLE is kept for a drain (hosts resend
/// then); these are INTERNAL, so that a host ends the request with this error instead of
/// resending it to a server that cannot answer it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Internal {
    /// The thread that runs a device's stages is gone.
    #[error("the device's scheduler thread is gone")]
    SchedulerGone,
    /// A device's scheduler thread died with this request in its hands (see
    /// `on_device_failure`).
    #[error("device {device} failed ({cause}): this request was not finished")]
    DeviceFailed {
        /// The device (`cpu`, `cuda:0`).
        device: String,
        /// Why its thread died.
        cause: DeviceFailure,
    },
    /// The request was dropped before it was answered (its scheduler stopped with it queued).
    #[error("the request was dropped before it was answered")]
    Unanswered,
    /// A training session's thread is gone.
    #[error("the training session's thread is gone")]
    SessionGone,
    /// A task on the blocking pool was cancelled (the runtime is stopping).
    #[error("{0} was cancelled")]
    Cancelled(&'static str),
    /// A training session's thread could not be started.
    #[error("cannot start the session thread: {0}")]
    SessionThread(Shared<std::io::Error>),
    /// A training session answered a call with another call's kind of answer.
    #[error("the training session answered a {0} call with another kind of answer")]
    WrongAnswer(&'static str),
    /// libtorch refused what the server asked of it.
    #[error("libtorch: {0}")]
    Torch(String),
}

impl From<GenerationError> for RequestError {
    fn from(e: GenerationError) -> Self {
        Self::Generation(e)
    }
}

impl From<Internal> for RequestError {
    fn from(e: Internal) -> Self {
        Self::Internal(e)
    }
}

impl From<WireError> for RequestError {
    fn from(e: WireError) -> Self {
        Self::Wire(e)
    }
}

impl From<BundleError> for RequestError {
    fn from(e: BundleError) -> Self {
        Self::Bundle(e)
    }
}

impl From<TrainError> for RequestError {
    fn from(e: TrainError) -> Self {
        Self::Training(e)
    }
}

/// The one place that maps errors to gRPC status codes.
pub(crate) fn status_code(err: &RequestError) -> Code {
    use CodecError as C;
    match err {
        RequestError::Wire(WireError::Codec(C::PayloadTooLarge { .. })) | RequestError::AnswerTooLarge { .. } => Code::ResourceExhausted,
        // The payload is not authentic: no key, wrong key, altered, replayed, or unsealed
        // where sealing is required.
        RequestError::Wire(WireError::Codec(
            C::NotSealed | C::NoKeys { .. } | C::UnknownKeyId { .. } | C::WrongKey { .. } | C::HeaderTampered | C::DataTampered | C::Replayed { .. },
        )) => Code::Unauthenticated,
        RequestError::Wire(WireError::Codec(C::CodecRefused { .. } | C::CodecNotAccepted { .. })) => Code::FailedPrecondition,
        // Our own misuse of a payload checked as sound: a bug here, not the peer's.
        RequestError::Wire(WireError::Codec(C::Misused(_))) => Code::Internal,
        RequestError::Wire(_) | RequestError::SplitOutOfRange { .. } | RequestError::BadCall(_) => Code::InvalidArgument,
        RequestError::Encode(_) | RequestError::Profile(_) | RequestError::Batching(_) => Code::Internal,
        RequestError::Bundle(BundleError::BoundaryMismatch { .. } | BundleError::BatchOutOfRange { .. } | BundleError::GenerationStep { .. }) => {
            Code::InvalidArgument
        }
        RequestError::Bundle(_) => Code::Internal,
        RequestError::Internal(_) => Code::Internal,
        RequestError::Training(e) => match e {
            TrainError::Bundle(BundleError::BoundaryMismatch { .. } | BundleError::BatchOutOfRange { .. } | BundleError::InvalidRange { .. })
            | TrainError::Step(_)
            | TrainError::Setup(_)
            | TrainError::Loss(_)
            | TrainError::Gradients(_)
            | TrainError::Optimizer(_)
            | TrainError::Schedule(_) => Code::InvalidArgument,
            // The model diverged: nothing in the call is malformed, the session's state is.
            TrainError::NormNotFinite(_) => Code::FailedPrecondition,
            TrainError::NotTrainable(_) | TrainError::Checkpoint { .. } | TrainError::State { .. } | TrainError::NotCovered { .. } => {
                Code::FailedPrecondition
            }
            TrainError::Bundle(_) | TrainError::Torch { .. } => Code::Internal,
        },
        RequestError::Session(SessionError::GraphOverBudget { .. }) => Code::ResourceExhausted,
        RequestError::Session(_) | RequestError::AlreadyTraining { .. } | RequestError::UnknownModel { .. } => Code::FailedPrecondition,
        RequestError::Group(e) => match e {
            GroupError::Name(_)
            | GroupError::Mode(_)
            | GroupError::Edges { .. }
            | GroupError::Place { .. }
            | GroupError::Samples { .. }
            | GroupError::Weights(_) => Code::InvalidArgument,
            GroupError::Differs { .. }
            | GroupError::NotInAGroup
            | GroupError::NoResume
            | GroupError::NothingToAverage
            | GroupError::RoundEndsOtherwise { .. }
            | GroupError::NotSplitFed
            | GroupError::StepUnderWay { .. } => Code::FailedPrecondition,
            GroupError::EdgeTaken { .. } => Code::AlreadyExists,
            GroupError::WaitedTooLong { .. } => Code::DeadlineExceeded,
        },
        RequestError::Generation(e) => match e {
            GenerationError::NotOpened | GenerationError::AlreadyOpen | GenerationError::EmptyFrame => Code::FailedPrecondition,
            GenerationError::NotExported { .. } => Code::FailedPrecondition,
            GenerationError::Range { .. } | GenerationError::Batch { .. } | GenerationError::MaxLen { .. } => Code::InvalidArgument,
            GenerationError::Step(_) | GenerationError::AnswerTooLarge { .. } => Code::InvalidArgument,
            GenerationError::Sessions { .. }
            | GenerationError::CacheBudget { .. }
            | GenerationError::PeerSessions { .. }
            | GenerationError::PeerCache { .. } => Code::ResourceExhausted,
            GenerationError::CacheFull { .. } => Code::OutOfRange,
            GenerationError::Idle { .. } => Code::DeadlineExceeded,
        },
        RequestError::Unauthenticated(_) => Code::Unauthenticated,
        RequestError::OverBudget(_) | RequestError::Busy(_) | RequestError::ConnectionLimit { .. } => Code::ResourceExhausted,
        RequestError::ConnectionClosing => Code::Cancelled,
        RequestError::Stalled(_) => Code::DeadlineExceeded,
        RequestError::Inbound { code, .. } => *code,
        RequestError::Draining => Code::Unavailable,
        RequestError::Panicked(_) => Code::Internal,
    }
}

impl From<RequestError> for Status {
    fn from(err: RequestError) -> Self {
        Status::new(status_code(&err), err.to_string())
    }
}

/// The error frame a stream answers a failed request or call with.
pub(crate) fn error_frame(err: &RequestError) -> cleave_common::pb::Error {
    cleave_common::pb::Error { code: status_code(err) as i32, message: err.to_string() }
}

/// The data behind `m`, even when a thread panicked holding it: every caught panic is
/// answered as its call's INTERNAL, and the data it guards stays consistent between calls.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What a panic said, as text.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    let text = panic.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| panic.downcast_ref::<String>().cloned());
    text.unwrap_or_else(|| "(no message)".into())
}

/// Runs `f`, turning a panic into [`RequestError::Panicked`] naming `what` panicked.
pub(crate) fn catch_panic<T>(what: &str, f: impl FnOnce() -> Result<T, RequestError>) -> Result<T, RequestError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let message = panic_message(panic.as_ref());
        tracing::error!(%what, panic = %message, "caught a panic");
        Err(RequestError::Panicked(format!("{what} panicked: {message}")))
    })
}

/// Why a device's scheduler thread died, or why the device stays down.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceFailure {
    /// A panic outside any request: a bug, or a device error no request caught.
    #[error("its scheduler panicked: {0}")]
    Panicked(String),
    /// The operating system would not start its thread.
    #[error("its scheduler thread could not start: {0}")]
    NoThread(Shared<std::io::Error>),
    /// Its models failed their warm-up: they cannot run there, reloaded or not.
    #[error("warming its models failed: {0}")]
    NotWarmed(Shared<BundleError>),
    /// The thread died and the policy is not to restart it.
    #[error("{0} (`on_device_failure: exit`)")]
    NotRestarted(Box<DeviceFailure>),
    /// The thread died and its models could not be loaded again.
    #[error("{cause}; its models could not be reloaded: {error}")]
    NotReloaded {
        /// Why the thread died.
        cause: Box<DeviceFailure>,
        /// Why reloading failed.
        error: Shared<ServerError>,
    },
    /// The thread died and reloading its models panicked.
    #[error("{cause}; reloading its models panicked: {message}")]
    ReloadPanicked {
        /// Why the thread died.
        cause: Box<DeviceFailure>,
        /// The panic's message.
        message: String,
    },
}

/// Why the server could not start, or stopped serving.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// `server.yaml` cannot be used.
    #[error(transparent)]
    Config(#[from] cleave_common::config::ConfigError),
    /// The bundle cannot be opened, loaded or checked.
    #[error(transparent)]
    Bundle(#[from] BundleError),
    /// The listening address cannot be bound or read.
    #[error("cannot listen on {addr}: {error}")]
    Listen {
        /// The address.
        addr: String,
        /// Why.
        error: std::io::Error,
    },
    /// The TLS identity cannot be used.
    #[error("TLS: {}", cleave_common::error::with_causes(.0))]
    Tls(tonic::transport::Error),
    /// The gRPC server failed.
    #[error("serving: {}", cleave_common::error::with_causes(.0))]
    Serve(tonic::transport::Error),
    /// Loading the models on the blocking pool panicked or was cancelled.
    #[error("loading the bundle: {0}")]
    Loading(tokio::task::JoinError),
    /// A limit that no server can enforce.
    #[error("limits: `{key}` {0}", key = .0.key)]
    Limits(cleave_common::config::LimitError),
    /// Two entries of `models:` are the same bundle (hosts select a model by its id).
    #[error("models: {first} and {second} are both bundle {id}: each model is served once")]
    DuplicateModel {
        /// The bundle id.
        id: String,
        /// The first entry's bundle path.
        first: String,
        /// The second's.
        second: String,
    },
    /// A device's scheduler thread died and the server does not go on without it
    /// (`on_device_failure: exit`, or its models could not be reloaded).
    #[error("device {device} failed: {cause}; the server exits for its supervisor to start it afresh")]
    DeviceFailed {
        /// The device (`cpu`, `cuda:0`).
        device: String,
        /// Why its thread died, and why it was not restarted.
        cause: DeviceFailure,
    },
    /// A device's models failed their warm-up at start.
    #[error("device {device}: {cause}")]
    NotWarmed {
        /// The device.
        device: String,
        /// The warm-up's error.
        cause: DeviceFailure,
    },
    /// A model's `warm_batches` lists a batch size its bundle does not take.
    #[error("`warm_batches`: {bundle} takes batches of {min} to {max}, not {batch}")]
    WarmBatch {
        /// The model's bundle directory.
        bundle: String,
        /// The size listed.
        batch: i64,
        /// The bundle's smallest batch.
        min: i64,
        /// Its largest.
        max: i64,
    },
    /// The metrics endpoint cannot be served.
    #[error("metrics on {addr}: {error}")]
    Metrics {
        /// The address.
        addr: String,
        /// Why.
        error: std::io::Error,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn our_own_failures_are_internal_and_only_a_drain_is_unavailable() {
        for internal in [
            Internal::SchedulerGone,
            Internal::Unanswered,
            Internal::SessionGone,
            Internal::Cancelled("encoding an answer"),
            Internal::WrongAnswer("Save"),
            Internal::DeviceFailed { device: "cuda:0".into(), cause: DeviceFailure::Panicked("x".into()) },
        ] {
            let err = RequestError::from(internal.clone());
            assert_eq!(status_code(&err), Code::Internal, "{err}");
            assert_eq!(err.to_string(), format!("internal error: {internal}"));
        }
        assert_eq!(RequestError::from(Internal::SchedulerGone).to_string(), "internal error: the device's scheduler thread is gone");
        // A payload this side misused is our bug; one the peer malformed is its.
        let misused = CodecError::Misused(cleave_common::wire::Misuse::Buffers { given: vec![1], declared: vec![2] });
        assert_eq!(status_code(&RequestError::Wire(WireError::Codec(misused))), Code::Internal);
        let malformed = CodecError::WireLength { tensors: 1, tagged: false, declared: 2 };
        assert_eq!(status_code(&RequestError::Wire(WireError::Codec(malformed))), Code::InvalidArgument);
        assert_eq!(status_code(&RequestError::Draining), Code::Unavailable);
    }

    #[test]
    fn a_panic_is_that_call_s_internal_error() {
        let caught = catch_panic("decoding a payload", || -> Result<(), RequestError> { panic!("index out of bounds") }).unwrap_err();
        assert_eq!(status_code(&caught), Code::Internal);
        assert_eq!(caught.to_string(), "internal error: decoding a payload panicked: index out of bounds");
        let formatted = catch_panic("encoding", || -> Result<(), RequestError> { panic!("{} of {}", 3, 4) }).unwrap_err();
        assert!(formatted.to_string().ends_with("encoding panicked: 3 of 4"));
        assert_eq!(catch_panic("nothing", || Ok(5)).unwrap(), 5);
    }
}
