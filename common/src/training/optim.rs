//! Optimizers, after PyTorch's single-tensor (for-loop) implementations in
//! `torch/optim/sgd.py` and `torch/optim/adam.py`, operation for operation, so that a step
//! here rounds like a step there. They are written out (rather than taken from tch, which
//! wraps libtorch's C++ optimizers) because checkpoints need their state, which tch does
//! not expose.
//!
//! Each parameter's update depends only on its own gradient and state, so the host and the
//! server can each step their own part and the union is the step of the whole model.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use tch::Tensor;

use super::{OptimizerError, StateError};

/// An optimizer and its hyper-parameters, as written in YAML (`kind: sgd | adam | adamw`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum OptimizerConfig {
    /// `torch.optim.SGD`.
    Sgd {
        /// Learning rate.
        lr: f64,
        /// Momentum factor (0: plain SGD).
        #[serde(default)]
        momentum: f64,
        /// Dampening of the momentum.
        #[serde(default)]
        dampening: f64,
        /// L2 penalty added to the gradient.
        #[serde(default)]
        weight_decay: f64,
        /// Nesterov momentum.
        #[serde(default)]
        nesterov: bool,
    },
    /// `torch.optim.Adam` (weight decay added to the gradient).
    Adam {
        /// Learning rate.
        lr: f64,
        /// Decay rates of the first and second moment estimates.
        #[serde(default = "default_betas")]
        betas: [f64; 2],
        /// Added to the denominator.
        #[serde(default = "default_eps")]
        eps: f64,
        /// L2 penalty added to the gradient.
        #[serde(default)]
        weight_decay: f64,
    },
    /// `torch.optim.AdamW` (decoupled weight decay).
    Adamw {
        /// Learning rate.
        lr: f64,
        /// Decay rates of the first and second moment estimates.
        #[serde(default = "default_betas")]
        betas: [f64; 2],
        /// Added to the denominator.
        #[serde(default = "default_eps")]
        eps: f64,
        /// Decoupled weight decay (PyTorch's default is 0.01).
        #[serde(default = "default_adamw_decay")]
        weight_decay: f64,
    },
}

fn default_betas() -> [f64; 2] {
    [0.9, 0.999]
}
fn default_eps() -> f64 {
    1e-8
}
fn default_adamw_decay() -> f64 {
    1e-2
}

impl OptimizerConfig {
    /// `sgd`, `adam` or `adamw`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Sgd { .. } => "sgd",
            Self::Adam { .. } => "adam",
            Self::Adamw { .. } => "adamw",
        }
    }

    /// The learning rate.
    pub fn lr(&self) -> f64 {
        match self {
            Self::Sgd { lr, .. } | Self::Adam { lr, .. } | Self::Adamw { lr, .. } => *lr,
        }
    }

    /// Checks the values PyTorch would refuse; the error names the field.
    pub fn validate(&self) -> Result<(), OptimizerError> {
        let finite_non_negative = |field: &'static str, value: f64| {
            if value.is_finite() && value >= 0.0 {
                Ok(())
            } else {
                Err(OptimizerError::Negative { field, value })
            }
        };
        if !(self.lr().is_finite() && self.lr() > 0.0) {
            return Err(OptimizerError::Lr(self.lr()));
        }
        match self {
            Self::Sgd { momentum, dampening, weight_decay, nesterov, .. } => {
                finite_non_negative("momentum", *momentum)?;
                finite_non_negative("dampening", *dampening)?;
                finite_non_negative("weight_decay", *weight_decay)?;
                if *nesterov && (*momentum <= 0.0 || *dampening != 0.0) {
                    return Err(OptimizerError::Nesterov);
                }
            }
            Self::Adam { betas, eps, weight_decay, .. } | Self::Adamw { betas, eps, weight_decay, .. } => {
                for (index, &value) in betas.iter().enumerate() {
                    if !(0.0..1.0).contains(&value) {
                        return Err(OptimizerError::Beta { index, value });
                    }
                }
                finite_non_negative("eps", *eps)?;
                finite_non_negative("weight_decay", *weight_decay)?;
            }
        }
        Ok(())
    }
}

/// `a + alpha * b` rounded as PyTorch's `a.add(b, alpha=alpha)` rounds it. Its CPU kernel
/// fuses the multiply and the add (one rounding); computing `b * alpha` first rounds twice,
/// and those last-bit differences grow into 1e-4 after 20 Adam steps (gradients that are
/// pure rounding noise, like a bias before batch norm, are rescaled to steps of size lr).
/// `addcmul` with a 0-dim tensor factor takes the same fused path.
fn add_scaled(a: &Tensor, b: &Tensor, alpha: f64) -> Tensor {
    a.addcmul(b, &Tensor::from(alpha))
}

/// The state an optimizer keeps for one parameter.
#[derive(Debug)]
enum ParamState {
    Sgd { momentum_buffer: Tensor },
    Adam { step: u64, exp_avg: Tensor, exp_avg_sq: Tensor },
}

/// An optimizer over named parameters, with its per-parameter state.
#[derive(Debug)]
pub struct Optimizer {
    config: OptimizerConfig,
    state: HashMap<String, ParamState>,
}

impl Optimizer {
    /// A fresh optimizer (no state yet, as in PyTorch before the first step).
    pub fn new(config: OptimizerConfig) -> Self {
        Self { config, state: HashMap::new() }
    }

    /// Its configuration.
    pub fn config(&self) -> &OptimizerConfig {
        &self.config
    }

    /// One step at learning rate `lr` (the configured one, or where a schedule has taken
    /// it): updates each parameter in place from its gradient; parameters whose gradient is
    /// `None` are skipped (their state does not advance), as in PyTorch.
    pub fn step(&mut self, params: &[(String, Tensor)], grads: &[Option<Tensor>], lr: f64) {
        assert_eq!(params.len(), grads.len(), "one gradient slot per parameter");
        tch::no_grad(|| {
            for ((name, param), grad) in params.iter().zip(grads) {
                if let Some(grad) = grad {
                    self.update(name, &mut param.shallow_clone(), grad, lr);
                }
            }
        });
    }

    fn update(&mut self, name: &str, param: &mut Tensor, grad: &Tensor, lr: f64) {
        match self.config {
            OptimizerConfig::Sgd { momentum, dampening, weight_decay, nesterov, .. } => {
                let mut d_p = if weight_decay != 0.0 { add_scaled(grad, param, weight_decay) } else { grad.shallow_clone() };
                if momentum != 0.0 {
                    let buf = match self.state.get_mut(name) {
                        Some(ParamState::Sgd { momentum_buffer }) => {
                            let _ = momentum_buffer.g_mul_scalar_(momentum);
                            let _ = momentum_buffer.addcmul_(&d_p, &Tensor::from(1.0 - dampening));
                            momentum_buffer.shallow_clone()
                        }
                        _ => {
                            let buf = d_p.copy();
                            self.state.insert(name.to_string(), ParamState::Sgd { momentum_buffer: buf.shallow_clone() });
                            buf
                        }
                    };
                    d_p = if nesterov { add_scaled(&d_p, &buf, momentum) } else { buf };
                }
                let _ = param.addcmul_(&d_p, &Tensor::from(-lr));
            }
            OptimizerConfig::Adam { betas, eps, weight_decay, .. } | OptimizerConfig::Adamw { betas, eps, weight_decay, .. } => {
                let decoupled = matches!(self.config, OptimizerConfig::Adamw { .. });
                let [beta1, beta2] = betas;
                let grad = if weight_decay != 0.0 && !decoupled {
                    add_scaled(grad, param, weight_decay)
                } else {
                    if decoupled && weight_decay != 0.0 {
                        let _ = param.g_mul_scalar_(1.0 - lr * weight_decay);
                    }
                    grad.shallow_clone()
                };
                let state = self.state.entry(name.to_string()).or_insert_with(|| ParamState::Adam {
                    step: 0,
                    exp_avg: param.zeros_like(),
                    exp_avg_sq: param.zeros_like(),
                });
                let ParamState::Adam { step, exp_avg, exp_avg_sq } = state else { unreachable!("an Adam optimizer keeps Adam state") };
                *step += 1;
                let _ = exp_avg.lerp_(&grad, 1.0 - beta1);
                let _ = exp_avg_sq.g_mul_scalar_(beta2);
                // addcmul_(grad, grad, value=1-beta2) computes (value * grad) * grad.
                let _ = exp_avg_sq.addcmul_(&(&grad * (1.0 - beta2)), &grad);
                let t = *step as f64;
                let bias_correction1 = 1.0 - beta1.powf(t);
                let bias_correction2 = 1.0 - beta2.powf(t);
                let step_size = lr / bias_correction1;
                let denom = (exp_avg_sq.sqrt() / bias_correction2.sqrt()).g_add_scalar_(eps);
                // addcdiv_(exp_avg, denom, value=-step_size) computes (value * exp_avg) / denom.
                let _ = param.addcdiv_(&(&*exp_avg * -step_size), &denom);
            }
        }
    }

    /// The state as named tensors (`optim.PARAM.momentum_buffer`, `optim.PARAM.exp_avg`,
    /// `optim.PARAM.exp_avg_sq`, `optim.PARAM.step`), for checkpoints.
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        let mut names: Vec<&String> = self.state.keys().collect();
        names.sort();
        for name in names {
            match &self.state[name] {
                ParamState::Sgd { momentum_buffer } => out.push((format!("optim.{name}.momentum_buffer"), momentum_buffer.shallow_clone())),
                ParamState::Adam { step, exp_avg, exp_avg_sq } => {
                    out.push((format!("optim.{name}.step"), Tensor::from(*step as i64)));
                    out.push((format!("optim.{name}.exp_avg"), exp_avg.shallow_clone()));
                    out.push((format!("optim.{name}.exp_avg_sq"), exp_avg_sq.shallow_clone()));
                }
            }
        }
        out
    }

    /// Restores the state of `params` from [`Self::state_tensors`] (moved to each
    /// parameter's device). A parameter without state in `tensors` starts fresh, as it would
    /// had it never had a gradient.
    pub fn load_state(&mut self, params: &[(String, Tensor)], tensors: &HashMap<String, Tensor>) -> Result<(), StateError> {
        self.state.clear();
        for (name, param) in params {
            let get = |field: &str| tensors.get(&format!("optim.{name}.{field}"));
            let like_param = |field: &str, t: &Tensor| {
                if t.size() != param.size() || t.kind() != param.kind() {
                    let key = format!("optim.{name}.{field}");
                    Err(StateError::Mismatch { key, found_kind: t.kind(), found_shape: t.size(), kind: param.kind(), shape: param.size() })
                } else {
                    Ok(t.to_device(param.device()).copy())
                }
            };
            let state = match &self.config {
                OptimizerConfig::Sgd { .. } => match get("momentum_buffer") {
                    Some(buf) => Some(ParamState::Sgd { momentum_buffer: like_param("momentum_buffer", buf)? }),
                    None => None,
                },
                OptimizerConfig::Adam { .. } | OptimizerConfig::Adamw { .. } => match (get("step"), get("exp_avg"), get("exp_avg_sq")) {
                    (Some(step), Some(m), Some(v)) => Some(ParamState::Adam {
                        step: u64::try_from(step.int64_value(&[])).map_err(|_| StateError::NegativeStep { key: format!("optim.{name}.step") })?,
                        exp_avg: like_param("exp_avg", m)?,
                        exp_avg_sq: like_param("exp_avg_sq", v)?,
                    }),
                    (None, None, None) => None,
                    _ => return Err(StateError::Incomplete { param: name.clone() }),
                },
            };
            if let Some(state) = state {
                self.state.insert(name.clone(), state);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(config: OptimizerConfig, steps: usize) -> Vec<f32> {
        let p = Tensor::from_slice(&[1.0f32, -2.0, 0.5]).set_requires_grad(true);
        let params = vec![("w".to_string(), p.shallow_clone())];
        let lr = config.lr();
        let mut opt = Optimizer::new(config);
        for i in 0..steps {
            let g = Tensor::from_slice(&[0.1f32 * (i as f32 + 1.0), -0.3, 0.0]);
            opt.step(&params, &[Some(g)], lr);
        }
        Vec::<f32>::try_from(&p.detach()).unwrap()
    }

    #[test]
    fn plain_sgd_is_p_minus_lr_g() {
        let got = run(OptimizerConfig::Sgd { lr: 0.5, momentum: 0.0, dampening: 0.0, weight_decay: 0.0, nesterov: false }, 1);
        assert_eq!(got, vec![1.0 - 0.05, -2.0 + 0.15, 0.5]);
    }

    #[test]
    fn sgd_momentum_matches_the_recurrence() {
        // buf1 = g1, buf2 = 0.9 * g1 + g2; p2 = p0 - lr * (g1 + buf2).
        let got = run(OptimizerConfig::Sgd { lr: 0.1, momentum: 0.9, dampening: 0.0, weight_decay: 0.0, nesterov: false }, 2);
        let want = 1.0f32 - 0.1 * 0.1 - 0.1 * (0.9 * 0.1 + 0.2);
        assert!((got[0] - want).abs() < 1e-7, "{got:?} vs {want}");
    }

    #[test]
    fn adam_first_step_moves_each_weight_by_lr() {
        // With bias correction, step 1 moves by lr * g / (|g| + eps'): lr for a nonzero g.
        let got = run(OptimizerConfig::Adam { lr: 0.01, betas: [0.9, 0.999], eps: 1e-8, weight_decay: 0.0 }, 1);
        assert!((got[0] - 0.99).abs() < 1e-6 && (got[1] + 1.99).abs() < 1e-6, "{got:?}");
        assert_eq!(got[2], 0.5, "a zero gradient leaves the weight");
    }

    #[test]
    fn adamw_decays_the_weight_before_the_update() {
        let adam = run(OptimizerConfig::Adam { lr: 0.01, betas: [0.9, 0.999], eps: 1e-8, weight_decay: 0.0 }, 1);
        let adamw = run(OptimizerConfig::Adamw { lr: 0.01, betas: [0.9, 0.999], eps: 1e-8, weight_decay: 0.1 }, 1);
        assert!((adamw[2] - 0.5 * (1.0 - 0.001)).abs() < 1e-7, "{adamw:?}");
        assert!((adamw[0] - (adam[0] - 0.001)).abs() < 1e-6, "{adamw:?} vs {adam:?}");
    }

    #[test]
    fn state_round_trips_and_resumes_identically() {
        let config = OptimizerConfig::Adam { lr: 0.01, betas: [0.9, 0.99], eps: 1e-8, weight_decay: 0.01 };
        let p = Tensor::from_slice(&[1.0f32, -2.0]).set_requires_grad(true);
        let params = vec![("w".to_string(), p.shallow_clone())];
        let mut a = Optimizer::new(config.clone());
        a.step(&params, &[Some(Tensor::from_slice(&[0.3f32, -0.1]))], 0.01);
        let saved: HashMap<String, Tensor> = a.state_tensors().into_iter().map(|(n, t)| (n, t.copy())).collect();
        let mut b = Optimizer::new(config);
        b.load_state(&params, &saved).unwrap();
        let q = p.detach().copy().set_requires_grad(true);
        let params_b = vec![("w".to_string(), q.shallow_clone())];
        a.step(&params, &[Some(Tensor::from_slice(&[0.2f32, 0.4]))], 0.01);
        b.step(&params_b, &[Some(Tensor::from_slice(&[0.2f32, 0.4]))], 0.01);
        assert!(p.detach().equal(&q.detach()));
    }

    #[test]
    fn invalid_values_are_named() {
        let bad = OptimizerConfig::Adam { lr: 0.01, betas: [0.9, 1.0], eps: 1e-8, weight_decay: 0.0 };
        assert_eq!(bad.validate().unwrap_err(), OptimizerError::Beta { index: 1, value: 1.0 });
        let bad = OptimizerConfig::Sgd { lr: 0.0, momentum: 0.0, dampening: 0.0, weight_decay: 0.0, nesterov: false };
        assert!(bad.validate().unwrap_err().to_string().contains("lr"));
        let bad = OptimizerConfig::Sgd { lr: 0.1, momentum: 0.0, dampening: 0.0, weight_decay: 0.0, nesterov: true };
        assert_eq!(bad.validate().unwrap_err(), OptimizerError::Nesterov);
    }
}
