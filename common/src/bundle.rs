//! An exported bundle on disk: its manifest, verified files, split points and references.
//!
//! Opening a bundle checks the format version and the sha256 of every file the manifest
//! lists before anything is loaded, so a corrupted or mismatched file is a clear error, not
//! a strange result. The bundle id is the sha256 of `manifest.json`, which itself holds the
//! hashes of every other file: two bundles with the same id are the same model.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::error::{BoundaryProblem, BundleError, Result};
use crate::spec::{BoundarySizes, DType, Dim, NamedSpec, Sizes, TensorSpec, ValueSpec};
use crate::value::{Boundary, Value};

/// The bundle format this build reads.
pub const FORMAT_VERSION: u32 = 1;
const FORMAT_NAME: &str = "cleave-bundle";

/// `manifest.json`, as the exporter writes it.
#[derive(Debug, Clone, Deserialize)]
pub struct Manifest {
    /// Always `cleave-bundle`.
    pub format: String,
    /// Format version ([`FORMAT_VERSION`]).
    pub format_version: u32,
    /// Where the model came from.
    pub model: ModelInfo,
    /// How it was exported.
    pub exporter: ExporterInfo,
    /// Batch sizes the bundle accepts.
    pub batch: BatchRange,
    /// Sequence lengths it accepts, in bundles exported with a dynamic sequence (`S`).
    #[serde(default)]
    pub sequence: Option<BatchRange>,
    /// The model's inputs (the values of cut 0), integer ones with the range of their values.
    pub inputs: Vec<NamedSpec>,
    /// The model's output tree, with `ref` leaves naming values of the last cut.
    pub output: ValueSpec,
    /// Every cut, from 0 (the inputs) to N (after the last stage).
    pub cuts: Vec<CutInfo>,
    /// Every stage; stage i runs from cut i to cut i + 1.
    pub stages: Vec<StageInfo>,
    /// Reference input/output pairs.
    pub references: Vec<ReferenceInfo>,
    /// sha256 of every file of the bundle but the manifest.
    pub files: BTreeMap<String, String>,
    /// The stages for split generation, in bundles exported with `--generation`.
    #[serde(default)]
    pub generation: Option<GenerationInfo>,
}

/// The manifest's `generation` section.
#[derive(Debug, Clone, Deserialize)]
pub struct GenerationInfo {
    /// The model's transformers class (`GPT2LMHeadModel`).
    pub family: String,
    /// Positions the model has embeddings for: the longest `max_len` a session may ask.
    pub max_positions: i64,
    /// Token ids lie in `0..vocab_size`.
    pub vocab_size: i64,
    /// The hidden states between stages: `[B, S, width]`.
    pub hidden: crate::spec::TensorSpec,
    /// The embedding, the layers, the head, in order.
    pub stages: Vec<GenerationStageInfo>,
    /// The exporter's check against transformers with its own cache.
    pub reference: GenerationReference,
}

/// One generation stage.
#[derive(Debug, Clone, Deserialize)]
pub struct GenerationStageInfo {
    /// The model part it runs (`transformer.h.0`).
    pub name: String,
    /// Its TorchScript file.
    pub file: String,
    /// The key/value cache it takes (layers only).
    #[serde(default)]
    pub cache: Option<CacheInfo>,
}

/// A layer's key/value cache: `[2, batch, heads, max_len, head_dim]` of `dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct CacheInfo {
    /// Its element type.
    pub dtype: DType,
    /// Key/value heads.
    pub heads: i64,
    /// Each head's width.
    pub head_dim: i64,
    /// Bytes per sequence and position: keys and values of every head.
    pub bytes_per_token: u64,
}

/// What the exporter checked: a prompt, then one token at a time, the tokens given.
#[derive(Debug, Clone, Deserialize)]
pub struct GenerationReference {
    /// Safetensors file with `input_ids` [B, T] and transformers' `logits` [B, T, vocab].
    pub file: String,
    /// Tokens of the prompt, run in one step.
    pub prompt: i64,
    /// Steps of one token after it.
    pub steps: i64,
    /// The cache length the exporter ran with.
    pub max_len: i64,
}

impl GenerationInfo {
    /// Checks what the rest of this module relies on: the embedding first, the head last,
    /// a cache on every layer between and nowhere else, caches of positive sizes whose bytes
    /// per token the dims give (a server budgets memory by them).
    pub fn validate(&self) -> Result<(), String> {
        let n = self.stages.len();
        if n < 2 {
            return Err(format!("{n} generation stages: an embedding and a head at least"));
        }
        for (i, stage) in self.stages.iter().enumerate() {
            let is_layer = i > 0 && i + 1 < n;
            match (is_layer, stage.cache) {
                (true, None) => return Err(format!("generation stage {i} ({}) is a layer without a cache", stage.name)),
                (false, Some(_)) => return Err(format!("generation stage {i} ({}) takes a cache but is no layer", stage.name)),
                (true, Some(c)) if c.heads < 1 || c.head_dim < 1 || Some(c.bytes_per_token) != cache_bytes_per_token(c) => {
                    return Err(format!("generation stage {i} ({}): cache {c:?} is inconsistent", stage.name))
                }
                _ => {}
            }
        }
        if self.vocab_size < 1 || self.max_positions < 1 {
            return Err(format!("generation: vocab_size {} and max_positions {} must be positive", self.vocab_size, self.max_positions));
        }
        match self.hidden.shape[..] {
            [Dim::Batch(1), Dim::Seq(1, 0), Dim::Fixed(width)] if width > 0 && self.hidden.dtype.is_float() => Ok(()),
            _ => Err(format!("generation: hidden states {} are not a float [B, S, width]", self.hidden)),
        }
    }

    /// The width of the hidden states between stages.
    pub fn hidden_width(&self) -> i64 {
        match self.hidden.shape[..] {
            [.., Dim::Fixed(width)] => width,
            _ => 0,
        }
    }

    /// Bytes of the caches of the layers among `stages` for `batch` sequences of `max_len`
    /// positions.
    pub fn cache_bytes(&self, stages: std::ops::Range<usize>, batch: i64, max_len: i64) -> u64 {
        let per_token: u64 = self.stages[stages].iter().filter_map(|s| s.cache.map(|c| c.bytes_per_token)).sum();
        per_token.saturating_mul(batch.max(0) as u64).saturating_mul(max_len.max(0) as u64)
    }
}

fn cache_bytes_per_token(c: CacheInfo) -> Option<u64> {
    let elements = 2i64.checked_mul(c.heads)?.checked_mul(c.head_dim)?;
    u64::try_from(elements).ok()?.checked_mul(c.dtype.size() as u64)
}

/// Where the model came from.
#[derive(Debug, Clone, Deserialize)]
pub struct ModelInfo {
    /// The exporter's SOURCE argument.
    pub source: String,
    /// The model's Python class.
    pub class: String,
    /// Seed of the random initialisation.
    pub seed: i64,
    /// Parameter count of the whole model.
    pub parameters: u64,
    /// Image preprocessing the model expects, when known.
    #[serde(default)]
    pub preprocess: Option<Preprocess>,
}

/// Image preprocessing: resize, centre crop, normalise.
#[derive(Debug, Clone, Deserialize)]
pub struct Preprocess {
    /// Shorter side after resizing.
    pub resize: u32,
    /// Side of the centre crop.
    pub crop: u32,
    /// Per-channel mean.
    pub mean: Vec<f64>,
    /// Per-channel standard deviation.
    pub std: Vec<f64>,
}

/// How the bundle was exported.
#[derive(Debug, Clone, Deserialize)]
pub struct ExporterInfo {
    /// Exporter version.
    pub version: String,
    /// PyTorch version used.
    pub torch: String,
    /// The granularity asked for.
    pub granularity: String,
    /// Modules kept whole because torch.fx could not trace inside them.
    #[serde(default)]
    pub kept_whole: Vec<String>,
    /// Candidate cuts merged away, with the reason.
    #[serde(default)]
    pub merged_cuts: Vec<String>,
    /// Parameters used by more than one stage (tied weights); absent in bundles exported
    /// before training support, which training refuses.
    #[serde(default)]
    pub shared_parameters: Option<Vec<SharedParameter>>,
}

/// One tensor that several stages hold a copy of (tied weights).
#[derive(Debug, Clone, Deserialize)]
pub struct SharedParameter {
    /// Its name in each stage.
    pub names: Vec<String>,
    /// The stages holding it.
    pub stages: Vec<usize>,
    /// Every name the model knows it by (the modules sharing it); absent in bundles exported
    /// before the exporter recorded them.
    #[serde(default)]
    pub aliases: Vec<String>,
}

/// Inclusive range of accepted batch sizes (or sequence lengths).
#[derive(Debug, Clone, Copy, Deserialize)]
pub struct BatchRange {
    /// Smallest.
    pub min: i64,
    /// Largest.
    pub max: i64,
}

/// A cut between two stages.
#[derive(Debug, Clone, Deserialize)]
pub struct CutInfo {
    /// Position in the chain (0 = the inputs).
    pub index: usize,
    /// `input`, `after <stage>`, or `output`.
    pub name: String,
    /// The values live here, in the order stages take and return them.
    pub values: Vec<NamedSpec>,
    /// Bytes per sample of the tensors with a batch dimension (at the longest sequence in
    /// bundles with one; [`CutInfo::bytes_at`] gives them at any length).
    pub bytes_per_sample: u64,
    /// Bytes of the tensors without one (at the longest sequence too).
    #[serde(default)]
    pub bytes_fixed: u64,
    /// Whether the cut can be a split point across the network.
    pub usable: bool,
    /// Why not, when it cannot.
    #[serde(default)]
    pub reason: Option<String>,
}

impl CutInfo {
    /// The tensors live here, with their wire names and specs.
    pub fn tensors(&self) -> Vec<(String, &TensorSpec)> {
        self.values.iter().flat_map(|v| v.spec.tensor_leaves(&v.name)).collect()
    }

    /// Bytes of the tensors live here at `sizes` (a batch size and a sequence length),
    /// computed from their specs; `None` when a size depends on the data (`?`) or on a size
    /// not given. Plain values count nothing.
    pub fn bytes_at(&self, sizes: Sizes) -> Option<u64> {
        self.tensors().iter().try_fold(0u64, |total, (_, t)| total.checked_add(t.bytes_at(sizes)?))
    }

    /// Whether requests here can be concatenated into one batch and split back: every value
    /// is a tensor (or a container of tensors) whose first dimension is the batch `B` and no
    /// other dimension depends on it or on the data. A plain value (a size, say) might be the
    /// batch size. Later dimensions may follow the sequence length: a server merges only
    /// requests of one length.
    pub fn batch_first(&self) -> bool {
        fn tree(spec: &ValueSpec) -> bool {
            match spec {
                ValueSpec::Tensor(t) => {
                    t.shape.first() == Some(&Dim::Batch(1)) && !t.shape[1..].iter().any(|d| matches!(d, Dim::Batch(_) | Dim::Dynamic))
                }
                ValueSpec::Tuple { items } | ValueSpec::List { items } => !items.is_empty() && items.iter().all(tree),
                ValueSpec::Dict { items } => !items.is_empty() && items.iter().all(|i| tree(&i.value)),
                _ => false,
            }
        }
        !self.values.is_empty() && self.values.iter().all(|v| tree(&v.spec))
    }
}

/// One stage of the chain.
#[derive(Debug, Clone, Deserialize)]
pub struct StageInfo {
    /// Position in the chain.
    pub index: usize,
    /// Its module path (or range of paths).
    pub name: String,
    /// The TorchScript file (trainable: split training runs it).
    pub file: String,
    /// The frozen inference version (eval mode, batch norm folded into convolutions), which
    /// inference runs when the exporter wrote one.
    #[serde(default)]
    pub inference_file: Option<String>,
    /// Module paths it covers, in order.
    #[serde(default)]
    pub modules: Vec<String>,
    /// Parameters it holds.
    pub parameters: u64,
    /// Matrix and convolution FLOPs per sample (the cost estimate).
    pub flops_per_sample: u64,
    /// `script` (keeps train/eval behaviour) or `trace`.
    pub compiler: String,
    /// Its parameters' names (the model's `state_dict` keys), in `named_parameters()` order;
    /// absent in bundles exported before training support.
    #[serde(default)]
    pub parameter_names: Option<Vec<String>>,
    /// Its buffers' names (batch-norm statistics), which its `cleave_buffers()` method returns.
    #[serde(default)]
    pub buffer_names: Option<Vec<String>>,
    /// Bytes per sample its training forward leaves for the backward (what autograd saves,
    /// parameters and buffers aside), as the exporter measured them; absent in bundles
    /// exported before it did.
    #[serde(default)]
    pub training_saved_bytes_per_sample: Option<u64>,
}

/// A reference input/output pair.
#[derive(Debug, Clone, Deserialize)]
pub struct ReferenceInfo {
    /// Its batch size.
    pub batch_size: i64,
    /// Its sequence length, in bundles with a dynamic sequence (one reference per batch size
    /// and length).
    #[serde(default)]
    pub seq_len: Option<i64>,
    /// The safetensors file (`input.NAME`, `output.NAME`).
    pub file: String,
}

/// A split point as a user sees it: where the edge stops and the server starts.
#[derive(Debug, Clone)]
pub struct SplitPoint {
    /// Cut index: the edge runs stages [0, index), the server [index, N).
    pub index: usize,
    /// Cut name.
    pub name: String,
    /// Tensors crossing, as `name: dtype[shape]`.
    pub tensors: Vec<String>,
    /// Plain (non-tensor) values crossing.
    pub plain_values: usize,
    /// Bytes per sample crossing, at `seq_len` in bundles with a sequence (where a size
    /// depends on the data, as the exporter measured it, at the longest sequence).
    pub bytes_per_sample: u64,
    /// The sequence length the bytes are at, in bundles with a sequence.
    pub seq_len: Option<i64>,
    /// One sample's bytes per token (fixed bytes included), in bundles with a sequence: what
    /// a sample costs per token of its length (not a constant: attention masks grow as S²).
    pub bytes_per_token: Option<f64>,
    /// Parameters on the edge side.
    pub params_before: u64,
    /// Parameters on the server side.
    pub params_after: u64,
    /// Share of the model's FLOPs on the edge side, in [0, 1].
    pub edge_cost_share: f64,
    /// Whether it can be used across the network (and why not).
    pub usable: Result<(), String>,
    /// Whether a server merges requests entering here into batches (see
    /// [`Bundle::batchable_cuts`]).
    pub batchable: bool,
}

/// Where the host splits the model.
#[derive(Debug, Clone, PartialEq)]
pub enum SplitSpec {
    /// `auto`: the planner picks the cut from measured profiles and moves it as the
    /// measured bandwidth changes.
    Auto,
    /// A cut index.
    Cut(usize),
    /// The cut after the stage with this name or module path.
    After(String),
    /// The first cut where the edge holds at least this share (percent) of the model's FLOPs.
    CostPercent(f64),
}

impl std::fmt::Display for SplitSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Auto => write!(f, "auto"),
            Self::Cut(i) => write!(f, "{i}"),
            Self::After(path) => write!(f, "after:{path}"),
            Self::CostPercent(p) => write!(f, "{p}%"),
        }
    }
}

impl std::str::FromStr for SplitSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s == "auto" {
            return Ok(Self::Auto);
        }
        if let Some(path) = s.strip_prefix("after:") {
            return Ok(Self::After(path.to_string()));
        }
        if let Some(p) = s.strip_suffix('%') {
            return match p.trim().parse::<f64>() {
                Ok(p) if (0.0..=100.0).contains(&p) => Ok(Self::CostPercent(p)),
                _ => Err(format!("{s:?}: a percentage must be between 0% and 100%")),
            };
        }
        s.parse().map(Self::Cut).map_err(|_| format!("{s:?} is not a cut index, after:<module path>, a percentage like 40% or auto"))
    }
}

/// A config's `split:` (or `tail:`): a cut index as a number, or any form as text.
impl<'de> serde::Deserialize<'de> for SplitSpec {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = SplitSpec;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a cut index, after:<module path>, a percentage like 40% or auto")
            }

            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<SplitSpec, E> {
                usize::try_from(v).map(SplitSpec::Cut).map_err(E::custom)
            }

            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<SplitSpec, E> {
                v.parse().map_err(E::custom)
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

/// Which of a cut's tensors a payload declares (see [`Bundle::check_declared_as`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CutTensors {
    /// Exactly the cut's tensors: a request, an evaluation batch.
    All,
    /// The cut's tensors and, optionally, one more of this name whose first dimension is the
    /// batch: a training step carrying its targets.
    AllAndMaybe(&'static str),
    /// Any of the cut's floating-point tensors, each at most once: gradients at the cut.
    FloatSubset,
}

/// Highest rank of the extra tensor [`CutTensors::AllAndMaybe`] allows.
const MAX_EXTRA_RANK: usize = 8;

/// An opened, verified bundle. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Bundle {
    dir: PathBuf,
    manifest: Arc<Manifest>,
    id: String,
}

/// How output shows a bundle id: its first 16 hex digits (64 bits), enough to tell bundles
/// apart; errors that match ids (a host's against a server's) give them whole.
pub fn short_id(id: &str) -> &str {
    &id[..id.len().min(16)]
}

impl Bundle {
    /// Opens the bundle in `dir`, checking its format and the hash of every file.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        if !dir.exists() {
            return Err(BundleError::NotFound { dir });
        }
        let path = dir.join("manifest.json");
        let bytes = std::fs::read(&path).map_err(|error| BundleError::Io { path: path.clone(), error })?;
        let manifest = parse_manifest(&path, &bytes)?;
        for (file, expected) in &manifest.files {
            let actual = sha256_file(&dir, file)?;
            if !actual.eq_ignore_ascii_case(expected) {
                return Err(BundleError::HashMismatch { file: file.clone(), expected: expected.clone(), actual });
            }
        }
        let id = hex::encode(Sha256::digest(&bytes));
        Ok(Self { dir, manifest: Arc::new(manifest), id })
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The bundle directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// sha256 of `manifest.json`: identifies the model, its weights and its cuts.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The id as every command shows it (see [`short_id`]).
    pub fn short_id(&self) -> &str {
        short_id(&self.id)
    }

    /// Number of stages (N); cuts run from 0 to N.
    pub fn stage_count(&self) -> usize {
        self.manifest.stages.len()
    }

    /// Cut `index`.
    pub fn cut(&self, index: usize) -> &CutInfo {
        &self.manifest.cuts[index]
    }

    /// Bytes per sample that a training forward through `stages` holds until its backward:
    /// what autograd saves in each stage (`training_saved_bytes_per_sample`) or, in a bundle
    /// exported before the exporter measured it, the stage's input (a lower bound).
    pub fn graph_bytes_per_sample(&self, stages: std::ops::Range<usize>) -> u64 {
        let saved = |i: usize| self.manifest.stages[i].training_saved_bytes_per_sample.unwrap_or(self.cut(i).bytes_per_sample);
        stages.map(saved).sum()
    }

    /// Every split point, from 0 (all on the server) to N (all on the edge), at the bundle's
    /// longest sequence in bundles with one.
    pub fn split_points(&self) -> Vec<SplitPoint> {
        self.split_points_at(self.longest_seq())
    }

    /// Every split point with its bytes at sequence length `seq` (from
    /// [`Bundle::resolve_seq`]; ignored in bundles without a sequence).
    pub fn split_points_at(&self, seq: Option<i64>) -> Vec<SplitPoint> {
        let seq = seq.filter(|_| self.manifest.sequence.is_some());
        let stages = &self.manifest.stages;
        let total_params: u64 = stages.iter().map(|s| s.parameters).sum();
        let total_flops: u64 = stages.iter().map(|s| s.flops_per_sample).sum();
        let batchable = self.batchable_cuts();
        self.manifest
            .cuts
            .iter()
            .map(|cut| {
                let params_before: u64 = stages[..cut.index].iter().map(|s| s.parameters).sum();
                let flops_before: u64 = stages[..cut.index].iter().map(|s| s.flops_per_sample).sum();
                let one = cut.bytes_at(Sizes::batch_and_seq(1, seq));
                let per_sample = one.zip(cut.bytes_at(Sizes::batch_and_seq(0, seq))).map(|(one, none)| one - none);
                SplitPoint {
                    index: cut.index,
                    name: cut.name.clone(),
                    tensors: cut.tensors().iter().map(|(n, t)| format!("{n}: {t}")).collect(),
                    plain_values: cut.values.iter().filter(|v| !matches!(v.spec, ValueSpec::Tensor(_))).count(),
                    bytes_per_sample: per_sample.unwrap_or(cut.bytes_per_sample),
                    seq_len: seq,
                    bytes_per_token: seq.zip(one).map(|(s, one)| one as f64 / s as f64),
                    params_before,
                    params_after: total_params - params_before,
                    edge_cost_share: if total_flops == 0 { 0.0 } else { flops_before as f64 / total_flops as f64 },
                    usable: if cut.usable { Ok(()) } else { Err(cut.reason.clone().unwrap_or_default()) },
                    batchable: batchable.contains(&cut.index),
                }
            })
            .collect()
    }

    /// The usable cuts at which requests from several hosts can be merged into one batch
    /// and their results split back: the cut and the last one are
    /// [`batch_first`](CutInfo::batch_first).
    pub fn batchable_cuts(&self) -> Vec<usize> {
        if !self.cut(self.stage_count()).batch_first() {
            return Vec::new();
        }
        self.manifest.cuts.iter().filter(|c| c.usable && c.batch_first()).map(|c| c.index).collect()
    }

    /// The cut a split spec names: an index, the cut after a module (`after:layer2.1`, the
    /// whole module on the edge), or the first cut where the edge holds a share of the FLOPs.
    pub fn resolve_split(&self, spec: &SplitSpec) -> Result<usize> {
        let n = self.stage_count();
        let invalid = |reason: String| BundleError::InvalidSplit { spec: spec.to_string(), reason };
        let cut = match spec {
            SplitSpec::Auto => {
                return Err(invalid("auto is chosen by the planner from measured profiles (`host --config` plans it at start-up)".into()))
            }
            SplitSpec::Cut(i) if *i <= n => *i,
            SplitSpec::Cut(i) => return Err(invalid(format!("cut {i} is out of range: the bundle has cuts 0..={n}"))),
            SplitSpec::After(path) => {
                let inside = |s: &StageInfo| s.name == *path || s.modules.iter().any(|m| m == path || m.starts_with(&format!("{path}.")));
                match self.manifest.stages.iter().rposition(inside) {
                    Some(k) => k + 1,
                    None => return Err(invalid(format!("no stage holds module {path:?} (see `host splits`)"))),
                }
            }
            SplitSpec::CostPercent(p) => {
                let points = self.split_points();
                points.iter().find(|sp| sp.edge_cost_share * 100.0 >= *p - 1e-9).map_or(n, |sp| sp.index)
            }
        };
        match &self.manifest.cuts[cut] {
            c if c.usable => Ok(cut),
            c => Err(invalid(format!("cut {cut} ({}) is not usable: {}", c.name, c.reason.clone().unwrap_or_default()))),
        }
    }

    /// Checks `boundary` against what the manifest says crosses cut `cut` (at cut 0, integer
    /// inputs against their value range too); returns its batch size and sequence length.
    pub fn check_boundary(&self, cut: usize, boundary: &Boundary) -> Result<BoundarySizes> {
        let info = &self.manifest.cuts[cut];
        let mismatch = |problem: BoundaryProblem| BundleError::BoundaryMismatch { cut, cut_name: info.name.clone(), problem: Box::new(problem) };
        let names: Vec<&str> = boundary.values.iter().map(|(n, _)| n.as_str()).collect();
        let want: Vec<&str> = info.values.iter().map(|v| v.name.as_str()).collect();
        if names != want {
            let owned = |names: Vec<&str>| names.into_iter().map(str::to_string).collect();
            return Err(mismatch(BoundaryProblem::Values { want: owned(want), got: owned(names) }));
        }
        let mut sizes = Sizes::default();
        for ((name, value), spec) in boundary.values.iter().zip(&info.values) {
            value.check(&spec.spec, name, &mut sizes).map_err(|e| mismatch(e.into()))?;
        }
        if cut == 0 {
            self.check_input_values(boundary).map_err(|problem| mismatch(*problem))?;
        }
        self.check_sizes(sizes)
    }

    /// Integer inputs within their value range: an id past the vocabulary would index out of
    /// an embedding, which on CUDA is a device-side assert that ends every request on the GPU.
    fn check_input_values(&self, boundary: &Boundary) -> std::result::Result<(), Box<BoundaryProblem>> {
        for (input, (_, value)) in self.manifest.inputs.iter().zip(&boundary.values) {
            let (Some((lo, hi)), Some(t)) = (input.range, value.as_tensor()) else { continue };
            if t.numel() == 0 {
                continue;
            }
            let (min, max) = (t.min().int64_value(&[]), t.max().int64_value(&[]));
            if min < lo || max > hi {
                return Err(Box::new(BoundaryProblem::OutOfRange { input: input.name.clone(), lo, hi, min, max }));
            }
        }
        Ok(())
    }

    /// The batch size and sequence length a boundary showed, against the bundle's ranges.
    fn check_sizes(&self, sizes: Sizes) -> Result<BoundarySizes> {
        if let Some(got) = sizes.seq {
            self.check_seq(got)?;
        }
        let BatchRange { min, max } = self.manifest.batch;
        let batch = match sizes.batch {
            Some(b) if !(min..=max).contains(&b) => return Err(BundleError::BatchOutOfRange { got: b, min, max }),
            Some(b) => b,
            None => min,
        };
        Ok(BoundarySizes { batch, seq: sizes.seq })
    }

    /// A sequence length within the bundle's range (a bundle without a sequence takes none).
    fn check_seq(&self, got: i64) -> Result<i64> {
        match self.manifest.sequence {
            Some(BatchRange { min, max }) if !(min..=max).contains(&got) => Err(BundleError::SequenceOutOfRange { got, min, max }),
            Some(_) => Ok(got),
            None => Err(BundleError::NoSequence { got }),
        }
    }

    /// The sequence length to profile, plan or make inputs at: `requested` when given
    /// (within the bundle's range), else the bundle's longest; `None` in bundles without a
    /// sequence.
    pub fn resolve_seq(&self, requested: Option<i64>) -> Result<Option<i64>> {
        match requested {
            Some(seq) => self.check_seq(seq).map(Some),
            None => Ok(self.longest_seq()),
        }
    }

    /// The longest sequence the bundle takes, in bundles with a sequence.
    fn longest_seq(&self) -> Option<i64> {
        self.manifest.sequence.map(|r| r.max)
    }

    /// Checks what a payload declares it carries at `cut` (each tensor's name, dtype and
    /// shape, before a byte of it is reserved) against the manifest: exactly the cut's
    /// tensors, shapes of one batch size and one sequence length within the exported ranges
    /// (the payload's size is bounded by them, so a hostile length is refused here, before
    /// any memory is held for it). Returns the batch size and sequence length.
    /// A cut out of range, or one that cannot be split at (its sizes depend on the data and
    /// could not be bounded), is refused.
    pub fn check_declared<'a>(&self, cut: usize, declared: impl IntoIterator<Item = (&'a str, DType, &'a [i64])>) -> Result<BoundarySizes> {
        self.check_declared_as(cut, CutTensors::All, declared)
    }

    /// [`Bundle::check_declared`] under `rule`: which of the cut's tensors the payload must
    /// (or may) carry.
    pub fn check_declared_as<'a>(
        &self,
        cut: usize,
        rule: CutTensors,
        declared: impl IntoIterator<Item = (&'a str, DType, &'a [i64])>,
    ) -> Result<BoundarySizes> {
        let n = self.stage_count();
        let Some(info) = self.manifest.cuts.get(cut) else {
            return Err(BundleError::InvalidSplit {
                spec: cut.to_string(),
                reason: format!("split {cut} is out of range: the bundle has cuts 0..={n}"),
            });
        };
        let mismatch = |problem: BoundaryProblem| BundleError::BoundaryMismatch { cut, cut_name: info.name.clone(), problem: Box::new(problem) };
        if !info.usable && cut != n {
            return Err(mismatch(BoundaryProblem::Unusable { reason: info.reason.clone().unwrap_or_else(|| "unusable".into()) }));
        }
        let specs = info.tensors();
        let mut sizes = Sizes::default();
        let mut seen: Vec<&str> = Vec::with_capacity(specs.len());
        // The extra tensor (a step's targets): its leading dimension, checked once the batch is known.
        let mut extra_rows = None;
        for (name, dtype, shape) in declared {
            if seen.contains(&name) {
                return Err(mismatch(BoundaryProblem::DeclaredTwice { name: name.to_string() }));
            }
            seen.push(name);
            if let CutTensors::AllAndMaybe(extra) = rule {
                if name == extra {
                    match shape {
                        [rows, rest @ ..] if rest.len() < MAX_EXTRA_RANK => extra_rows = Some(*rows),
                        _ => {
                            return Err(mismatch(BoundaryProblem::ExtraShape {
                                name: name.to_string(),
                                max_rank: MAX_EXTRA_RANK,
                                shape: shape.to_vec(),
                            }))
                        }
                    }
                    continue;
                }
            }
            let Some((_, spec)) = specs.iter().find(|(n, _)| n == name) else {
                let carried = specs.iter().map(|(n, _)| n.clone()).collect();
                return Err(mismatch(BoundaryProblem::NotCarried { name: name.to_string(), carried }));
            };
            if rule == CutTensors::FloatSubset && !dtype.is_float() {
                return Err(mismatch(BoundaryProblem::NotFloat { name: name.to_string(), dtype }));
            }
            spec.check_shape(dtype, shape, &mut sizes).map_err(|why| {
                mismatch(BoundaryProblem::Tensor { name: name.to_string(), spec: spec.to_string(), dtype, shape: shape.to_vec(), why })
            })?;
        }
        if rule != CutTensors::FloatSubset {
            if let Some((missing, _)) = specs.iter().find(|(n, _)| !seen.contains(&n.as_str())) {
                return Err(mismatch(BoundaryProblem::Missing { name: missing.clone() }));
            }
        }
        if let (Some(rows), CutTensors::AllAndMaybe(extra)) = (extra_rows, rule) {
            match sizes.batch {
                Some(b) if rows != b => return Err(mismatch(BoundaryProblem::ExtraRows { name: extra.to_string(), rows, batch: b })),
                None => sizes.batch = Some(rows),
                _ => {}
            }
        }
        self.check_sizes(sizes)
    }

    /// The model's output (its own tree: a tensor, tuple, dict ...) from the last cut's boundary.
    pub fn assemble_output(&self, last: Boundary) -> Result<Value> {
        let mut by_name: HashMap<String, Value> = last.values.into_iter().collect();
        assemble(&self.manifest.output, &mut by_name)
    }

    /// `batch` samples at the bundle's longest sequence (with a sequence): the sizes a
    /// profile or a synthetic input takes unless told otherwise.
    pub fn sizes_at(&self, batch: i64) -> Sizes {
        Sizes::batch_and_seq(batch, self.longest_seq())
    }

    /// Batch sizes that have a reference pair, each once, in the manifest's order.
    pub fn reference_batches(&self) -> Vec<i64> {
        let mut batches: Vec<i64> = Vec::new();
        for r in &self.manifest.references {
            if !batches.contains(&r.batch_size) {
                batches.push(r.batch_size);
            }
        }
        batches
    }

    /// The reference pairs at `batch` (one per sequence length in bundles with a sequence).
    pub fn references_at(&self, batch: i64) -> Vec<&ReferenceInfo> {
        self.manifest.references.iter().filter(|r| r.batch_size == batch).collect()
    }

    /// The reference input (cut 0) and output (cut N) at `batch` (the first of its sequence
    /// lengths), on the CPU.
    pub fn reference(&self, batch: i64) -> Result<(Boundary, Boundary)> {
        let info =
            self.references_at(batch).into_iter().next().ok_or_else(|| BundleError::NoReference { batch, available: self.reference_batches() })?;
        self.load_reference(info)
    }

    /// One reference pair's input and output, on the CPU.
    pub fn load_reference(&self, info: &ReferenceInfo) -> Result<(Boundary, Boundary)> {
        let bad = |message: String| BundleError::Reference { file: info.file.clone(), message };
        let tensors = tch::Tensor::read_safetensors(self.dir.join(&info.file)).map_err(|e| bad(e.to_string()))?;
        let (mut inputs, mut outputs) = (HashMap::new(), HashMap::new());
        for (key, tensor) in tensors {
            if let Some(name) = key.strip_prefix("input.") {
                inputs.insert(name.to_string(), tensor);
            } else if let Some(name) = key.strip_prefix("output.") {
                outputs.insert(name.to_string(), tensor);
            } else {
                return Err(bad(format!("unexpected entry {key:?}")));
            }
        }
        let rebuild = |cut: &CutInfo, leaves: &mut HashMap<String, tch::Tensor>| -> Result<Boundary> {
            let values = cut
                .values
                .iter()
                .map(|v| Ok((v.name.clone(), Value::from_tensor_leaves(&v.spec, &v.name, leaves).map_err(|e| bad(e.to_string()))?)))
                .collect::<Result<_>>()?;
            Ok(Boundary { values })
        };
        let input = rebuild(&self.manifest.cuts[0], &mut inputs)?;
        let output = rebuild(self.manifest.cuts.last().expect("checked at open"), &mut outputs)?;
        Ok((input, output))
    }
}

fn assemble(tree: &ValueSpec, by_name: &mut HashMap<String, Value>) -> Result<Value> {
    let missing = |name: &str| BundleError::UnsupportedValue { path: name.to_string(), kind: "missing from the last cut".into() };
    Ok(match tree {
        ValueSpec::Ref { name } => {
            // A value the output names twice is shared, not moved.
            match by_name.get(name) {
                Some(v) => v.shallow_clone(),
                None => return Err(missing(name)),
            }
        }
        ValueSpec::Tuple { items } => Value::Tuple(items.iter().map(|t| assemble(t, by_name)).collect::<Result<_>>()?),
        ValueSpec::List { items } => Value::List(items.iter().map(|t| assemble(t, by_name)).collect::<Result<_>>()?),
        ValueSpec::Dict { items } => Value::Dict(items.iter().map(|it| Ok((it.key.clone(), assemble(&it.value, by_name)?))).collect::<Result<_>>()?),
        other => return Err(BundleError::UnsupportedValue { path: "output".into(), kind: other.describe() }),
    })
}

fn parse_manifest(path: &Path, bytes: &[u8]) -> Result<Manifest> {
    let invalid = |message: String| BundleError::Manifest { path: path.to_path_buf(), message };
    // Check the format before the full schema, so an old or foreign file says what it is.
    let raw: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| invalid(e.to_string()))?;
    let format = raw.get("format").and_then(|f| f.as_str());
    let version = raw.get("format_version").and_then(|v| v.as_u64());
    if format != Some(FORMAT_NAME) || version != Some(u64::from(FORMAT_VERSION)) {
        return Err(BundleError::UnsupportedFormat {
            path: path.to_path_buf(),
            found: format!("format {} version {}", format.unwrap_or("(none)"), version.map_or("(none)".into(), |v| v.to_string())),
            supported: FORMAT_VERSION,
        });
    }
    let manifest: Manifest = serde_json::from_value(raw).map_err(|e| invalid(e.to_string()))?;
    let n = manifest.stages.len();
    if n == 0 || manifest.cuts.len() != n + 1 {
        return Err(invalid(format!("{} stages need {} cuts, found {}", n, n + 1, manifest.cuts.len())));
    }
    if let Some(c) = manifest.cuts.iter().enumerate().find(|(i, c)| c.index != *i) {
        return Err(invalid(format!("cut at position {} has index {}", c.0, c.1.index)));
    }
    if let Some(s) = manifest.stages.iter().enumerate().find(|(i, s)| s.index != *i) {
        return Err(invalid(format!("stage at position {} has index {}", s.0, s.1.index)));
    }
    let stage_files = manifest.stages.iter().flat_map(|s| std::iter::once(&s.file).chain(&s.inference_file));
    let generation_files = manifest.generation.iter().flat_map(|g| g.stages.iter().map(|s| &s.file).chain([&g.reference.file]));
    for file in stage_files.chain(manifest.references.iter().map(|r| &r.file)).chain(generation_files) {
        if !manifest.files.contains_key(file) {
            return Err(invalid(format!("{file} has no hash in `files`")));
        }
    }
    let named = |v: &NamedSpec| (v.name.clone(), v.spec.clone());
    if manifest.inputs.iter().map(named).ne(manifest.cuts[0].values.iter().map(named)) {
        return Err(invalid("`inputs` differ from the values of cut 0".into()));
    }
    if manifest.batch.min < 1 || manifest.batch.min > manifest.batch.max {
        return Err(invalid(format!("batch range {}..={} is empty", manifest.batch.min, manifest.batch.max)));
    }
    match manifest.sequence {
        Some(r) if r.min < 1 || r.min > r.max => return Err(invalid(format!("sequence range {}..={} is empty", r.min, r.max))),
        None if manifest.cuts.iter().flat_map(|c| c.tensors()).any(|(_, t)| t.shape.iter().any(|d| matches!(d, Dim::Seq(..)))) => {
            return Err(invalid("dimensions follow the sequence length (S) but the manifest gives no `sequence` range".into()))
        }
        _ => {}
    }
    if let Some(problem) = manifest.generation.as_ref().and_then(|g| g.validate().err()) {
        return Err(invalid(problem));
    }
    if let Some(input) = manifest.inputs.iter().find(|i| i.range.is_some_and(|(lo, hi)| lo > hi)) {
        return Err(invalid(format!("input {} has an empty value range", input.name)));
    }
    Ok(manifest)
}

/// The hex SHA-256 of bundle file `file` in `dir`, as a manifest's `files` records it
/// (read in 1 MiB pieces).
pub fn sha256_file(dir: &Path, file: &str) -> Result<String> {
    // Names come from the manifest: refuse anything that would leave the bundle directory.
    if file.contains('/') || file.contains('\\') || file.starts_with('.') {
        return Err(BundleError::Manifest { path: dir.join("manifest.json"), message: format!("file name {file:?} is not a plain name") });
    }
    let path = dir.join(file);
    let mut f = File::open(&path).map_err(|source| match source.kind() {
        std::io::ErrorKind::NotFound => BundleError::MissingFile { dir: dir.to_path_buf(), file: file.to_string() },
        _ => BundleError::Io { path: path.clone(), error: source },
    })?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|error| BundleError::Io { path: path.clone(), error })?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generation_section_that_lies_about_its_caches_is_refused() {
        let stage = |name: &str, cache: &str| format!(r#"{{"name":"{name}","file":"f.pt"{cache}}}"#);
        let cache = |heads: i64, bytes: u64| format!(r#","cache":{{"dtype":"float32","heads":{heads},"head_dim":8,"bytes_per_token":{bytes}}}"#);
        let with_hidden = |stages: Vec<String>, hidden: &str| -> GenerationInfo {
            let json = format!(
                r#"{{"family":"GPT2LMHeadModel","max_positions":64,"vocab_size":500,"stages":[{}],
                "hidden":{hidden},"reference":{{"file":"r.safetensors","prompt":7,"steps":32,"max_len":48}}}}"#,
                stages.join(",")
            );
            serde_json::from_str(&json).unwrap()
        };
        let section = |stages: Vec<String>| with_hidden(stages, r#"{"type":"tensor","dtype":"float32","shape":["B","S",32]}"#);
        let good = section(vec![stage("embed", ""), stage("h.0", &cache(4, 256)), stage("h.1", &cache(2, 128)), stage("head", "")]);
        assert_eq!(good.validate(), Ok(()));
        assert_eq!(good.cache_bytes(0..4, 3, 10), (256 + 128) * 3 * 10);
        assert_eq!(good.cache_bytes(2..4, 3, 10), 128 * 3 * 10);
        // A cache smaller than its dims say would let a server under-count its budget.
        let lying = section(vec![stage("embed", ""), stage("h.0", &cache(4, 8)), stage("head", "")]);
        assert!(lying.validate().unwrap_err().contains("cache"), "{:?}", lying.validate());
        let uncached = section(vec![stage("embed", ""), stage("h.0", ""), stage("head", "")]);
        assert!(uncached.validate().unwrap_err().contains("layer without a cache"));
        let cached_head = section(vec![stage("embed", ""), stage("head", &cache(4, 256))]);
        assert!(cached_head.validate().unwrap_err().contains("no layer"));
        assert!(section(vec![stage("embed", "")]).validate().unwrap_err().contains("an embedding and a head"));
        let huge = section(vec![stage("embed", ""), stage("h.0", &cache(i64::MAX, 0)), stage("head", "")]);
        assert!(huge.validate().is_err(), "no overflow");
        let two = || vec![stage("embed", ""), stage("head", "")];
        assert_eq!(section(two()).hidden_width(), 32);
        // A server sizes each step's hidden states by this spec.
        for hidden in
            [r#"{"dtype":"int64","shape":["B","S",32]}"#, r#"{"dtype":"float32","shape":["B",32]}"#, r#"{"dtype":"float32","shape":["B","S",0]}"#]
        {
            assert!(with_hidden(two(), hidden).validate().unwrap_err().contains("hidden states"), "{hidden}");
        }
    }

    #[test]
    fn split_specs_parse() {
        assert_eq!("3".parse::<SplitSpec>().unwrap(), SplitSpec::Cut(3));
        assert_eq!("after:layer2.1".parse::<SplitSpec>().unwrap(), SplitSpec::After("layer2.1".into()));
        assert_eq!("40%".parse::<SplitSpec>().unwrap(), SplitSpec::CostPercent(40.0));
        assert!("140%".parse::<SplitSpec>().unwrap_err().contains("between 0% and 100%"));
        assert!("middle".parse::<SplitSpec>().unwrap_err().contains("not a cut index"));
    }

    #[test]
    fn split_specs_read_from_yaml_as_numbers_or_text() {
        let yaml = |text: &str| serde_yaml::from_str::<SplitSpec>(text).map_err(|e| e.to_string());
        assert_eq!(yaml("3"), Ok(SplitSpec::Cut(3)));
        assert_eq!(yaml("\"3\""), Ok(SplitSpec::Cut(3)));
        assert_eq!(yaml("auto"), Ok(SplitSpec::Auto));
        assert_eq!(yaml("40%"), Ok(SplitSpec::CostPercent(40.0)));
        assert_eq!(yaml("after:layer2.1"), Ok(SplitSpec::After("layer2.1".into())));
        assert!(yaml("-1").unwrap_err().contains("expected a cut index, after:<module path>, a percentage like 40% or auto"));
        assert!(yaml("2.5").unwrap_err().contains("expected a cut index"));
        assert!(yaml("[3]").unwrap_err().contains("expected a cut index"));
        assert!(yaml("middle").unwrap_err().contains("\"middle\" is not a cut index"));
    }

    #[test]
    fn only_cuts_of_batch_first_tensors_merge() {
        let cut = |values: &str| -> CutInfo {
            serde_json::from_str(&format!(r#"{{"index":1,"name":"c","values":{values},"bytes_per_sample":4,"usable":true}}"#)).unwrap()
        };
        let tensor = |shape: &str| format!(r#"{{"type":"tensor","dtype":"float32","shape":{shape}}}"#);
        let named = |spec: String| format!(r#"{{"name":"v","spec":{spec}}}"#);
        assert!(cut(&format!("[{}]", named(tensor(r#"["B",3]"#)))).batch_first());
        assert!(cut(&format!(r#"[{}]"#, named(format!(r#"{{"type":"tuple","items":[{},{}]}}"#, tensor(r#"["B"]"#), tensor(r#"["B",2,2]"#)))))
            .batch_first());
        assert!(cut(&format!("[{}]", named(tensor(r#"["B","S",32]"#)))).batch_first());
        assert!(cut(&format!("[{}]", named(tensor(r#"["B",1,"S","2*S"]"#)))).batch_first());
        for not in [
            format!("[{}]", named(tensor(r#"[1,"B"]"#))),
            format!("[{}]", named(tensor(r#"["2*B",3]"#))),
            format!("[{}]", named(tensor(r#"["B","B"]"#))),
            format!("[{}]", named(tensor(r#"["B","?"]"#))),
            format!("[{}]", named(tensor(r#"["S","B"]"#))),
            format!("[{}]", named(tensor(r#"[1,"S"]"#))),
            format!("[{}]", named(tensor("[]"))),
            format!(r#"[{}, {}]"#, named(tensor(r#"["B"]"#)), named(r#"{"type":"int"}"#.into())),
            "[]".into(),
        ] {
            assert!(!cut(&not).batch_first(), "{not}");
        }
    }
}
