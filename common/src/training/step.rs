//! The math of one training step, which the edge and the server both run on their parts:
//! the model's output tensor and its loss, and the backward pass of a part, either from
//! the loss or from the gradient another process sent for the boundary this part produced.
//! Each part ends with the gradients of its parameters (for its optimizer) and of the
//! boundary it received (to send back to the part before it).

use tch::Tensor;

use super::loss::LossKind;
use super::{gradient_boundary, gradients, vjp_root, TrainError};
use crate::bundle::Bundle;
use crate::value::{Boundary, Value};

/// Named tensors (boundary leaves, parameters).
pub type Named = [(String, Tensor)];

/// One gradient slot per tensor; `None` where the loss does not depend on it.
pub type Grads = Vec<Option<Tensor>>;

/// What a part's backward pass yields.
#[derive(Debug)]
pub struct PartGradients {
    /// The gradient of each parameter, in the order given.
    pub parameters: Grads,
    /// The gradient at the boundary the part received: one tensor per floating-point leaf,
    /// named like it (zeros where the loss does not depend on it).
    pub boundary: Boundary,
}

/// The model's output from the boundary at the last cut: training needs one tensor, the
/// output itself, its only tensor (a transformers model's dict of `logits`), or the one
/// named `logits` among several.
pub fn output_tensor(bundle: &Bundle, last: Boundary) -> Result<Tensor, TrainError> {
    let output = bundle.assemble_output(last)?;
    let picked = match &output {
        Value::Tensor(t) => Some(t),
        Value::Dict(items) => {
            let logits = items.iter().find(|(k, _)| k == "logits");
            logits.or(if items.len() == 1 { items.first() } else { None }).and_then(|(_, v)| v.as_tensor())
        }
        Value::Tuple(items) | Value::List(items) if items.len() == 1 => items[0].as_tensor(),
        _ => None,
    };
    picked
        .map(Tensor::shallow_clone)
        .ok_or_else(|| TrainError::Loss(format!("the model's output is {}; the loss needs one tensor (or one named logits)", output.describe())))
}

/// The loss of a step: the model's output (from the boundary at the last cut) against the targets.
pub fn step_loss(bundle: &Bundle, loss: LossKind, last: Boundary, targets: &Tensor) -> Result<Tensor, TrainError> {
    loss.compute(&output_tensor(bundle, last)?, targets)
}

/// Backward from `root` (a loss, or the root [`vjp_root`] builds) into `parameters` and the
/// received boundary's `leaves`; with no root, nothing depends on them.
pub fn backward(root: Option<&Tensor>, parameters: &Named, leaves: &Named) -> Result<PartGradients, TrainError> {
    let mut inputs: Vec<Tensor> = parameters.iter().map(|(_, p)| p.shallow_clone()).collect();
    inputs.extend(leaves.iter().map(|(_, t)| t.shallow_clone()));
    let mut grads = match root {
        Some(root) => gradients(root, &inputs)?,
        None => inputs.iter().map(|_| None).collect(),
    };
    let leaf_grads = grads.split_off(parameters.len());
    Ok(PartGradients { parameters: grads, boundary: gradient_boundary(leaves, leaf_grads) })
}

/// Continues a backward pass another process started: `grads` is the gradient at the
/// part's `outputs` (the floating-point leaves of the boundary it sent on).
pub fn backward_from_boundary(outputs: &Named, grads: &Boundary, parameters: &Named, leaves: &Named) -> Result<PartGradients, TrainError> {
    let root = vjp_root(outputs, grads)?;
    backward(root.as_ref(), parameters, leaves)
}
