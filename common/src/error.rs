//! Errors of the bundle runtime. Each variant names the step that failed and carries what a
//! user needs to fix it (the file, the expected and the actual value).

use std::path::PathBuf;
use std::sync::Arc;

use crate::spec::{DType, ShapeMismatch};

/// Result alias for the bundle runtime.
pub type Result<T, E = BundleError> = std::result::Result<T, E>;

/// An error carried inside an error that must stay `Clone` and comparable (one sent to
/// several waiters, or asserted on in tests): shared, and compared by what it says, since
/// errors such as [`BundleError`] hold I/O errors that do not compare.
#[derive(Debug)]
pub struct Shared<E>(pub Arc<E>);

impl<E> Shared<E> {
    /// `error`, shared.
    pub fn new(error: E) -> Self {
        Self(Arc::new(error))
    }
}

impl<E> Clone for Shared<E> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<E: std::fmt::Display> std::fmt::Display for Shared<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl<E: std::fmt::Display> PartialEq for Shared<E> {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0.to_string() == other.0.to_string()
    }
}

impl<E: std::fmt::Display> Eq for Shared<E> {}

/// Everything that can go wrong opening, loading or running a bundle.
#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    /// The bundle directory does not exist.
    #[error("bundle {dir} does not exist: export one with `python -m cleave_export` (see README.md)")]
    NotFound {
        /// The directory.
        dir: PathBuf,
    },
    /// A file of the bundle could not be read.
    #[error("cannot read {path}: {error}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        error: std::io::Error,
    },
    /// `manifest.json` is not valid JSON or does not describe a bundle.
    #[error("{path} is not a valid cleave manifest: {message}")]
    Manifest {
        /// The manifest file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// The manifest is of another format or version than this build reads.
    #[error("{path} is {found}; this build reads cleave-bundle format version {supported} (re-export the model)")]
    UnsupportedFormat {
        /// The manifest file.
        path: PathBuf,
        /// Format and version found.
        found: String,
        /// The version this build reads.
        supported: u32,
    },
    /// A file listed in the manifest is not in the bundle directory.
    #[error("bundle file {file} is missing from {dir}")]
    MissingFile {
        /// The bundle directory.
        dir: PathBuf,
        /// The missing file.
        file: String,
    },
    /// A file's content does not match the hash recorded at export.
    #[error("bundle file {file} is corrupted or was replaced: its sha256 is {actual}, the manifest says {expected}")]
    HashMismatch {
        /// The file.
        file: String,
        /// Hash in the manifest.
        expected: String,
        /// Hash of the file on disk.
        actual: String,
    },
    /// A device string that is not `auto`, `cpu`, `cuda` or `cuda:N`.
    #[error("invalid device {0:?}: expected auto, cpu, cuda or cuda:N")]
    InvalidDevice(String),
    /// A device was asked for that this machine does not have.
    #[error("device {requested} is not available: {reason}")]
    DeviceUnavailable {
        /// The device asked for.
        requested: String,
        /// Why it cannot be used.
        reason: String,
    },
    /// A stage range that does not fit the bundle (or the loaded stages).
    #[error("stage range {start}..{end} is invalid: {reason}")]
    InvalidRange {
        /// First stage.
        start: usize,
        /// One past the last stage.
        end: usize,
        /// What it must fit.
        reason: String,
    },
    /// libtorch could not load a stage file.
    #[error("cannot load stage {index} from {file}: {message}")]
    LoadStage {
        /// Stage index.
        index: usize,
        /// Stage file.
        file: String,
        /// libtorch's message.
        message: String,
    },
    /// A boundary does not match what the manifest says crosses a cut.
    #[error("boundary at cut {cut} ({cut_name}) does not match the manifest: {problem}")]
    BoundaryMismatch {
        /// Cut index.
        cut: usize,
        /// Cut name.
        cut_name: String,
        /// What differs: expected against got (boxed: it is large, and errors are rare).
        problem: Box<BoundaryProblem>,
    },
    /// A sequence length outside what the bundle was exported for.
    #[error("sequence length {got} is outside the bundle's range {min}..={max}")]
    SequenceOutOfRange {
        /// Sequence length of the boundary.
        got: i64,
        /// Shortest accepted.
        min: i64,
        /// Longest accepted.
        max: i64,
    },
    /// A sequence length asked of a bundle exported without a dynamic sequence.
    #[error("sequence length {got} asked for, but the bundle has no sequence dimension (S): it was exported without --dynamic-seq")]
    NoSequence {
        /// The length asked for.
        got: i64,
    },
    /// A batch size outside what the bundle was exported for.
    #[error("batch size {got} is outside the bundle's range {min}..={max}")]
    BatchOutOfRange {
        /// Batch size of the boundary.
        got: i64,
        /// Smallest accepted.
        min: i64,
        /// Largest accepted.
        max: i64,
    },
    /// A split point that does not name a usable cut.
    #[error("split {spec}: {reason}")]
    InvalidSplit {
        /// The split as given.
        spec: String,
        /// Why it cannot be used.
        reason: String,
    },
    /// Generation stages asked of a bundle exported without them.
    #[error("the bundle has no generation stages: export it with --generation (a causal language model)")]
    NoGeneration,
    /// A generation step's inputs the stages cannot take.
    #[error("generation step refused: {problem}")]
    GenerationStep {
        /// Why.
        problem: StepProblem,
    },
    /// A stage raised an error while running.
    #[error("stage {index} ({name}) failed: {message}")]
    StageFailed {
        /// Stage index.
        index: usize,
        /// Stage name.
        name: String,
        /// libtorch's message.
        message: String,
    },
    /// A value of a kind that cannot be carried across a cut.
    #[error("unsupported value at {path}: {kind}")]
    UnsupportedValue {
        /// Where in the value tree.
        path: String,
        /// What it is.
        kind: String,
    },
    /// No reference pair for the batch size asked for.
    #[error("the bundle has no reference at batch size {batch} (it has {available:?})")]
    NoReference {
        /// Batch size asked for.
        batch: i64,
        /// Batch sizes it has.
        available: Vec<i64>,
    },
    /// A reference file that cannot be read or does not match the manifest.
    #[error("reference file {file}: {message}")]
    Reference {
        /// The file.
        file: String,
        /// What is wrong.
        message: String,
    },
}

/// A foreign error with its chain of causes, each once: tonic's transport errors, for one,
/// keep the reason in their source ("transport error", then "connection refused"). A cause
/// whose text the message already holds is not repeated.
pub fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let next = s.to_string();
        if !text.contains(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        source = s.source();
    }
    text
}

/// What differs between a boundary and what the manifest says crosses its cut.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BoundaryProblem {
    /// Other values, or in another order.
    #[error("expected values {want:?}, got {got:?}")]
    Values {
        /// The manifest's.
        want: Vec<String>,
        /// The boundary's.
        got: Vec<String>,
    },
    /// A value that does not fit its spec.
    #[error(transparent)]
    Value(#[from] ValueMismatch),
    /// An integer input outside its range (an id past the vocabulary).
    #[error("{input}: values must lie in {lo}..={hi}, got {min}..={max}")]
    OutOfRange {
        /// The input.
        input: String,
        /// Its smallest value allowed.
        lo: i64,
        /// Its largest.
        hi: i64,
        /// The smallest value sent.
        min: i64,
        /// The largest.
        max: i64,
    },
    /// A cut the bundle cannot be split at.
    #[error("this cut cannot be split at: {reason}")]
    Unusable {
        /// The exporter's reason.
        reason: String,
    },
    /// A tensor named twice.
    #[error("tensor {name:?} is declared twice")]
    DeclaredTwice {
        /// Its name.
        name: String,
    },
    /// A training step's extra tensor (its targets) of a shape that cannot be a batch's.
    #[error("{name}: a tensor of rank 1 to {max_rank} whose first dimension is the batch, got {shape:?}")]
    ExtraShape {
        /// Its name.
        name: String,
        /// The largest rank allowed, plus one.
        max_rank: usize,
        /// Its shape.
        shape: Vec<i64>,
    },
    /// A tensor that does not cross this cut.
    #[error("no tensor {name:?} crosses this cut (it carries {carried:?})")]
    NotCarried {
        /// Its name.
        name: String,
        /// The tensors that do.
        carried: Vec<String>,
    },
    /// A gradient that is not floating-point.
    #[error("{name}: a gradient is floating-point, got {dtype}")]
    NotFloat {
        /// Its name.
        name: String,
        /// Its dtype.
        dtype: DType,
    },
    /// A declared tensor of another dtype or shape.
    #[error("{name}: expected {spec}, got {dtype}{shape:?} ({why})")]
    Tensor {
        /// Its name.
        name: String,
        /// The manifest's spec.
        spec: String,
        /// Its dtype.
        dtype: DType,
        /// Its shape.
        shape: Vec<i64>,
        /// What differs.
        why: ShapeMismatch,
    },
    /// A tensor the cut carries that was not sent.
    #[error("tensor {name:?} is missing")]
    Missing {
        /// Its name.
        name: String,
    },
    /// A step's extra tensor of another batch size than the boundary's.
    #[error("{name}: its first dimension is {rows}, the batch is {batch}")]
    ExtraRows {
        /// Its name.
        name: String,
        /// Its first dimension.
        rows: i64,
        /// The boundary's batch size.
        batch: i64,
    },
    /// Stages that returned another number of values than the manifest lists.
    #[error("the stages returned {got} values, the manifest lists {want}")]
    StageValues {
        /// Returned.
        got: usize,
        /// Listed.
        want: usize,
    },
}

/// Why a value does not fit its spec; `path` names where in the tree (`pair.1.k`).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ValueMismatch {
    /// A tuple or list of another length.
    #[error("{path}: expected {want} items, got {got}")]
    Items {
        /// Where.
        path: String,
        /// The spec's length.
        want: usize,
        /// The value's.
        got: usize,
    },
    /// A dict with other keys, or in another order.
    #[error("{path}: expected keys {want:?}, got {got:?}")]
    Keys {
        /// Where.
        path: String,
        /// The spec's keys.
        want: Vec<String>,
        /// The value's.
        got: Vec<String>,
    },
    /// Another kind of value (a list for a tensor, say).
    #[error("{path}: expected {want}, got {got}")]
    Kind {
        /// Where.
        path: String,
        /// The spec's kind.
        want: String,
        /// The value's.
        got: String,
    },
    /// A tensor of another dtype or shape.
    #[error("{path}: expected {spec}, got {got} ({why})")]
    Tensor {
        /// Where.
        path: String,
        /// The spec.
        spec: String,
        /// The tensor's dtype and shape.
        got: String,
        /// What differs (boxed: it is large, and mismatches are rare).
        why: Box<ShapeMismatch>,
    },
}

/// Why a generation step's inputs were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StepProblem {
    /// Token ids outside the vocabulary.
    #[error("token ids must lie in 0..{vocab_size}, got {min}..={max}")]
    TokenId {
        /// The least given.
        min: i64,
        /// The greatest given.
        max: i64,
        /// The vocabulary's size.
        vocab_size: i64,
    },
    /// Positions outside the cache.
    #[error("positions must lie in 0..{max_len} (the cache's length, at most the model's positions), got {min}..={max}")]
    Position {
        /// The least given.
        min: i64,
        /// The greatest given.
        max: i64,
        /// The cache's length.
        max_len: i64,
    },
    /// Shapes that do not fit each other.
    #[error("{0}")]
    Shape(String),
}
