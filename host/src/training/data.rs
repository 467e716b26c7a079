//! Training data: a safetensors file with tensors named like the bundle's inputs and one
//! holding the targets, all with the same number of rows; batches in a seeded order.

use std::path::Path;

use cleave_common::spec::ValueSpec;
use cleave_common::{Boundary, Bundle, Value};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use tch::Tensor;

use crate::error::{HostError, InputError, Result};

/// A dataset held in memory.
pub(crate) struct Dataset {
    inputs: Vec<(String, Tensor)>,
    targets: Tensor,
    rows: i64,
}

impl Dataset {
    /// Reads `path`: the bundle's inputs by name and the `targets` tensor.
    pub(crate) fn load(path: &Path, bundle: &Bundle, targets: &str) -> Result<Self> {
        crate::files::require("dataset", path)?;
        let tensors = Tensor::read_safetensors(path).map_err(|error| HostError::TensorFile {
            what: "cannot read training data",
            path: path.to_path_buf(),
            error,
        })?;
        let take = |name: &str| {
            tensors.iter().find(|(n, _)| n == name).map(|(_, t)| t.shallow_clone()).ok_or_else(|| {
                let names: Vec<&str> = tensors.iter().map(|(n, _)| n.as_str()).collect();
                HostError::File { path: path.to_path_buf(), message: format!("no tensor {name:?} (it holds {})", names.join(", ")) }
            })
        };
        let mut inputs = Vec::new();
        for input in &bundle.manifest().inputs {
            if !matches!(input.spec, ValueSpec::Tensor(_)) {
                return Err(InputError::NotATensor { name: input.name.clone(), kind: input.spec.describe(), reader: "training" }.into());
            }
            inputs.push((input.name.clone(), take(&input.name)?));
        }
        let targets = take(targets)?;
        let rows = targets.size().first().copied().unwrap_or(0);
        if rows == 0 {
            return Err(HostError::File { path: path.to_path_buf(), message: "the targets have no rows".into() });
        }
        for (name, t) in &inputs {
            if t.size().first() != Some(&rows) {
                return Err(HostError::File {
                    path: path.to_path_buf(),
                    message: format!("{name} has {:?} rows, the targets {rows}", t.size().first()),
                });
            }
        }
        Ok(Self { inputs, targets, rows })
    }

    /// Rows in the set.
    pub(crate) fn rows(&self) -> i64 {
        self.rows
    }

    /// The row order of `epoch` (0-based): a permutation seeded by (seed, epoch), or the
    /// file's order without a seed. The same for every run with the same seed, so a resumed
    /// run and the monolithic reference see the batches a split run sees.
    pub(crate) fn order(&self, seed: Option<u64>, epoch: usize) -> Vec<i64> {
        let mut rows: Vec<i64> = (0..self.rows).collect();
        if let Some(seed) = seed {
            let mut rng = StdRng::seed_from_u64(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ epoch as u64);
            rows.shuffle(&mut rng);
        }
        rows
    }

    /// The inputs (cut 0) and targets of `rows`.
    pub(crate) fn batch(&self, rows: &[i64]) -> (Boundary, Tensor) {
        let index = Tensor::from_slice(rows);
        let values = self.inputs.iter().map(|(n, t)| (n.clone(), Value::Tensor(t.index_select(0, &index)))).collect();
        (Boundary { values }, self.targets.index_select(0, &index))
    }
}
