//! What changes from step to step on both sides of a split: the learning rate
//! ([`Schedule`]) and global gradient-norm clipping ([`tensor_norms`], [`clip_coefficient`]).
//!
//! The learning rate of step `t` depends only on `t`, which both sides count. The clipping
//! coefficient depends on the norms of every gradient of the model: the server sends its
//! gradients' norms with each step's answer, the host (which holds the others) computes the
//! coefficient and sends it back, and both scale their own gradients by it. PyTorch rounds
//! the coefficient in float32 from the list of norms in the model's order, and Adam turns a
//! last-bit difference in a gradient that is rounding noise (a bias ahead of batch norm)
//! into a visible one, so the coefficient is computed once, from that list, as PyTorch does.

use super::step::Grads;
use super::ScheduleError;
use serde::{Deserialize, Serialize};
use tch::Tensor;

/// The learning rate over the steps, as written in YAML: an optional linear warm-up, then a
/// decay (`constant` when none is given). The same as PyTorch's
/// `SequentialLR([LinearLR(start_factor, 1.0, warmup.steps), decay], milestones=[warmup.steps])`
/// with `StepLR(step_size, gamma)` or `CosineAnnealingLR(total_steps, min_lr)` as the decay,
/// stepped once per optimizer step; past its `total_steps` the cosine stays at `min_lr`
/// (PyTorch's would rise again).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Schedule {
    /// Ramps the learning rate up from `start_factor x lr` to `lr` over the first steps.
    #[serde(default)]
    pub warmup: Option<Warmup>,
    /// What the learning rate does after the warm-up.
    #[serde(default)]
    pub decay: Decay,
}

/// A linear warm-up.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Warmup {
    /// Steps it lasts.
    pub steps: u64,
    /// The fraction of `lr` of the first step (PyTorch's `LinearLR` default, 1/3).
    #[serde(default = "one_third")]
    pub start_factor: f64,
}

fn one_third() -> f64 {
    1.0 / 3.0
}

/// The learning rate after the warm-up, counting steps from its end.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum Decay {
    /// `lr` throughout.
    #[default]
    Constant,
    /// `lr x gamma^(t / step_size)` (`StepLR`).
    Step {
        /// Steps between two decays.
        step_size: u64,
        /// The factor of each.
        gamma: f64,
    },
    /// From `lr` down to `min_lr` along half a cosine over `total_steps` (`CosineAnnealingLR`).
    Cosine {
        /// Steps from `lr` to `min_lr`.
        total_steps: u64,
        /// Where it ends.
        #[serde(default)]
        min_lr: f64,
    },
}

impl Schedule {
    /// Checks the values PyTorch would refuse; the error names the field.
    pub fn validate(&self) -> Result<(), ScheduleError> {
        if let Some(w) = &self.warmup {
            if w.steps == 0 {
                return Err(ScheduleError::Zero { field: "warmup.steps" });
            }
            if !(w.start_factor > 0.0 && w.start_factor <= 1.0) {
                return Err(ScheduleError::StartFactor(w.start_factor));
            }
        }
        match self.decay {
            Decay::Constant => Ok(()),
            Decay::Step { step_size, gamma } => {
                if step_size == 0 {
                    return Err(ScheduleError::Zero { field: "decay.step_size" });
                }
                if !(gamma.is_finite() && gamma > 0.0) {
                    return Err(ScheduleError::NotPositive { field: "decay.gamma", value: gamma });
                }
                Ok(())
            }
            Decay::Cosine { total_steps, min_lr } => {
                if total_steps == 0 {
                    return Err(ScheduleError::Zero { field: "decay.total_steps" });
                }
                if !(min_lr.is_finite() && min_lr >= 0.0) {
                    return Err(ScheduleError::NotPositive { field: "decay.min_lr", value: min_lr });
                }
                Ok(())
            }
        }
    }

    /// The learning rate of step `step` (0 for the first) from the base rate `lr`.
    pub fn lr(&self, lr: f64, step: u64) -> f64 {
        let warmup_steps = match &self.warmup {
            Some(w) if step < w.steps => return lr * (w.start_factor + (1.0 - w.start_factor) * step as f64 / w.steps as f64),
            Some(w) => w.steps,
            None => 0,
        };
        let t = step - warmup_steps;
        match self.decay {
            Decay::Constant => lr,
            Decay::Step { step_size, gamma } => lr * gamma.powi((t / step_size).min(i32::MAX as u64) as i32),
            Decay::Cosine { total_steps, min_lr } => {
                let t = t.min(total_steps) as f64;
                min_lr + (lr - min_lr) * (1.0 + (std::f64::consts::PI * t / total_steps as f64).cos()) / 2.0
            }
        }
    }
}

/// Checks a clipping norm: a finite number above 0.
pub fn check_clip_norm(max_norm: f64) -> Result<f64, ScheduleError> {
    if max_norm.is_finite() && max_norm > 0.0 {
        Ok(max_norm)
    } else {
        Err(ScheduleError::ClipNorm(max_norm))
    }
}

/// The L2 norm of each gradient, in order (`None` slots are left out, as
/// `torch.nn.utils.clip_grad_norm_` leaves out parameters without a gradient), each in the
/// gradient's own dtype as PyTorch takes it.
pub fn tensor_norms(grads: &Grads) -> Vec<f32> {
    // Stacked on their device and read back at once: one synchronisation, not one a tensor.
    let norms: Vec<Tensor> = grads.iter().flatten().map(|g| g.norm().to_kind(tch::Kind::Float)).collect();
    if norms.is_empty() {
        return Vec::new();
    }
    Vec::<f32>::try_from(Tensor::stack(&norms, 0).to_device(tch::Device::Cpu)).expect("a float32 vector reads as one")
}

/// What `torch.nn.utils.clip_grad_norm_(max_norm)` multiplies every gradient by, from the
/// norms of all of them in the model's order, rounded as PyTorch rounds it (float32: the
/// norm of the stacked norms, `max_norm / (total + 1e-6)` as a reciprocal times `max_norm`,
/// at most 1). Err: the total norm, when it is not finite (PyTorch would scale every
/// gradient to NaN). The norms' order matters to the last bit, so both sides of a split
/// compute it from the same list.
pub fn clip_coefficient(max_norm: f64, norms: &[f32]) -> Result<f32, f32> {
    let total = Tensor::from_slice(norms).norm();
    let total_value = total.double_value(&[]) as f32;
    if !total_value.is_finite() {
        return Err(total_value);
    }
    let coefficient = ((total + 1e-6).reciprocal() * max_norm).clamp_max(1.0);
    Ok(coefficient.double_value(&[]) as f32)
}

/// Multiplies every gradient by `coefficient` in place (nothing to do at 1).
pub fn scale(grads: &Grads, coefficient: f32) {
    if coefficient < 1.0 {
        tch::no_grad(|| {
            for g in grads.iter().flatten() {
                let _ = g.shallow_clone().g_mul_scalar_(f64::from(coefficient));
            }
        });
    }
}

/// Checks a clipping coefficient another process computed: a number in [0, 1] (0 where a
/// tiny `max_norm` over the gradients' norm underflows float32, as it would in PyTorch).
pub fn check_coefficient(coefficient: f32) -> Result<f32, ScheduleError> {
    if (0.0..=1.0).contains(&coefficient) {
        Ok(coefficient)
    } else {
        Err(ScheduleError::Coefficient(coefficient))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(yaml: &str) -> Schedule {
        let s: Schedule = serde_yaml::from_str(yaml).unwrap();
        s.validate().unwrap();
        s
    }

    #[test]
    fn warmup_then_cosine_follows_the_closed_forms() {
        let s = schedule("{ warmup: { steps: 4, start_factor: 0.25 }, decay: { kind: cosine, total_steps: 10, min_lr: 0.001 } }");
        let lrs: Vec<f64> = (0..16).map(|t| s.lr(0.1, t)).collect();
        for (t, expected) in [0.025, 0.04375, 0.0625, 0.08125].iter().enumerate() {
            assert!((lrs[t] - expected).abs() < 1e-15, "warm-up step {t}: {}", lrs[t]);
        }
        assert_eq!(lrs[4], 0.1, "the decay starts at lr");
        let mid = 0.001 + (0.1 - 0.001) * 0.5;
        assert!((lrs[9] - mid).abs() < 1e-15, "half-way down: {}", lrs[9]);
        assert!((lrs[14] - 0.001).abs() < 1e-15 && lrs[15] == lrs[14], "it rests at min_lr: {:?}", &lrs[14..]);
        assert!(lrs.windows(2).skip(4).all(|w| w[1] <= w[0]), "falls after the warm-up: {lrs:?}");
    }

    #[test]
    fn step_decay_multiplies_by_gamma_every_step_size_steps() {
        let s = schedule("{ decay: { kind: step, step_size: 3, gamma: 0.5 } }");
        let lrs: Vec<f64> = (0..7).map(|t| s.lr(0.2, t)).collect();
        assert_eq!(lrs, [0.2, 0.2, 0.2, 0.1, 0.1, 0.1, 0.05]);
        assert_eq!(Schedule::default().lr(0.3, 1_000_000), 0.3);
    }

    #[test]
    fn a_schedule_pytorch_would_refuse_names_its_field() {
        for (yaml, field) in [
            ("{ warmup: { steps: 0 } }", "warmup.steps"),
            ("{ warmup: { steps: 3, start_factor: 0 } }", "start_factor"),
            ("{ warmup: { steps: 3, start_factor: 1.5 } }", "start_factor"),
            ("{ decay: { kind: step, step_size: 0, gamma: 0.1 } }", "decay.step_size"),
            ("{ decay: { kind: step, step_size: 2, gamma: -1 } }", "decay.gamma"),
            ("{ decay: { kind: cosine, total_steps: 0 } }", "decay.total_steps"),
            ("{ decay: { kind: cosine, total_steps: 5, min_lr: .nan } }", "decay.min_lr"),
        ] {
            let s: Schedule = serde_yaml::from_str(yaml).unwrap();
            let e = s.validate().unwrap_err().to_string();
            assert!(e.contains(field), "{yaml}: {e}");
        }
        assert!(serde_yaml::from_str::<Schedule>("{ decay: { kind: exponential } }").is_err());
        assert!(serde_yaml::from_str::<Schedule>("{ warmup: { steps: 2, factor: 0.1 } }").is_err());
    }

    #[test]
    fn the_coefficient_is_pytorch_s_from_the_norms_of_both_sides() {
        let a: Grads = vec![Some(Tensor::from_slice(&[3.0f32, 4.0])), None];
        let b: Grads = vec![Some(Tensor::from_slice(&[12.0f32]))];
        // |(3, 4, 12)| = 13: every gradient is scaled by 6.5 / (13 + 1e-6), in float32.
        let norms: Vec<f32> = tensor_norms(&a).into_iter().chain(tensor_norms(&b)).collect();
        assert_eq!(norms, [5.0, 12.0]);
        let coefficient = clip_coefficient(6.5, &norms).unwrap();
        assert_eq!(coefficient, 6.5f32 * (1.0 / (13.0f32 + 1e-6)));
        scale(&a, coefficient);
        scale(&b, coefficient);
        let got = Tensor::cat(&[a[0].as_ref().unwrap(), b[0].as_ref().unwrap()], 0);
        let expected = Tensor::from_slice(&[3.0f32, 4.0, 12.0]) * f64::from(coefficient);
        assert!(got.equal(&expected));
        // Under the limit the coefficient is 1 and nothing changes.
        assert_eq!(clip_coefficient(100.0, &norms), Ok(1.0));
        // A norm that is not finite cannot be clipped; a coefficient outside [0, 1] is refused.
        assert!(clip_coefficient(1.0, &[f32::INFINITY, 1.0]).is_err());
        assert!(clip_coefficient(1.0, &[f32::NAN]).is_err());
        for bad in [-0.5, 1.5, f32::NAN, f32::INFINITY] {
            assert!(check_coefficient(bad).is_err(), "{bad}");
        }
        assert_eq!((check_coefficient(0.25), check_coefficient(0.0)), (Ok(0.25), Ok(0.0)));
    }
}
