//! Input sources: where the host's batches come from.

use std::collections::HashMap;

use crate::config::InputSource;
use cleave_common::spec::{DType, Sizes, TensorSpec, TorchDType, ValueSpec};
use cleave_common::{Boundary, Bundle, Value};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;
use tch::{Device, Kind, Tensor};

use crate::error::{HostError, InputError, Result};

/// Makes the input boundary (cut 0) of each request.
pub enum Inputs {
    /// Seeded random tensors shaped like the bundle's inputs.
    Synthetic {
        /// Each input.
        specs: Vec<InputSpec>,
        /// Batch size, and the bundle's longest sequence when it has one.
        sizes: Sizes,
        /// Base seed.
        seed: i64,
    },
    /// Consecutive batches of a file's rows or a directory's images (wrapping around at the
    /// end).
    File {
        /// Input name and its full tensor.
        tensors: Vec<(String, Tensor)>,
        /// Rows in the file.
        rows: i64,
        /// Batch size.
        batch: i64,
        /// What the rows are called, for messages: `image directory D`, `input file F`.
        what: String,
        /// Each row's image file name (images only).
        names: Option<std::sync::Arc<Vec<String>>>,
    },
}

/// The image file of each sample of a request, for `predictions.jsonl`.
#[derive(Clone)]
pub struct SampleFiles {
    names: std::sync::Arc<Vec<String>>,
    batch: i64,
}

impl SampleFiles {
    /// The file of each sample of request `index`, in batch order.
    pub fn of(&self, index: u64) -> Vec<String> {
        row_indices(index, self.batch, self.names.len() as i64).map(|i| self.names[i as usize].clone()).collect()
    }
}

/// The rows request `index` takes: consecutive, wrapping around at the end.
fn row_indices(index: u64, batch: i64, rows: i64) -> impl Iterator<Item = i64> {
    (0..batch).map(move |i| (index as i64 * batch + i) % rows)
}

/// One tensor input: its name, spec and, for integer inputs, the range of its values.
pub struct InputSpec {
    name: String,
    spec: TensorSpec,
    range: Option<(i64, i64)>,
}

impl Inputs {
    /// Prepares the source for `bundle` at `batch` samples per request.
    pub fn new(source: &InputSource, bundle: &Bundle, batch: i64) -> Result<Self> {
        let mut specs = Vec::new();
        for input in &bundle.manifest().inputs {
            match &input.spec {
                ValueSpec::Tensor(t) => specs.push(InputSpec { name: input.name.clone(), spec: t.clone(), range: input.range }),
                other => return Err(InputError::NotATensor { name: input.name.clone(), kind: other.describe(), reader: "a run" }.into()),
            }
        }
        match source {
            InputSource::Synthetic { seed } => Ok(Self::Synthetic { specs, sizes: bundle.sizes_at(batch), seed: *seed }),
            InputSource::Images { dir } => {
                let [InputSpec { name, spec, .. }] = specs.as_slice() else {
                    return Err(InputError::ImagesNeedOneInput { inputs: specs.len() }.into());
                };
                crate::files::require("image directory", dir)?;
                let (images, names) = crate::images::load_dir(dir, spec, bundle.manifest().model.preprocess.as_ref())?;
                let rows = images.size()[0];
                let what = format!("image directory {}", dir.display());
                Ok(Self::File { tensors: vec![(name.clone(), images)], rows, batch, what, names: Some(std::sync::Arc::new(names)) })
            }
            InputSource::File { path } => {
                crate::files::require("input file", path)?;
                let read = match path.extension().and_then(|e| e.to_str()) {
                    Some("npy") => match specs.as_slice() {
                        [InputSpec { name, .. }] => Tensor::read_npy(path).map(|t| vec![(name.clone(), t)]),
                        _ => return Err(InputError::NpyHoldsOneTensor { inputs: specs.len() }.into()),
                    },
                    Some("npz") => Tensor::read_npz(path),
                    Some("safetensors") => Tensor::read_safetensors(path),
                    _ => return Err(InputError::UnknownFileKind { path: path.clone() }.into()),
                };
                let loaded: HashMap<String, Tensor> =
                    read.map_err(|error| HostError::TensorFile { what: "input file", path: path.clone(), error })?.into_iter().collect();
                let mut tensors = Vec::new();
                let mut rows = None;
                for InputSpec { name, spec, .. } in &specs {
                    let t = loaded.get(name).ok_or_else(|| InputError::MissingTensor {
                        path: path.clone(),
                        name: name.clone(),
                        held: loaded.keys().cloned().collect(),
                    })?;
                    let fixed_ok = spec.shape.iter().zip(t.size()).skip(1).all(|(d, n)| d.at(Sizes::batch(1)).is_none_or(|w| w == n));
                    if DType::from_kind(t.kind()) != Some(spec.dtype) || t.dim() != spec.shape.len() || !fixed_ok {
                        let found = format!("{:?}{:?}", t.kind(), t.size());
                        return Err(InputError::WrongTensor { path: path.clone(), name: name.clone(), found, expected: spec.to_string() }.into());
                    }
                    let n = t.size()[0];
                    if *rows.get_or_insert(n) != n || n == 0 {
                        return Err(InputError::UnevenRows { path: path.clone() }.into());
                    }
                    tensors.push((name.clone(), t.shallow_clone()));
                }
                let what = format!("input file {}", path.display());
                Ok(Self::File { tensors, rows: rows.unwrap_or(0), batch, what, names: None })
            }
        }
    }

    /// Said once before a run of `requests` that needs more samples than the file or directory
    /// holds: which are used again.
    pub fn reuse_note(&self, requests: u64) -> Option<String> {
        match self {
            Self::File { rows, batch, what, .. } if requests as i64 * batch > *rows => Some(format!(
                "{what} holds {rows} samples and {requests} requests of {batch} need {}: they are used again from the first, in order",
                requests as i64 * batch
            )),
            _ => None,
        }
    }

    /// Each sample's image file, for image inputs.
    pub fn sample_files(&self) -> Option<SampleFiles> {
        match self {
            Self::File { names: Some(names), batch, .. } => Some(SampleFiles { names: names.clone(), batch: *batch }),
            _ => None,
        }
    }

    /// The input boundary of request `index`.
    pub fn batch(&self, index: u64) -> Boundary {
        match self {
            Self::Synthetic { specs, sizes, seed } => {
                // A generator of our own per request: libtorch's global one is shared by every
                // thread, so seeding it would not make inputs reproducible under concurrency.
                let mut rng = StdRng::seed_from_u64((*seed as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(index));
                let values = specs
                    .iter()
                    .map(|InputSpec { name, spec, range }| {
                        let shape: Vec<i64> = spec.shape.iter().map(|d| d.at(*sizes).unwrap_or(1)).collect();
                        let numel = shape.iter().product::<i64>().max(0) as usize;
                        let t = match spec.dtype.kind() {
                            k @ (Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16) => {
                                let data: Vec<f32> = (0..numel).map(|_| rng.sample(StandardNormal)).collect();
                                Tensor::from_slice(&data).view(shape.as_slice()).to_kind(k)
                            }
                            // Boolean inputs (masks) are all false: nothing is masked.
                            Kind::Bool => Tensor::zeros(shape.as_slice(), (Kind::Bool, Device::Cpu)),
                            // Integer inputs (token ids, labels) within their range (an attention
                            // mask, 0..=1, all ones: every token attended), or small, so any
                            // vocabulary takes them.
                            k => {
                                let (lo, hi) = match *range {
                                    Some((lo, hi)) if hi - lo == 1 => (hi, hi),
                                    Some(range) => range,
                                    None => (0, 9),
                                };
                                let data: Vec<i64> = (0..numel).map(|_| rng.gen_range(lo..=hi)).collect();
                                Tensor::from_slice(&data).view(shape.as_slice()).to_kind(k)
                            }
                        };
                        (name.clone(), Value::Tensor(t))
                    })
                    .collect();
                Boundary { values }
            }
            Self::File { tensors, rows, batch, .. } => {
                let idx: Vec<i64> = row_indices(index, *batch, *rows).collect();
                let idx = Tensor::from_slice(&idx);
                Boundary { values: tensors.iter().map(|(n, t)| (n.clone(), Value::Tensor(t.index_select(0, &idx)))).collect() }
            }
        }
    }
}
