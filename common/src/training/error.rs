//! Why a training step, or setting one up, failed.

use tch::Kind;

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
    /// A training call out of the step's order, or without what the session needs.
    #[error(transparent)]
    Step(#[from] StepError),
    /// A session that cannot be set up as asked (its stages, loss or checkpoint).
    #[error(transparent)]
    Setup(#[from] SetupError),
    /// An optimizer that PyTorch would refuse.
    #[error("optimizer: {0}")]
    Optimizer(#[from] OptimizerError),
    /// A learning-rate schedule that PyTorch would refuse.
    #[error("schedule: {0}")]
    Schedule(#[from] ScheduleError),
    /// Gradients whose global norm is not finite, which clipping cannot scale.
    #[error("the gradients' global norm is {0} at this step: clipping cannot scale it (lower the learning rate, or check the data)")]
    NormNotFinite(f32),
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
    /// A checkpoint's state does not fit the stages or optimizer it is loaded into.
    #[error("checkpoint {path}: {error}")]
    State {
        /// The file.
        path: std::path::PathBuf,
        /// What does not fit.
        error: StateError,
    },
    /// Checkpoints exported into a bundle that do not hold the whole model's state.
    #[error("checkpoint {path}: the checkpoints do not cover the model: {error}")]
    NotCovered {
        /// The first checkpoint.
        path: std::path::PathBuf,
        /// What is not covered.
        error: StateError,
    },
    /// A checkpoint cannot be written or read, or is of other stages.
    #[error("checkpoint {path}: {message}")]
    Checkpoint {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// A training call out of the step's order, or without what its session needs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StepError {
    /// A forward while the step before still waits for its gradient.
    #[error("step {step} is still waiting for its gradient (PHASE_BACKWARD); it is dropped, and this step refused")]
    StillWaiting {
        /// The step waiting.
        step: u64,
    },
    /// Targets sent to a part that does not compute the loss.
    #[error("this session ends before the loss (U-shaped): targets stay on the edge")]
    TargetsPastTheLoss,
    /// A step without its targets to a part that computes the loss.
    #[error("this session computes the loss: each step carries the targets as value {value}")]
    NoTargets {
        /// The value that carries them.
        value: &'static str,
    },
    /// A forward while the step before waits for the host's gradient norm.
    #[error("step {step}'s update is waiting for the host's gradient norm (ClipStep); this step is refused")]
    WaitingForClip {
        /// The step waiting.
        step: u64,
    },
    /// A gradient norm sent to a session that does not clip.
    #[error("this session does not clip gradients (OpenSession.clip_grad_norm is 0): ClipStep has no use")]
    NotClipping,
    /// A gradient norm with no step waiting for it.
    #[error("a gradient norm arrived with no step waiting to be clipped (a step's gradient answer comes first)")]
    NothingToClip,
    /// A micro-batch index at or past its step's count.
    #[error("micro-batch {index} of {count}: the index must be below the count")]
    MicrobatchOutOfRange {
        /// Its index.
        index: u32,
        /// The step's count.
        count: u32,
    },
    /// A micro-batch out of its step's order.
    #[error("micro-batch {got} of {count} arrived where micro-batch {expected} of {expected_count} was due (each step sends 0, 1, ... in order)")]
    MicrobatchOrder {
        /// The index due.
        expected: u32,
        /// The count of the step under way (that of the call when none is).
        expected_count: u32,
        /// The index that came.
        got: u32,
        /// Its count.
        count: u32,
    },
    /// A call resent whose answer the session no longer keeps.
    #[error("call {id} was answered before and its answer is no longer kept (past training.max_kept_answer_bytes): it is not run again")]
    AnswerNotKept {
        /// The call's id.
        id: u64,
    },
    /// A gradient with no forward waiting for it.
    #[error("a gradient arrived without a pending forward (PHASE_FORWARD comes first)")]
    NoPendingForward,
}

/// A training session that cannot be set up as it is asked for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SetupError {
    /// Stages that are not a non-empty range of the model's.
    #[error("the server's stages [{start}, {end}) must be a non-empty range within [0, {stages}]")]
    StageRange {
        /// First stage.
        start: usize,
        /// End of the range.
        end: usize,
        /// The model's stages.
        stages: usize,
    },
    /// A cut the model cannot be split at.
    #[error("cut {cut} ({name}) cannot be split at: {reason}")]
    Unsplittable {
        /// The cut.
        cut: usize,
        /// Its name.
        name: String,
        /// Why, from the manifest.
        reason: String,
    },
    /// No optimizer in the session's request.
    #[error("no optimizer given")]
    NoOptimizer,
    /// The part that computes the loss was not told which.
    #[error("the server holds the last stage, so it computes the loss: name it (cross-entropy, mse)")]
    LossNotNamed,
    /// A loss this build does not know.
    #[error("{0}")]
    UnknownLoss(String),
    /// A loss named to a part that ends before the model's last stage.
    #[error("loss {name:?} given, but the server's part ends at cut {end} < {stages}: the edge computes the loss")]
    LossOnTheEdge {
        /// The loss named.
        name: String,
        /// The part's end.
        end: usize,
        /// The model's stages.
        stages: usize,
    },
    /// More calls in flight than the server keeps answers for.
    #[error("pipeline depth {asked} (train.microbatches) is over this server's training.max_pipeline_depth ({max})")]
    PipelineDepth {
        /// What the host asked for.
        asked: u32,
        /// The server's limit.
        max: u32,
    },
    /// A checkpoint name that is not a plain file name.
    #[error("checkpoint name {0:?}: use letters, digits, '-', '_' and '.', not starting with '.'")]
    CheckpointName(String),
    /// A checkpoint namespace that is not a plain directory name.
    #[error("checkpoint namespace {0:?}: use 1 to 64 letters, digits, '-' and '_'")]
    CheckpointNamespace(String),
    /// A checkpoint to resume from not named `NAMESPACE/NAME`.
    #[error("resume {0:?}: name a checkpoint as NAMESPACE/NAME, with the namespace the session that saved it was given (SessionOpened.namespace)")]
    ResumeForm(String),
}

/// An optimizer's hyper-parameter that PyTorch would refuse, or a kind it does not have.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OptimizerError {
    /// Not sgd, adam or adamw.
    #[error("optimizer {0:?} is not one of sgd, adam, adamw")]
    UnknownKind(String),
    /// A learning rate that is not a finite number above 0.
    #[error("lr must be a finite number > 0, got {0}")]
    Lr(f64),
    /// A field that must be a finite number, 0 or more.
    #[error("{field} must be a finite number >= 0, got {value}")]
    Negative {
        /// The field.
        field: &'static str,
        /// Its value.
        value: f64,
    },
    /// Nesterov momentum without momentum, or with dampening.
    #[error("nesterov needs momentum > 0 and dampening 0")]
    Nesterov,
    /// A beta outside [0, 1).
    #[error("betas[{index}] must be in [0, 1), got {value}")]
    Beta {
        /// Which beta.
        index: usize,
        /// Its value.
        value: f64,
    },
}

/// A learning-rate schedule's value that PyTorch would refuse.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ScheduleError {
    /// A count of steps that must be at least 1.
    #[error("{field} must be at least 1")]
    Zero {
        /// The field.
        field: &'static str,
    },
    /// A warm-up's start factor outside (0, 1].
    #[error("warmup.start_factor must be in (0, 1], got {0}")]
    StartFactor(f64),
    /// A value that must be a finite number above 0 (`min_lr`: 0 or more).
    #[error("{field} must be a finite number above 0 (min_lr: 0 or more), got {value}")]
    NotPositive {
        /// The field.
        field: &'static str,
        /// Its value.
        value: f64,
    },
    /// A decay this build does not know.
    #[error("decay {0:?} is not one of constant, step, cosine")]
    UnknownDecay(String),
    /// A clipping norm that is not a finite number above 0.
    #[error("clip_grad_norm must be a finite number above 0, got {0}")]
    ClipNorm(f64),
    /// A clipping coefficient outside [0, 1].
    #[error("a clipping coefficient must be in [0, 1], got {0}")]
    Coefficient(f32),
}

/// Why saved training state does not fit the stages or the optimizer it is loaded into.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    /// A parameter or buffer the stages hold is not in the state.
    #[error("{key} is missing")]
    Missing {
        /// Its key (`param.NAME`, `buffer.NAME`).
        key: String,
    },
    /// A tensor of another shape or dtype than the one it is loaded into.
    #[error("{key} is {found_kind:?} {found_shape:?}; this side holds {kind:?} {shape:?}")]
    Mismatch {
        /// Its key.
        key: String,
        /// The saved tensor's dtype.
        found_kind: Kind,
        /// The saved tensor's shape.
        found_shape: Vec<i64>,
        /// The dtype here.
        kind: Kind,
        /// The shape here.
        shape: Vec<i64>,
    },
    /// libtorch refused the copy.
    #[error("{key}: {message}")]
    Copy {
        /// Its key.
        key: String,
        /// libtorch's message.
        message: String,
    },
    /// An optimizer step count below 0.
    #[error("{key} is negative")]
    NegativeStep {
        /// Its key.
        key: String,
    },
    /// Adam's state for a parameter with some of its three tensors.
    #[error("optim.{param}: step, exp_avg and exp_avg_sq must all be present")]
    Incomplete {
        /// The parameter.
        param: String,
    },
}

impl TrainError {
    pub(crate) fn torch(step: &'static str, err: tch::TchError) -> Self {
        let text = err.to_string();
        let message = text.lines().find(|l| !l.trim().is_empty()).unwrap_or(&text).trim().to_string();
        Self::Torch { step, message }
    }
}
