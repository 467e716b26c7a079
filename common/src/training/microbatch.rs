//! Micro-batches: a step's batch cut into parts that each run forward and backward on both
//! sides, their gradients summed before the one optimizer step.

use tch::Tensor;

use super::error::{StepError, TrainError};
use super::seeding::microbatch_seed;

/// Where a training forward pass is in its step: micro-batch `index` of `count`, its loss
/// weighed by `weight` (its share of the step's samples). The weighed losses of a step's
/// micro-batches add up to the mean loss of the whole batch, and so do their gradients, which
/// each side sums before it steps once (as `loss.backward()` per micro-batch sums into
/// `.grad` in PyTorch). Batch norm is the one thing that differs from one batch of the same
/// samples: it normalises each micro-batch by its own statistics and updates its running
/// statistics once per micro-batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Microbatch {
    /// Its place in the step (0 for the first).
    pub index: u32,
    /// The step's micro-batches.
    pub count: u32,
    /// Its share of the step's samples, in (0, 1].
    pub weight: f64,
}

impl Microbatch {
    /// A step of one batch.
    pub const WHOLE: Self = Self { index: 0, count: 1, weight: 1.0 };

    /// Micro-batch `index` of `count`, weighing `weight`; checked.
    pub fn new(index: u32, count: u32, weight: f64) -> Result<Self, TrainError> {
        if index >= count {
            return Err(StepError::MicrobatchOutOfRange { index, count }.into());
        }
        if !(weight > 0.0 && weight <= 1.0) {
            return Err(TrainError::Loss(format!("a micro-batch's loss weight must be in (0, 1], got {weight}")));
        }
        Ok(Self { index, count, weight })
    }

    /// Whether the step's gradients are complete with this one.
    pub fn is_last(&self) -> bool {
        self.index + 1 == self.count
    }

    /// The loss this micro-batch adds to the step's (the loss itself for a whole batch).
    pub fn weigh(&self, loss: &Tensor) -> Tensor {
        if self.weight == 1.0 {
            loss.shallow_clone()
        } else {
            loss * self.weight
        }
    }

    /// The session seed its dropout masks draw from: the session's own for the first
    /// micro-batch (so a step of one batch draws what it always drew), another for each other.
    pub fn seed(&self, seed: u64) -> u64 {
        microbatch_seed(seed, self.index)
    }
}

/// Adds a micro-batch's gradients to the step's so far, slot by slot.
pub fn accumulate(sum: &mut Option<Vec<Option<Tensor>>>, grads: Vec<Option<Tensor>>) {
    let Some(sum) = sum else {
        *sum = Some(grads);
        return;
    };
    tch::no_grad(|| {
        for (s, g) in sum.iter_mut().zip(grads) {
            match (s.as_mut(), g) {
                (Some(s), Some(g)) => {
                    let _ = s.g_add_(&g);
                }
                (None, Some(g)) => *s = Some(g),
                (_, None) => {}
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn micro_batches_are_checked_and_their_gradients_add_up() {
        assert!(Microbatch::new(2, 2, 0.5).unwrap_err().to_string().contains("micro-batch 2 of 2"));
        for bad in [0.0, 1.5, f64::NAN] {
            assert!(Microbatch::new(0, 2, bad).is_err(), "{bad}");
        }
        let last = Microbatch::new(1, 2, 0.25).unwrap();
        assert!(last.is_last() && !Microbatch::new(0, 2, 0.75).unwrap().is_last());
        assert_eq!(last.weigh(&Tensor::from(2.0f64)).double_value(&[]), 0.5);
        assert_eq!(Microbatch::WHOLE.seed(7), 7);
        assert_ne!(last.seed(7), 7);
        let mut sum = None;
        accumulate(&mut sum, vec![Some(Tensor::from_slice(&[1.0f32, 2.0])), None, None]);
        accumulate(&mut sum, vec![Some(Tensor::from_slice(&[0.5f32, 0.5])), Some(Tensor::from_slice(&[3.0f32])), None]);
        let sum = sum.unwrap();
        assert_eq!(Vec::<f32>::try_from(sum[0].as_ref().unwrap()).unwrap(), [1.5, 2.5]);
        assert_eq!(Vec::<f32>::try_from(sum[1].as_ref().unwrap()).unwrap(), [3.0]);
        assert!(sum[2].is_none());
    }
}
