//! `fleet.yaml`: the models to place (their profiles, rates, targets and edges) and the GPUs
//! to place them on (their MIG layouts), read and checked; every error names the key.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use cleave_common::config::{ConfigError, ConfigFile};
use serde::Deserialize;

use super::profile::{EdgeProfile, StageProfile};

/// A fleet to plan, checked.
#[derive(Debug, Clone)]
pub struct Fleet {
    /// What a GPU can be cut into.
    pub slice_kinds: Vec<SliceKind>,
    /// The GPUs, each with the layouts it may take.
    pub gpus: Vec<Gpu>,
    /// The models to place.
    pub models: Vec<FleetModel>,
    /// Memory a server process holds on its slice besides its models (CUDA context,
    /// allocator reserve), bytes.
    pub context_bytes: f64,
    /// The highest share of a slice's time the plan may fill, whatever the targets allow.
    pub max_utilisation: f64,
    /// The highest share of an edge's link its requests may fill.
    pub max_link_utilisation: f64,
    /// How long the solver may take in all; past it, the best plan found is used (and said).
    pub time_limit: Duration,
    /// The most models one slice may serve.
    pub max_models_per_slice: usize,
}

/// A slice size: `7g.80gb`, or `full` for a GPU without MIG.
#[derive(Debug, Clone, PartialEq)]
pub struct SliceKind {
    /// Its name, as `nvidia-smi mig -cgi` takes it.
    pub name: String,
    /// Its speed as a share of the whole GPU's, on which the profiles were measured.
    pub compute: f64,
    /// Its memory, bytes.
    pub memory_bytes: f64,
    /// False for `full`: the GPU runs without MIG.
    pub mig: bool,
}

/// One GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct Gpu {
    /// Its name in the plan (a host and index, say).
    pub name: String,
    /// Its `nvidia-smi` index on its machine.
    pub index: u32,
    /// The layouts it may take, each a list of slice kinds (indices into `slice_kinds`).
    pub layouts: Vec<Vec<usize>>,
}

/// One model to serve.
#[derive(Debug, Clone)]
pub struct FleetModel {
    /// Its name in the plan.
    pub name: String,
    /// Its bundle, for the servers' configs.
    pub bundle: PathBuf,
    /// Its server stages, measured on a whole GPU at several batch sizes.
    pub profile: StageProfile,
    /// Requests per second from all its edges together.
    pub rate: f64,
    /// The 95th percentile latency it must keep, edge to answer, milliseconds.
    pub p95_ms: f64,
    /// Its weight in the fairness: a model of weight 2 is given twice the headroom.
    pub weight: f64,
    /// The edges that send its requests.
    pub edges: Vec<EdgeClass>,
}

/// Edges of one kind sending one model's requests, the rate spread evenly over them.
#[derive(Debug, Clone)]
pub struct EdgeClass {
    /// Their name in the plan.
    pub name: String,
    /// How many.
    pub count: u32,
    /// Their stages' times (this model's prefix on their device).
    pub profile: EdgeProfile,
    /// Each edge's link bandwidth, bytes per second each way.
    pub bytes_per_s: f64,
    /// Each edge's round trip to the servers, milliseconds.
    pub rtt_ms: f64,
}

impl FleetModel {
    /// Edges in all.
    pub fn edge_count(&self) -> u32 {
        self.edges.iter().map(|e| e.count).sum()
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFleet {
    slice_kinds: BTreeMap<String, RawSliceKind>,
    gpus: Vec<RawGpu>,
    models: Vec<RawModel>,
    #[serde(default = "default_context_gb")]
    context_gb: f64,
    #[serde(default = "default_max_utilisation")]
    max_utilisation: f64,
    #[serde(default = "default_max_link_utilisation")]
    max_link_utilisation: f64,
    #[serde(default = "default_time_limit", with = "humantime_serde")]
    time_limit: Duration,
    #[serde(default = "default_max_models_per_slice")]
    max_models_per_slice: usize,
}

fn default_max_models_per_slice() -> usize {
    3
}

fn default_context_gb() -> f64 {
    0.5
}

fn default_max_utilisation() -> f64 {
    0.9
}

fn default_max_link_utilisation() -> f64 {
    0.7
}

fn default_time_limit() -> Duration {
    Duration::from_secs(20)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSliceKind {
    compute: f64,
    memory_gb: f64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGpu {
    name: String,
    #[serde(default)]
    index: Option<u32>,
    layouts: Vec<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawModel {
    name: String,
    bundle: PathBuf,
    profile: PathBuf,
    rate: f64,
    p95_ms: f64,
    #[serde(default = "one")]
    weight: f64,
    edges: Vec<RawEdges>,
}

fn one() -> f64 {
    1.0
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEdges {
    name: String,
    count: u32,
    profile: PathBuf,
    bandwidth_mbps: f64,
    rtt_ms: f64,
}

/// The name of the slice kind that means "no MIG, the whole GPU".
pub const FULL: &str = "full";

/// The most slices one GPU's layout holds (MIG's limit on an H100 or A100).
const MAX_SLICES: usize = 7;

impl Fleet {
    /// Reads and checks `fleet.yaml` and the profiles it names (relative to it).
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let file = ConfigFile { path };
        let raw: RawFleet = file.read_yaml()?;
        let slice_kinds = slice_kinds(&file, &raw.slice_kinds)?;
        let gpus = raw.gpus.iter().enumerate().map(|(i, g)| gpu(&file, &slice_kinds, i, g)).collect::<Result<Vec<_>, _>>()?;
        let models = raw.models.iter().enumerate().map(|(i, m)| model(&file, i, m)).collect::<Result<Vec<_>, _>>()?;
        if gpus.is_empty() {
            return Err(file.invalid("gpus", "no GPU to place the models on"));
        }
        if models.is_empty() {
            return Err(file.invalid("models", "no model to place"));
        }
        unique(&file, "gpus", gpus.iter().map(|g| g.name.as_str()))?;
        unique(&file, "models", models.iter().map(|m| m.name.as_str()))?;
        // A server refuses a bundle listed twice, and two models may share a slice.
        unique(&file, "models[].bundle", models.iter().map(|m| m.bundle.to_str().unwrap_or_default()))?;
        share(&file, "max_utilisation", raw.max_utilisation)?;
        share(&file, "max_link_utilisation", raw.max_link_utilisation)?;
        if !(raw.context_gb.is_finite() && raw.context_gb >= 0.0) {
            return Err(file.invalid("context_gb", "must be zero or more"));
        }
        if !(1..=MAX_SLICES).contains(&raw.max_models_per_slice) {
            return Err(file.invalid("max_models_per_slice", format!("{}: expected 1 to {MAX_SLICES}", raw.max_models_per_slice)));
        }
        if raw.time_limit.is_zero() || raw.time_limit > MAX_TIME_LIMIT {
            return Err(file.invalid("time_limit", format!("{:?}: expected more than 0 and at most an hour", raw.time_limit)));
        }
        Ok(Self {
            slice_kinds,
            gpus,
            models,
            context_bytes: raw.context_gb * GB,
            max_utilisation: raw.max_utilisation,
            max_link_utilisation: raw.max_link_utilisation,
            time_limit: raw.time_limit,
            max_models_per_slice: raw.max_models_per_slice,
        })
    }
}

const GB: f64 = 1e9;

/// The longest `time_limit`.
const MAX_TIME_LIMIT: Duration = Duration::from_secs(3600);

/// A name that goes into commands and file names: not empty, no spaces, commas or slashes.
fn name(file: &ConfigFile, key: &str, name: &str) -> Result<(), ConfigError> {
    if name.is_empty() || name.chars().any(|c| c.is_whitespace() || matches!(c, ',' | '/' | '\\')) {
        return Err(file.invalid(key, format!("{name:?}: expected a name without spaces, commas or slashes")));
    }
    Ok(())
}

fn share(file: &ConfigFile, key: &str, value: f64) -> Result<(), ConfigError> {
    if value > 0.0 && value < 1.0 {
        Ok(())
    } else {
        Err(file.invalid(key, format!("{value}: expected a share above 0 and below 1")))
    }
}

fn positive(file: &ConfigFile, key: &str, value: f64) -> Result<f64, ConfigError> {
    if value.is_finite() && value > 0.0 {
        Ok(value)
    } else {
        Err(file.invalid(key, format!("{value}: must be more than 0")))
    }
}

fn unique<'a>(file: &ConfigFile, key: &str, names: impl Iterator<Item = &'a str>) -> Result<(), ConfigError> {
    let mut seen = std::collections::BTreeSet::new();
    for name in names {
        if !seen.insert(name) {
            return Err(file.invalid(key, format!("{name:?} is named twice")));
        }
    }
    Ok(())
}

fn slice_kinds(file: &ConfigFile, raw: &BTreeMap<String, RawSliceKind>) -> Result<Vec<SliceKind>, ConfigError> {
    raw.iter()
        .map(|(name, kind)| {
            let key = format!("slice_kinds.{name}");
            self::name(file, &key, name)?;
            let compute = positive(file, &format!("{key}.compute"), kind.compute)?;
            if compute > 1.0 {
                return Err(file.invalid(&format!("{key}.compute"), "a slice is at most the whole GPU (1)"));
            }
            let memory_bytes = positive(file, &format!("{key}.memory_gb"), kind.memory_gb)? * GB;
            Ok(SliceKind { name: name.clone(), compute, memory_bytes, mig: name != FULL })
        })
        .collect()
}

fn gpu(file: &ConfigFile, kinds: &[SliceKind], i: usize, raw: &RawGpu) -> Result<Gpu, ConfigError> {
    let key = format!("gpus[{i}]");
    name(file, &format!("{key}.name"), &raw.name)?;
    if raw.layouts.is_empty() {
        return Err(file.invalid(&format!("{key}.layouts"), "no layout: list at least one, like [7g.80gb]"));
    }
    let mut layouts = Vec::new();
    for (l, layout) in raw.layouts.iter().enumerate() {
        let key = format!("{key}.layouts[{l}]");
        if layout.is_empty() || layout.len() > MAX_SLICES {
            return Err(file.invalid(&key, format!("{} slices: expected 1 to {MAX_SLICES}", layout.len())));
        }
        let slices = layout
            .iter()
            .map(|name| kinds.iter().position(|k| &k.name == name).ok_or_else(|| file.invalid(&key, format!("{name:?} is not one of slice_kinds"))))
            .collect::<Result<Vec<_>, _>>()?;
        if slices.len() > 1 && slices.iter().any(|&k| !kinds[k].mig) {
            return Err(file.invalid(&key, format!("`{FULL}` (no MIG) is a layout of its own")));
        }
        let compute: f64 = slices.iter().map(|&k| kinds[k].compute).sum();
        // Rounded shares (3/7 written 0.429) may add up to a little more than 1.
        if compute > 1.005 {
            return Err(file.invalid(&key, format!("its slices add up to {compute:.3} of the GPU's compute, more than all of it")));
        }
        layouts.push(slices);
    }
    Ok(Gpu { name: raw.name.clone(), index: raw.index.unwrap_or(i as u32), layouts })
}

fn model(file: &ConfigFile, i: usize, raw: &RawModel) -> Result<FleetModel, ConfigError> {
    let key = format!("models[{i}]");
    name(file, &format!("{key}.name"), &raw.name)?;
    let profile_key = format!("{key}.profile");
    let profile = StageProfile::read(&file.resolve(&raw.profile)).map_err(|e| file.invalid(&profile_key, e))?;
    if raw.edges.is_empty() {
        return Err(file.invalid(&format!("{key}.edges"), "no edge sends this model's requests"));
    }
    let edges: Vec<EdgeClass> =
        raw.edges.iter().enumerate().map(|(e, edges)| edge_class(file, &format!("{key}.edges[{e}]"), &profile, edges)).collect::<Result<_, _>>()?;
    unique(file, &format!("{key}.edges"), edges.iter().map(|e| e.name.as_str()))?;
    if edges.iter().try_fold(0u32, |n, e| n.checked_add(e.count)).is_none() {
        return Err(file.invalid(&format!("{key}.edges"), "more edges than a count holds"));
    }
    let weight = positive(file, &format!("{key}.weight"), raw.weight)?;
    Ok(FleetModel {
        name: raw.name.clone(),
        bundle: file.resolve(&raw.bundle),
        rate: positive(file, &format!("{key}.rate"), raw.rate)?,
        p95_ms: positive(file, &format!("{key}.p95_ms"), raw.p95_ms)?,
        weight,
        profile,
        edges,
    })
}

fn edge_class(file: &ConfigFile, key: &str, stages: &StageProfile, raw: &RawEdges) -> Result<EdgeClass, ConfigError> {
    let profile = EdgeProfile::read(&file.resolve(&raw.profile)).map_err(|e| file.invalid(&format!("{key}.profile"), e))?;
    if profile.stage_ms.len() != stages.stages.len() {
        let message = format!("{} stage times, but the model's profile has {} stages", profile.stage_ms.len(), stages.stages.len());
        return Err(file.invalid(&format!("{key}.profile"), message));
    }
    if raw.count == 0 {
        return Err(file.invalid(&format!("{key}.count"), "must be at least 1"));
    }
    if !(raw.rtt_ms.is_finite() && raw.rtt_ms >= 0.0) {
        return Err(file.invalid(&format!("{key}.rtt_ms"), "must be zero or more"));
    }
    Ok(EdgeClass {
        name: raw.name.clone(),
        count: raw.count,
        profile,
        bytes_per_s: positive(file, &format!("{key}.bandwidth_mbps"), raw.bandwidth_mbps)? * 1e6 / 8.0,
        rtt_ms: raw.rtt_ms,
    })
}
