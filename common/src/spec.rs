//! What the manifest says crosses a cut: dtypes, symbolic shapes (`B` is the batch size) and
//! value trees (tensors, plain values, tuples, lists, dicts).

use std::fmt;

use serde::{Deserialize, Serialize};

pub use cleave_codec::DType;

/// libtorch's view of a [`DType`] (the dtype itself lives in `cleave-codec`, which has no
/// libtorch).
pub trait TorchDType: Sized {
    /// The libtorch kind.
    fn kind(self) -> tch::Kind;
    /// The dtype of a libtorch kind, if a bundle can carry it.
    fn from_kind(kind: tch::Kind) -> Option<Self>;
}

impl TorchDType for DType {
    fn kind(self) -> tch::Kind {
        match self {
            Self::Float32 => tch::Kind::Float,
            Self::Float64 => tch::Kind::Double,
            Self::Float16 => tch::Kind::Half,
            Self::Bfloat16 => tch::Kind::BFloat16,
            Self::Int64 => tch::Kind::Int64,
            Self::Int32 => tch::Kind::Int,
            Self::Int16 => tch::Kind::Int16,
            Self::Int8 => tch::Kind::Int8,
            Self::Uint8 => tch::Kind::Uint8,
            Self::Bool => tch::Kind::Bool,
        }
    }

    fn from_kind(kind: tch::Kind) -> Option<Self> {
        Some(match kind {
            tch::Kind::Float => Self::Float32,
            tch::Kind::Double => Self::Float64,
            tch::Kind::Half => Self::Float16,
            tch::Kind::BFloat16 => Self::Bfloat16,
            tch::Kind::Int64 => Self::Int64,
            tch::Kind::Int => Self::Int32,
            tch::Kind::Int16 => Self::Int16,
            tch::Kind::Int8 => Self::Int8,
            tch::Kind::Uint8 => Self::Uint8,
            tch::Kind::Bool => Self::Bool,
            _ => return None,
        })
    }
}

/// One dimension of a symbolic shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawDim", into = "RawDim")]
pub enum Dim {
    /// A size fixed at export.
    Fixed(i64),
    /// `k*B`: a multiple of the batch size (`B` is `Batch(1)`).
    Batch(i64),
    /// A size that depends on the data (`?`).
    Dynamic,
}

#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum RawDim {
    Fixed(i64),
    Symbol(String),
}

impl TryFrom<RawDim> for Dim {
    type Error = String;

    fn try_from(raw: RawDim) -> Result<Self, String> {
        match raw {
            RawDim::Fixed(n) if n >= 0 => Ok(Dim::Fixed(n)),
            RawDim::Fixed(n) => Err(format!("negative dimension {n}")),
            RawDim::Symbol(s) if s == "B" => Ok(Dim::Batch(1)),
            RawDim::Symbol(s) if s == "?" => Ok(Dim::Dynamic),
            RawDim::Symbol(s) => s
                .strip_suffix("*B")
                .and_then(|k| k.parse().ok())
                .filter(|k: &i64| *k > 0)
                .map(Dim::Batch)
                .ok_or_else(|| format!("dimension {s:?} is not an integer, B, k*B or ?")),
        }
    }
}

impl From<Dim> for RawDim {
    fn from(d: Dim) -> Self {
        match d {
            Dim::Fixed(n) => RawDim::Fixed(n),
            Dim::Batch(1) => RawDim::Symbol("B".into()),
            Dim::Batch(k) => RawDim::Symbol(format!("{k}*B")),
            Dim::Dynamic => RawDim::Symbol("?".into()),
        }
    }
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dim::Fixed(n) => write!(f, "{n}"),
            Dim::Batch(1) => write!(f, "B"),
            Dim::Batch(k) => write!(f, "{k}*B"),
            Dim::Dynamic => write!(f, "?"),
        }
    }
}

impl Dim {
    /// The size at a batch size (`None` for a data-dependent size).
    pub fn at(self, batch: i64) -> Option<i64> {
        match self {
            Dim::Fixed(n) => Some(n),
            Dim::Batch(k) => Some(k * batch),
            Dim::Dynamic => None,
        }
    }
}

/// A tensor's dtype and symbolic shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorSpec {
    /// Element type.
    pub dtype: DType,
    /// Symbolic shape.
    pub shape: Vec<Dim>,
}

impl TensorSpec {
    /// Checks a tensor's dtype and shape against this spec. `batch` is the batch size the
    /// boundary has shown so far (the first `B` dimension sets it). Returns why not.
    pub fn check_shape(&self, dtype: DType, shape: &[i64], batch: &mut Option<i64>) -> Result<(), String> {
        if dtype != self.dtype {
            return Err("dtype".into());
        }
        if shape.len() != self.shape.len() {
            return Err(format!("rank {} instead of {}", shape.len(), self.shape.len()));
        }
        for (axis, (&dim, &size)) in self.shape.iter().zip(shape).enumerate() {
            match dim {
                Dim::Fixed(n) if n != size => return Err(format!("dimension {axis} must be {n}")),
                Dim::Batch(k) => match *batch {
                    Some(b) if k * b != size => return Err(format!("dimension {axis} must be {} = {} for batch size {b}", Dim::Batch(k), k * b)),
                    None if size % k != 0 || size <= 0 => return Err(format!("dimension {axis} must be a positive multiple of {k}")),
                    None => *batch = Some(size / k),
                    _ => {}
                },
                _ => {}
            }
        }
        Ok(())
    }
}

impl fmt::Display for TensorSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dims: Vec<String> = self.shape.iter().map(Dim::to_string).collect();
        write!(f, "{}[{}]", self.dtype, dims.join(", "))
    }
}

/// The spec of a value: a tensor, a plain value, or a container of values.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum ValueSpec {
    /// A tensor.
    Tensor(TensorSpec),
    /// A Python int.
    Int,
    /// A Python float.
    Float,
    /// A Python bool.
    Bool,
    /// A string.
    Str,
    /// None.
    None,
    /// A tuple with a fixed number of items.
    Tuple {
        /// The items' specs.
        items: Vec<ValueSpec>,
    },
    /// A list (its length fixed at export).
    List {
        /// The items' specs.
        items: Vec<ValueSpec>,
    },
    /// A dict with string keys, in order.
    Dict {
        /// Key and spec of each item.
        items: Vec<DictItem>,
    },
    /// In the model's output tree only: a value of the final cut, by name.
    Ref {
        /// Name of the value.
        name: String,
    },
}

/// One item of a dict spec.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DictItem {
    /// The key.
    pub key: String,
    /// The value's spec.
    pub value: ValueSpec,
}

impl ValueSpec {
    /// The tensors inside, named `name`, `name.0`, `name.key` (the same names the exporter uses).
    pub fn tensor_leaves(&self, name: &str) -> Vec<(String, &TensorSpec)> {
        let mut out = Vec::new();
        self.collect_leaves(name, &mut out);
        out
    }

    fn collect_leaves<'a>(&'a self, name: &str, out: &mut Vec<(String, &'a TensorSpec)>) {
        match self {
            ValueSpec::Tensor(t) => out.push((name.to_string(), t)),
            ValueSpec::Tuple { items } | ValueSpec::List { items } => {
                for (i, item) in items.iter().enumerate() {
                    item.collect_leaves(&format!("{name}.{i}"), out);
                }
            }
            ValueSpec::Dict { items } => {
                for item in items {
                    item.value.collect_leaves(&format!("{name}.{}", item.key), out);
                }
            }
            _ => {}
        }
    }

    /// A short description (`float32[B, 64]`, `int`, `tuple`...).
    pub fn describe(&self) -> String {
        match self {
            ValueSpec::Tensor(t) => t.to_string(),
            ValueSpec::Int => "int".into(),
            ValueSpec::Float => "float".into(),
            ValueSpec::Bool => "bool".into(),
            ValueSpec::Str => "str".into(),
            ValueSpec::None => "None".into(),
            ValueSpec::Tuple { items } => format!("tuple of {}", items.len()),
            ValueSpec::List { items } => format!("list of {}", items.len()),
            ValueSpec::Dict { items } => format!("dict of {}", items.len()),
            ValueSpec::Ref { name } => format!("ref {name}"),
        }
    }
}

/// A named value spec: one entry of a cut or of the model's inputs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NamedSpec {
    /// The value's name (an fx node name).
    pub name: String,
    /// Its spec.
    pub spec: ValueSpec,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dims_parse_and_print_round_trip() {
        let dims: Vec<Dim> = serde_json::from_str(r#"["B", 64, "4*B", "?"]"#).unwrap();
        assert_eq!(dims, vec![Dim::Batch(1), Dim::Fixed(64), Dim::Batch(4), Dim::Dynamic]);
        assert_eq!(serde_json::to_string(&dims).unwrap(), r#"["B",64,"4*B","?"]"#);
        assert_eq!(Dim::Batch(4).at(3), Some(12));
        assert_eq!(Dim::Dynamic.at(3), None);
    }

    #[test]
    fn bad_dims_name_the_problem() {
        for (text, want) in [(r#"["C"]"#, "\"C\" is not"), (r#"[-2]"#, "negative"), (r#"["0*B"]"#, "is not")] {
            let err = serde_json::from_str::<Vec<Dim>>(text).unwrap_err().to_string();
            assert!(err.contains(want), "{text}: {err}");
        }
    }

    #[test]
    fn value_tree_leaves_are_named_like_the_exporter() {
        let spec: ValueSpec = serde_json::from_str(
            r#"{"type":"tuple","items":[
                {"type":"tensor","dtype":"float32","shape":["B",2]},
                {"type":"int"},
                {"type":"dict","items":[{"key":"k","value":{"type":"tensor","dtype":"bool","shape":[3]}}]}]}"#,
        )
        .unwrap();
        let names: Vec<String> = spec.tensor_leaves("v").into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["v.0", "v.2.k"]);
        assert_eq!(spec.tensor_leaves("v")[1].1.to_string(), "bool[3]");
    }
}
