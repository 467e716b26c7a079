//! What the manifest says crosses a cut: dtypes, symbolic shapes (`B` is the batch size, `S`
//! the sequence length) and value trees (tensors, plain values, tuples, lists, dicts).

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
    /// `k*S`: a multiple of the sequence length (`S` is `Seq(1)`), in bundles exported with a
    /// dynamic sequence.
    Seq(i64),
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
            RawDim::Symbol(s) if s == "S" => Ok(Dim::Seq(1)),
            RawDim::Symbol(s) if s == "?" => Ok(Dim::Dynamic),
            RawDim::Symbol(s) => {
                let multiple = |suffix: &str| s.strip_suffix(suffix).and_then(|k| k.parse().ok()).filter(|k: &i64| *k > 0);
                (multiple("*B").map(Dim::Batch).or_else(|| multiple("*S").map(Dim::Seq)))
                    .ok_or_else(|| format!("dimension {s:?} is not an integer, B, k*B, S, k*S or ?"))
            }
        }
    }
}

impl From<Dim> for RawDim {
    fn from(d: Dim) -> Self {
        match d {
            Dim::Fixed(n) => RawDim::Fixed(n),
            other => RawDim::Symbol(other.to_string()),
        }
    }
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dim::Fixed(n) => write!(f, "{n}"),
            Dim::Batch(1) => write!(f, "B"),
            Dim::Batch(k) => write!(f, "{k}*B"),
            Dim::Seq(1) => write!(f, "S"),
            Dim::Seq(k) => write!(f, "{k}*S"),
            Dim::Dynamic => write!(f, "?"),
        }
    }
}

impl Dim {
    /// The size at a batch size and sequence length (`None` for a data-dependent size, or a
    /// sequence dimension without a length).
    pub fn at(self, sizes: Sizes) -> Option<i64> {
        match self {
            Dim::Fixed(n) => Some(n),
            Dim::Batch(k) => Some(k * sizes.batch?),
            Dim::Seq(k) => Some(k * sizes.seq?),
            Dim::Dynamic => None,
        }
    }
}

/// The sizes a boundary's symbols stand for: its batch size and, in bundles with a dynamic
/// sequence, its sequence length. One boundary has one of each: the first tensor that shows
/// one fixes it, every later one must agree.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sizes {
    /// The batch size (`B`).
    pub batch: Option<i64>,
    /// The sequence length (`S`).
    pub seq: Option<i64>,
}

impl Sizes {
    /// A batch size, and no sequence.
    pub fn batch(batch: i64) -> Self {
        Self { batch: Some(batch), seq: None }
    }

    /// A batch size and a sequence length.
    pub fn batch_and_seq(batch: i64, seq: Option<i64>) -> Self {
        Self { batch: Some(batch), seq }
    }
}

/// The sizes of a boundary that passed the bundle's checks: its batch size and, in bundles
/// with a dynamic sequence, its sequence length, both within the bundle's ranges. Requests
/// merge into one batch only when their sequence lengths are equal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BoundarySizes {
    /// The batch size (the bundle's smallest when no tensor has a batch dimension).
    pub batch: i64,
    /// The sequence length, when a tensor has a sequence dimension.
    pub seq: Option<i64>,
}

impl From<BoundarySizes> for Sizes {
    fn from(sizes: BoundarySizes) -> Self {
        Self::batch_and_seq(sizes.batch, sizes.seq)
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

/// Why a tensor does not fit a [`TensorSpec`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShapeMismatch {
    /// Another element type.
    #[error("dtype")]
    Dtype,
    /// Another number of dimensions.
    #[error("rank {got} instead of {want}")]
    Rank {
        /// The tensor's.
        got: usize,
        /// The spec's.
        want: usize,
    },
    /// A fixed dimension of another size.
    #[error("dimension {axis} must be {want}")]
    Fixed {
        /// The dimension.
        axis: usize,
        /// Its size in the spec.
        want: i64,
    },
    /// A batch or sequence dimension that disagrees with the size shown before it.
    #[error("dimension {axis} must be {dim} = {want} for {what} {seen}")]
    Sized {
        /// The dimension.
        axis: usize,
        /// Its symbolic size.
        dim: Dim,
        /// Its size at the size shown.
        want: i64,
        /// `batch size` or `sequence length`.
        what: &'static str,
        /// The size shown.
        seen: i64,
    },
    /// A first batch or sequence dimension that is not a positive multiple of its factor.
    #[error("dimension {axis} must be a positive multiple of {multiple}")]
    NotAMultiple {
        /// The dimension.
        axis: usize,
        /// The factor (`2*S`: 2).
        multiple: i64,
    },
}

impl TensorSpec {
    /// Checks a tensor's dtype and shape against this spec. `sizes` are the batch size and
    /// sequence length the boundary has shown so far (the first `B` and `S` dimensions set
    /// them). Returns why not.
    pub fn check_shape(&self, dtype: DType, shape: &[i64], sizes: &mut Sizes) -> Result<(), ShapeMismatch> {
        if dtype != self.dtype {
            return Err(ShapeMismatch::Dtype);
        }
        if shape.len() != self.shape.len() {
            return Err(ShapeMismatch::Rank { got: shape.len(), want: self.shape.len() });
        }
        for (axis, (&dim, &size)) in self.shape.iter().zip(shape).enumerate() {
            let (k, seen, what) = match dim {
                Dim::Fixed(n) if n != size => return Err(ShapeMismatch::Fixed { axis, want: n }),
                Dim::Batch(k) => (k, &mut sizes.batch, "batch size"),
                Dim::Seq(k) => (k, &mut sizes.seq, "sequence length"),
                _ => continue,
            };
            match *seen {
                Some(n) if k * n != size => return Err(ShapeMismatch::Sized { axis, dim, want: k * n, what, seen: n }),
                None if size % k != 0 || size <= 0 => return Err(ShapeMismatch::NotAMultiple { axis, multiple: k }),
                None => *seen = Some(size / k),
                _ => {}
            }
        }
        Ok(())
    }

    /// Bytes of a tensor of this spec at `sizes`; `None` when a dimension depends on the
    /// data (`?`) or on a size `sizes` does not give.
    pub fn bytes_at(&self, sizes: Sizes) -> Option<u64> {
        self.shape.iter().try_fold(self.dtype.size() as u64, |bytes, dim| bytes.checked_mul(u64::try_from(dim.at(sizes)?).ok()?))
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
    /// The inclusive range of an integer input's values (token ids are below the vocabulary
    /// size), which a server checks before running the stages on it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub range: Option<(i64, i64)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dims_parse_and_print_round_trip() {
        let dims: Vec<Dim> = serde_json::from_str(r#"["B", 64, "4*B", "?", "S", "3*S"]"#).unwrap();
        assert_eq!(dims, vec![Dim::Batch(1), Dim::Fixed(64), Dim::Batch(4), Dim::Dynamic, Dim::Seq(1), Dim::Seq(3)]);
        assert_eq!(serde_json::to_string(&dims).unwrap(), r#"["B",64,"4*B","?","S","3*S"]"#);
        assert_eq!(Dim::Batch(4).at(Sizes::batch(3)), Some(12));
        assert_eq!(Dim::Dynamic.at(Sizes::batch(3)), None);
        assert_eq!(Dim::Seq(3).at(Sizes::batch_and_seq(2, Some(5))), Some(15));
        assert_eq!(Dim::Seq(1).at(Sizes::batch(2)), None);
    }

    #[test]
    fn one_batch_size_and_one_sequence_length_per_boundary() {
        let mask = TensorSpec { dtype: DType::Bool, shape: vec![Dim::Batch(1), Dim::Fixed(1), Dim::Seq(1), Dim::Seq(1)] };
        let mut sizes = Sizes::default();
        mask.check_shape(DType::Bool, &[2, 1, 7, 7], &mut sizes).unwrap();
        assert_eq!(sizes, Sizes::batch_and_seq(2, Some(7)));
        let hidden = TensorSpec { dtype: DType::Float32, shape: vec![Dim::Batch(1), Dim::Seq(2), Dim::Fixed(4)] };
        hidden.check_shape(DType::Float32, &[2, 14, 4], &mut sizes).unwrap();
        let err = hidden.check_shape(DType::Float32, &[2, 12, 4], &mut sizes).unwrap_err();
        assert_eq!(err.to_string(), "dimension 1 must be 2*S = 14 for sequence length 7");
        assert!(matches!(err, ShapeMismatch::Sized { axis: 1, want: 14, seen: 7, .. }), "{err:?}");
        let err = mask.check_shape(DType::Bool, &[2, 1, 7, 6], &mut Sizes::default()).unwrap_err();
        assert_eq!(err.to_string(), "dimension 3 must be S = 7 for sequence length 7");
        let err = hidden.check_shape(DType::Float32, &[2, 7, 4], &mut Sizes::default()).unwrap_err();
        assert_eq!(err.to_string(), "dimension 1 must be a positive multiple of 2");
        let err = mask.check_shape(DType::Bool, &[3, 1, 0, 0], &mut Sizes::default()).unwrap_err();
        assert_eq!(err.to_string(), "dimension 2 must be a positive multiple of 1");
    }

    #[test]
    fn bytes_follow_the_batch_and_the_sequence() {
        let mask = TensorSpec { dtype: DType::Bool, shape: vec![Dim::Batch(1), Dim::Fixed(1), Dim::Seq(1), Dim::Seq(1)] };
        assert_eq!(mask.bytes_at(Sizes::batch_and_seq(2, Some(8))), Some(2 * 8 * 8));
        let hidden = TensorSpec { dtype: DType::Float32, shape: vec![Dim::Batch(1), Dim::Seq(2), Dim::Fixed(4)] };
        assert_eq!(hidden.bytes_at(Sizes::batch_and_seq(3, Some(5))), Some(3 * 10 * 4 * 4));
        assert_eq!(hidden.bytes_at(Sizes::batch(3)), None, "no sequence length");
        let ragged = TensorSpec { dtype: DType::Int64, shape: vec![Dim::Batch(1), Dim::Dynamic] };
        assert_eq!(ragged.bytes_at(Sizes::batch(3)), None);
        let scalar = TensorSpec { dtype: DType::Float64, shape: vec![] };
        assert_eq!(scalar.bytes_at(Sizes::default()), Some(8));
    }

    #[test]
    fn bad_dims_name_the_problem() {
        for (text, want) in
            [(r#"["C"]"#, "\"C\" is not"), (r#"[-2]"#, "negative"), (r#"["0*B"]"#, "is not"), (r#"["0*S"]"#, "is not"), (r#"["S*2"]"#, "is not")]
        {
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
