//! Losses, computed as `torch.nn.functional` computes them (mean over the batch).

use serde::{Deserialize, Serialize};
use tch::{Kind, Reduction, Tensor};

use super::TrainError;

/// A training loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LossKind {
    /// `F.cross_entropy(logits [B, C], classes [B] int64)`.
    CrossEntropy,
    /// `F.mse_loss(output, target)`, same shape.
    Mse,
}

impl LossKind {
    /// `cross-entropy` or `mse`.
    pub fn name(self) -> &'static str {
        match self {
            Self::CrossEntropy => "cross-entropy",
            Self::Mse => "mse",
        }
    }

    /// The loss of `output` against `targets` (moved to the output's device); a shape or
    /// dtype that cannot work, or a class index out of range, is an error that says which.
    pub fn compute(self, output: &Tensor, targets: &Tensor) -> Result<Tensor, TrainError> {
        let targets = targets.to_device(output.device());
        match self {
            Self::CrossEntropy => {
                let (o, t) = (output.size(), targets.size());
                if o.len() != 2 || t.len() != 1 || o[0] != t[0] {
                    return Err(TrainError::Loss(format!("cross-entropy needs logits [B, C] and class indices [B]; got {o:?} and {t:?}")));
                }
                if targets.kind() != Kind::Int64 {
                    return Err(TrainError::Loss(format!("cross-entropy targets are int64 class indices, got {:?}", targets.kind())));
                }
                if t[0] > 0 {
                    let (lo, hi) = (targets.min().int64_value(&[]), targets.max().int64_value(&[]));
                    if lo < 0 || hi >= o[1] {
                        return Err(TrainError::Loss(format!("class indices must be in 0..{}, found {lo}..={hi}", o[1])));
                    }
                }
                output.f_cross_entropy_loss::<Tensor>(&targets, None, Reduction::Mean, -100, 0.0).map_err(|e| TrainError::torch("cross-entropy", e))
            }
            Self::Mse => {
                if output.size() != targets.size() {
                    return Err(TrainError::Loss(format!("mse needs targets shaped like the output {:?}, got {:?}", output.size(), targets.size())));
                }
                output.f_mse_loss(&targets.to_kind(output.kind()), Reduction::Mean).map_err(|e| TrainError::torch("mse", e))
            }
        }
    }
}

impl std::str::FromStr for LossKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cross-entropy" => Ok(Self::CrossEntropy),
            "mse" => Ok(Self::Mse),
            other => Err(format!("{other:?} is not a loss (cross-entropy, mse)")),
        }
    }
}

/// Rows whose arg-max over the last dimension equals the class index in `targets`.
pub fn correct(output: &Tensor, targets: &Tensor) -> i64 {
    output.argmax(-1, false).eq_tensor(&targets.to_device(output.device())).sum(Kind::Int64).int64_value(&[])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cross_entropy_matches_the_formula() {
        let logits = Tensor::from_slice(&[2.0f32, 0.0, 0.0, 1.0]).reshape([2, 2]);
        let targets = Tensor::from_slice(&[0i64, 1]);
        let got = LossKind::CrossEntropy.compute(&logits, &targets).unwrap().double_value(&[]);
        let want = ((1.0 + (-2.0f64).exp()).ln() + (1.0 + (-1.0f64).exp()).ln()) / 2.0;
        assert!((got - want).abs() < 1e-6, "{got} vs {want}");
        assert_eq!(correct(&logits, &targets), 2);
    }

    #[test]
    fn bad_targets_are_named() {
        let logits = Tensor::zeros([2, 3], (Kind::Float, tch::Device::Cpu));
        let err = LossKind::CrossEntropy.compute(&logits, &Tensor::from_slice(&[0i64, 3])).unwrap_err().to_string();
        assert!(err.contains("0..3") && err.contains("0..=3"), "{err}");
        let err = LossKind::CrossEntropy.compute(&logits, &Tensor::from_slice(&[0i64])).unwrap_err().to_string();
        assert!(err.contains("[2, 3]") && err.contains("[1]"), "{err}");
        let err = LossKind::Mse.compute(&logits, &Tensor::zeros([3], (Kind::Float, tch::Device::Cpu))).unwrap_err().to_string();
        assert!(err.contains("mse"), "{err}");
        assert!("hinge".parse::<LossKind>().unwrap_err().contains("cross-entropy, mse"));
    }
}
