//! The host library's error type: one variant per kind of failure, each naming what failed
//! and carrying what a user needs to fix it. A variant's message includes its cause and no
//! variant reports that cause again as its `source`, so a printed chain names each cause once.

use std::path::PathBuf;
use std::sync::Arc;

use cleave_client::{AnswerError, Breach, LinkError, Refusal};
use cleave_common::config::ConfigError;
use cleave_common::training::TrainError;
use cleave_common::wire::{Codec, CodecError, WireError};
use cleave_common::BundleError;

use crate::loopback::LoopbackError;
use crate::planner::ProfileError;
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
    /// The inputs cannot feed the bundle.
    #[error(transparent)]
    Inputs(#[from] InputError),
    /// A load run's options or configs cannot work together.
    #[error(transparent)]
    Load(#[from] LoadSetupError),
    /// The server started in this process (`--loopback`) failed.
    #[error("the loopback server: {0}")]
    Loopback(LoopbackError),
    /// The link to the server: it cannot be reached, refuses, or a call failed.
    #[error(transparent)]
    Link(#[from] LinkError),
    /// `host plan --fleet-profile` cannot write its profiles.
    #[error("--fleet-profile: {0}")]
    FleetProfile(String),
    /// A command given a config of the other kind (inference without `input`, training
    /// without `train`).
    #[error("the config has no `{key}`: {command} needs one")]
    NotThatKindOfConfig {
        /// The key the config lacks.
        key: &'static str,
        /// The command.
        command: &'static str,
    },
    /// A stream plan under which no request could be sent.
    #[error("no request could be sent: {why}")]
    NoRequestCanBeSent {
        /// Why.
        why: &'static str,
    },
    /// A generation that cannot run as asked (its prompt, its length, its sampling).
    #[error("generate: {0}")]
    Generation(String),
    /// The output directory cannot be written or continued.
    #[error(transparent)]
    Output(#[from] OutputError),
    /// Training cannot start or report.
    #[error(transparent)]
    TrainingSetup(#[from] TrainingSetupError),
    /// A measurement of the cuts (`host plan`, `split: auto`) came back without what it needs.
    #[error(transparent)]
    Measure(#[from] MeasureError),
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
    Torch(Box<tch::TchError>),
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
        LinkError::rpc(call, status).into()
    }

    /// Whether trying again cannot change the outcome: the server is unreachable for good,
    /// refuses this host, or refused its credentials or request.
    pub fn is_lasting(&self) -> bool {
        match self {
            Self::Inputs(_) | Self::Load(_) | Self::Output(_) | Self::TrainingSetup(_) | Self::Measure(_) => true,
            Self::NotThatKindOfConfig { .. } | Self::NoRequestCanBeSent { .. } => true,
            Self::Link(error) => error.is_lasting(),
            Self::During { error, .. } => error.is_lasting(),
            _ => false,
        }
    }

    /// This error, as what failed while doing `context`.
    pub fn during(self, context: impl Into<String>) -> Self {
        Self::During { context: context.into(), error: Box::new(self) }
    }
}

impl From<Breach> for HostError {
    fn from(e: Breach) -> Self {
        Self::Link(e.into())
    }
}

impl From<Refusal> for HostError {
    fn from(e: Refusal) -> Self {
        Self::Link(e.into())
    }
}

impl From<LoopbackError> for HostError {
    fn from(e: LoopbackError) -> Self {
        Self::Loopback(e)
    }
}

impl From<tch::TchError> for HostError {
    fn from(e: tch::TchError) -> Self {
        Self::Torch(Box::new(e))
    }
}

/// Why a request has no result.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RequestFailure {
    /// The server answered it with an error status, or its result cannot be opened or decoded.
    #[error(transparent)]
    Server(#[from] AnswerError),
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
            Self::Server(AnswerError::Refused { code, .. }) => Some(*code),
            _ => None,
        }
    }

    /// Whether both are the same error answer from the server.
    pub fn same_refusal(&self, other: &Self) -> bool {
        use AnswerError::Refused;
        matches!((self, other), (Self::Server(Refused { code: a, message: m }), Self::Server(Refused { code: b, message: n })) if a == b && m == n)
    }
}

/// What profiling was doing with a cut's boundary when it failed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ProfileStep {
    /// Encoding it with the run's codec.
    Encoding(Codec),
    /// Decoding what was encoded.
    Decoding,
    /// Timing `codec: auto`'s candidates on it.
    AutoCandidates,
}

impl std::fmt::Display for ProfileStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Encoding(codec) => write!(f, "encoding with {codec}"),
            Self::Decoding => f.write_str("decoding"),
            Self::AutoCandidates => f.write_str("measuring codec: auto's candidates"),
        }
    }
}

/// Why measuring the cuts (`host plan`, `split: auto`'s profile) gave nothing to plan from.
#[derive(Debug, thiserror::Error)]
pub enum MeasureError {
    /// The edge's boundaries could not be profiled.
    #[error("profiling the boundaries: cut {cut}: {step}: {error}")]
    Boundaries {
        /// The cut.
        cut: usize,
        /// What was being done with its boundary.
        step: ProfileStep,
        /// What failed.
        error: Box<WireError>,
    },
    /// Requests of `--measure` failed.
    #[error("measuring the cuts: {failed} of the requests failed, the first: {first}")]
    RequestsFailed {
        /// How many.
        failed: usize,
        /// The first failure.
        first: String,
    },
    /// No request was measured at a cut.
    #[error("no request measured at cut {cut}")]
    NothingAtCut {
        /// The cut.
        cut: usize,
    },
}

/// Why a run's inputs cannot feed its bundle.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    /// A bundle input is not a tensor (a tuple or a dict), which inputs cannot fill.
    #[error("input {name} is {kind}, only tensor inputs are supported by {reader}")]
    NotATensor {
        /// The input's name.
        name: String,
        /// What it is instead.
        kind: String,
        /// What reads the inputs: a run or training.
        reader: &'static str,
    },
    /// Images feed a bundle of one input only.
    #[error("image inputs need a bundle with one input; this one has {inputs}")]
    ImagesNeedOneInput {
        /// The bundle's inputs.
        inputs: usize,
    },
    /// Images feed a float32 `[B, 1 or 3, H, W]` input only.
    #[error("image inputs need a float32 [B, 1 or 3, H, W] input; this bundle takes {spec}")]
    NotAnImageInput {
        /// The bundle's input.
        spec: String,
    },
    /// An image directory without images.
    #[error("image directory {} has no .png, .jpg or .jpeg files", dir.display())]
    NoImages {
        /// The directory.
        dir: PathBuf,
    },
    /// A `.npy` file for a bundle of several inputs.
    #[error("a .npy file holds one tensor; this bundle has {inputs} inputs (use .npz or .safetensors)")]
    NpyHoldsOneTensor {
        /// The bundle's inputs.
        inputs: usize,
    },
    /// An input file of a kind no reader knows.
    #[error("input file {}: expected .safetensors, .npz or .npy", path.display())]
    UnknownFileKind {
        /// The file.
        path: PathBuf,
    },
    /// An input file without a tensor the bundle needs.
    #[error("input file {} has no tensor {name:?} (it has {held:?})", path.display())]
    MissingTensor {
        /// The file.
        path: PathBuf,
        /// The input it lacks.
        name: String,
        /// The tensors it holds.
        held: Vec<String>,
    },
    /// An input file's tensor of another dtype or shape than the bundle's input.
    #[error("input file {}: {name} is {found}, the bundle expects {expected}", path.display())]
    WrongTensor {
        /// The file.
        path: PathBuf,
        /// The input.
        name: String,
        /// The tensor's kind and shape.
        found: String,
        /// The bundle's spec.
        expected: String,
    },
    /// An input file whose tensors have different numbers of rows, or none.
    #[error("input file {}: tensors must have the same, non-zero number of rows", path.display())]
    UnevenRows {
        /// The file.
        path: PathBuf,
    },
}

/// Why a load run cannot start: options and configs that cannot work together, refused
/// before anything is sent.
#[derive(Debug, thiserror::Error)]
pub enum LoadSetupError {
    /// An edge's server did not take requests in time.
    #[error("the server did not take requests within {waited:?} (`connect_timeout`): its model is not SERVING, or its link gave up")]
    NotServing {
        /// How long the edge waited.
        waited: std::time::Duration,
    },
    /// No config given.
    #[error("a load run needs at least one --config")]
    NoConfig,
    /// A training config.
    #[error("{}: a training config (`train:`) cannot be load-tested: give an inference config", bundle.display())]
    TrainingConfig {
        /// The config's bundle.
        bundle: PathBuf,
    },
    /// A count or a duration of zero.
    #[error("{option} must be {must_be}")]
    Zero {
        /// The option.
        option: &'static str,
        /// `at least 1` or `positive`.
        must_be: &'static str,
    },
    /// An open loop's rate that cannot be drawn from.
    #[error("--rate: {0}")]
    Rate(RateError),
    /// A `--ratio` with another number of weights than configs.
    #[error("--ratio {ratio} has {weights} weights for {configs} configs: give one weight per --config")]
    RatioWeights {
        /// The ratio given.
        ratio: String,
        /// Its weights.
        weights: usize,
        /// The configs.
        configs: usize,
    },
    /// Too few edges to give every config one.
    #[error("{edges} edges shared {shared} leave config {config} ({}) without an edge: give more --edges", bundle.display())]
    ConfigWithoutEdge {
        /// Edges in all.
        edges: usize,
        /// How they were shared (`equally`, `by --ratio 3:1`).
        shared: String,
        /// The config left without one, counted from 1.
        config: usize,
        /// Its bundle.
        bundle: PathBuf,
    },
    /// `split: auto` without `--splits`.
    #[error("{model}: its config has `split: auto`, which moves the cut while running, and a load run needs fixed cuts: set a cut in its `split` or give --splits")]
    AutoSplit {
        /// The model's source.
        model: String,
    },
    /// A cut that leaves the server nothing to run.
    #[error("{model} has {stages} stages: cut {cut} leaves the server nothing to run (a load run needs cuts from 0 to {})", stages - 1)]
    CutPastTheEnd {
        /// The model's source.
        model: String,
        /// Its stage count.
        stages: usize,
        /// The cut.
        cut: usize,
    },
}

/// Why a command cannot write into its output directory, or continue what is there.
#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    /// The directory holds an earlier run, and neither `--force` nor a way to continue it was given.
    #[error(
        "the output directory {} holds an earlier {kind} ({}): give --force to replace it, {}another `output`",
        dir.display(),
        found.join(", "),
        continue_with.as_ref().map(|c| format!("{c}, ")).unwrap_or_default()
    )]
    EarlierRun {
        /// The directory.
        dir: PathBuf,
        /// What kind of run it holds (`inference run`, `training run`, `load run`).
        kind: String,
        /// The earlier run's files found there.
        found: Vec<String>,
        /// How the command continues such a run, when it can.
        continue_with: Option<String>,
    },
    /// `--resume` on a training run.
    #[error(
        "--resume continues an inference run; a training run continues from a checkpoint: set `train.resume: step-N` (one of <output>/checkpoints)"
    )]
    ResumeIsForInference,
    /// `--force` with `train.resume`.
    #[error("--force would remove the checkpoint `train.resume` continues from: give one or the other")]
    ForceRemovesTheCheckpoint,
    /// An earlier inference run's files that cannot be continued.
    #[error("cannot resume from {}: {why}", file.display())]
    CannotResume {
        /// The file.
        file: PathBuf,
        /// What is wrong with it.
        why: String,
    },
}

/// Why a training run cannot start or cannot report: a config, bundle, datasets or
/// checkpoints that do not fit together.
#[derive(Debug, thiserror::Error)]
pub enum TrainingSetupError {
    /// Split or U-shaped training that leaves the server no stage.
    #[error("the server's stages [{split}, {tail}) are empty: the split must come before the {before}")]
    NothingForTheServer {
        /// The split.
        split: usize,
        /// Where the host's tail starts (the stage count without one).
        tail: usize,
        /// `output` or `tail`.
        before: &'static str,
    },
    /// `train.write_bundle` with the server's checkpoint on another machine.
    #[error("`train.write_bundle` needs the server's checkpoint on this machine: use --loopback, or copy it here and run `host export-trained`")]
    WriteBundleNeedsLoopback,
    /// A client group of several edges with a server of its own in this process.
    #[error("a client group of {edges} edges trains on one server: --loopback starts one for this edge alone; name the group's server in `server:`")]
    GroupOverLoopback {
        /// The group's edges.
        edges: u32,
    },
    /// A `splitfed` edge that trains no stage: it has no weights to average.
    #[error("a splitfed edge averages its weights with the others': give it stages (a split after 0, or a tail)")]
    NothingToAverage,
    /// A batch size the bundle does not take.
    #[error("train.{key} {size} is above the bundle's largest batch {max}")]
    BatchAboveTheBundle {
        /// `batch_size` or `eval_batch_size`.
        key: &'static str,
        /// The size asked for.
        size: i64,
        /// The bundle's largest batch.
        max: i64,
    },
    /// A dataset whose last batch is below the bundle's smallest.
    #[error("the {set} set's last batch would have {rows} rows, below the bundle's smallest batch {min}")]
    LastBatchTooSmall {
        /// `training` or `test`.
        set: &'static str,
        /// Rows of that batch.
        rows: i64,
        /// The bundle's smallest batch.
        min: i64,
    },
    /// Host and server checkpoints of different steps.
    #[error("the server resumed at step {server}, this host at step {host}: the checkpoints are of different moments")]
    ResumedApart {
        /// The server's step.
        server: u64,
        /// The host's.
        host: u64,
    },
    /// A report without epochs.
    #[error("cannot write the training report into {}: the run has no epochs", dir.display())]
    NoEpochs {
        /// Where it would have gone.
        dir: PathBuf,
    },
    /// A run that had nothing left to train.
    #[error("no step was trained: the run was already at step {step} (max_steps) or past its last epoch")]
    NothingTrained {
        /// The step it was at.
        step: u64,
    },
}

/// An open loop's rate that Poisson arrivals cannot be drawn at.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
#[error("a rate of {rate} requests/s: expected a positive, finite number")]
pub struct RateError {
    /// The rate, requests/s.
    pub rate: f64,
}
