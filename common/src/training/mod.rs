//! Training a range of stages: the part of split training that the host and the server share.
//!
//! - [`TrainableStages`]: stages loaded in training mode with their parameters and buffers;
//!   a forward pass keeps its autograd graph, so the side that ran it can backpropagate the
//!   gradients that come back later (the prefix is never recomputed).
//! - [`optim`]: SGD (momentum, dampening, Nesterov, weight decay), Adam and AdamW, written
//!   after PyTorch's single-tensor implementations, with their state exposed for checkpoints.
//! - [`loss`]: cross-entropy and mean squared error, as `torch.nn.functional` computes them.
//! - [`checkpoint`]: parameters, buffers and optimizer state in a safetensors file.
//! - [`export`]: trained weights written back into a bundle for split inference.
//! - [`gradients`] and [`vjp_root`]: the two backward passes every side runs: from a loss,
//!   or from the gradients of a boundary that another process computed.
//!
//! Dropout masks are a function of (session seed, step, stage index): before stage `i` runs
//! in training step `t`, the generator is seeded with [`stage_seed`]. Masks therefore do not
//! depend on where the model is split or on which process runs a stage, which is what lets
//! split training give the same model as training in one process.

pub mod checkpoint;
pub mod export;
pub mod loss;
pub mod optim;
mod trainable;

use std::sync::{Mutex, MutexGuard};

use tch::Tensor;

use crate::error::BundleError;
use crate::value::{Boundary, Value};

pub use trainable::TrainableStages;

/// Name of the extra value that carries the targets in a training step's payload. The `@`
/// keeps it apart from every value name the exporter writes (Python identifiers).
pub const TARGETS_VALUE: &str = "@targets";

/// Why a training step, or setting one up, failed.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// Loading or running the stages failed, or a boundary does not fit the manifest.
    #[error(transparent)]
    Bundle(#[from] BundleError),
    /// The bundle cannot be trained as it is.
    #[error("the bundle cannot be trained: {0}")]
    NotTrainable(String),
    /// A configuration value that cannot work (optimizer, loss, split).
    #[error("{0}")]
    Invalid(String),
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
    /// A checkpoint cannot be written or read, or does not fit these stages.
    #[error("checkpoint {path}: {message}")]
    Checkpoint {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong.
        message: String,
    },
}

impl TrainError {
    pub(crate) fn torch(step: &'static str, err: tch::TchError) -> Self {
        let text = err.to_string();
        let message = text.lines().find(|l| !l.trim().is_empty()).unwrap_or(&text).trim().to_string();
        Self::Torch { step, message }
    }
}

/// The seed of stage `stage`'s random draws (dropout) in training step `step` of a session
/// seeded with `seed` (SplitMix64 over the three, so nearby inputs give unrelated seeds).
pub fn stage_seed(seed: u64, step: u64, stage: usize) -> i64 {
    let mut z = seed ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (stage as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ((z ^ (z >> 31)) >> 1) as i64
}

/// libtorch's default generator is process-wide: a training stage holds this lock from
/// seeding it to the end of its forward pass, so that two parts training in one process
/// (`--loopback`) cannot interleave their draws.
static GENERATOR: Mutex<()> = Mutex::new(());

pub(crate) fn seeded_generator(seed: i64) -> MutexGuard<'static, ()> {
    let guard = GENERATOR.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    tch::manual_seed(seed);
    guard
}

/// The floating-point tensors of a boundary, with their wire names: the ones that can carry
/// a gradient.
pub fn float_leaves(boundary: &Boundary) -> Vec<(String, Tensor)> {
    boundary.tensors().into_iter().filter(|(_, t)| t.is_floating_point()).map(|(n, t)| (n, t.shallow_clone())).collect()
}

/// Makes the floating-point tensors of a received boundary leaves that record their
/// gradient; returns them with their names.
pub fn track_gradients(boundary: &Boundary) -> Vec<(String, Tensor)> {
    float_leaves(boundary).into_iter().map(|(n, t)| (n, t.set_requires_grad(true))).collect()
}

/// The gradients of the scalar `root` with respect to `inputs`, without touching any
/// `.grad` (like `torch.autograd.grad`); an input `root` does not depend on gets `None`,
/// as PyTorch leaves such a parameter's gradient at `None` and its optimizer skips it.
pub fn gradients(root: &Tensor, inputs: &[Tensor]) -> Result<Vec<Option<Tensor>>, TrainError> {
    let tracked: Vec<usize> = (0..inputs.len()).filter(|&i| inputs[i].requires_grad()).collect();
    let mut out: Vec<Option<Tensor>> = (0..inputs.len()).map(|_| None).collect();
    if tracked.is_empty() || !root.requires_grad() {
        return Ok(out);
    }
    let picked: Vec<&Tensor> = tracked.iter().map(|&i| &inputs[i]).collect();
    let grads = Tensor::f_run_backward(&[root], &picked, false, false).map_err(|e| TrainError::torch("backward", e))?;
    for (i, g) in tracked.into_iter().zip(grads) {
        out[i] = g.defined().then_some(g);
    }
    Ok(out)
}

/// The scalar whose gradient is `grads` at `outputs`: `sum_i (output_i * grad_i).sum()`.
/// Backpropagating it hands every output exactly its gradient (the product's derivative is
/// the gradient times one), so a side can continue a backward pass another process started.
/// `None` when no output is part of a graph.
pub fn vjp_root(outputs: &[(String, Tensor)], grads: &Boundary) -> Result<Option<Tensor>, TrainError> {
    let grads = gradient_map(grads, outputs)?;
    let mut root: Option<Tensor> = None;
    for ((_, out), grad) in outputs.iter().zip(grads) {
        if !out.requires_grad() {
            continue;
        }
        let term = (out * grad.to_device(out.device())).sum(out.kind());
        root = Some(match root {
            None => term,
            Some(r) => r + term,
        });
    }
    Ok(root)
}

/// A boundary of gradients: one tensor per floating-point leaf, named like the leaf.
pub fn gradient_boundary(leaves: &[(String, Tensor)], grads: Vec<Option<Tensor>>) -> Boundary {
    let values = leaves
        .iter()
        .zip(grads)
        .map(|((name, leaf), grad)| (name.clone(), Value::Tensor(grad.unwrap_or_else(|| leaf.zeros_like()).detach())))
        .collect();
    Boundary { values }
}

/// Checks that `grads` holds one gradient per leaf of `leaves`, same names, order and shapes,
/// and returns them in that order.
fn gradient_map(grads: &Boundary, leaves: &[(String, Tensor)]) -> Result<Vec<Tensor>, TrainError> {
    let got = grads.tensors();
    if got.len() != leaves.len() {
        return Err(TrainError::Gradients(format!(
            "{} gradient tensors for {} floating-point boundary tensors ({})",
            got.len(),
            leaves.len(),
            leaves.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>().join(", ")
        )));
    }
    got.into_iter()
        .zip(leaves)
        .map(|((gname, g), (name, leaf))| {
            if &gname != name {
                return Err(TrainError::Gradients(format!("expected the gradient of {name}, got {gname}")));
            }
            if g.size() != leaf.size() || g.kind() != leaf.kind() {
                return Err(TrainError::Gradients(format!(
                    "the gradient of {name} is {:?} {:?}; the tensor is {:?} {:?}",
                    g.kind(),
                    g.size(),
                    leaf.kind(),
                    leaf.size()
                )));
            }
            Ok(g.shallow_clone())
        })
        .collect()
}

/// Splits the targets off a training step's boundary.
pub fn take_targets(boundary: &mut Boundary) -> Option<Tensor> {
    let at = boundary.values.iter().position(|(name, _)| name == TARGETS_VALUE)?;
    match boundary.values.remove(at).1 {
        Value::Tensor(t) => Some(t),
        _ => None,
    }
}
