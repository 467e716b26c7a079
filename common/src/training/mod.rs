//! Training a range of stages: the part of split training that the host and the server share.
//!
//! - [`TrainableStages`]: stages loaded in training mode with their parameters and buffers;
//!   a forward pass keeps its autograd graph, so the side that ran it can backpropagate the
//!   gradients that come back later (the prefix is never recomputed).
//! - [`optim`]: SGD (momentum, dampening, Nesterov, weight decay), Adam and AdamW, written
//!   after PyTorch's single-tensor implementations, with their state exposed for checkpoints.
//! - [`microbatch`]: a step's batch in micro-batches, their gradients summed (gradient
//!   accumulation), each with dropout masks of its own.
//! - [`schedule`]: the learning rate step by step (warm-up, step and cosine decay) and global
//!   gradient-norm clipping across the split, each side computing the same number.
//! - [`loss`]: cross-entropy and mean squared error, as `torch.nn.functional` computes them.
//! - [`checkpoint`]: parameters, buffers and optimizer state in a safetensors file.
//! - [`step`]: the step math both sides run: the output and its loss, and a part's backward
//!   pass from the loss or from the gradient another process sent ([`gradients`], [`vjp_root`]).
//!
//! Dropout masks are a function of (session seed, step, stage index): before stage `i` runs
//! in training step `t`, the generator is seeded with [`stage_seed`]. Masks therefore do not
//! depend on where the model is split or on which process runs a stage, which is what lets
//! split training give the same model as training in one process.

pub mod checkpoint;
mod error;
pub mod loss;
pub mod microbatch;
pub mod optim;
pub mod schedule;
mod seeding;
pub mod step;
mod trainable;

use tch::Tensor;

use crate::value::{Boundary, Value};

pub use error::{OptimizerError, ScheduleError, SetupError, StateError, StepError, TrainError};
pub use seeding::stage_seed;
pub use trainable::TrainableStages;

/// Name of the extra value that carries the targets in a training step's payload. The `@`
/// keeps it apart from every value name the exporter writes (Python identifiers).
pub const TARGETS_VALUE: &str = "@targets";

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
