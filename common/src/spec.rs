//! What the manifest says crosses a cut: dtypes, symbolic shapes (`B` is the batch size, `S`
//! the sequence length, `k*S+c` a line in it) and value trees (tensors, plain values, tuples,
//! lists, dicts).

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
    /// `k*S+c`: a line in the sequence length (`S` is `Seq(1, 0)`; a waveform's samples where
    /// `S` counts its frames, `320*S+80`, is `Seq(320, 80)`), in bundles exported with a dynamic
    /// sequence.
    Seq(i64, i64),
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
            RawDim::Symbol(s) if s == "?" => Ok(Dim::Dynamic),
            RawDim::Symbol(s) => parse_line(&s).ok_or_else(|| format!("dimension {s:?} is not an integer, B, k*B, S, k*S, k*S+c, k*S-c or ?")),
        }
    }
}

/// `B`, `k*B`, `S`, `k*S`, `k*S+c` or `k*S-c` (k > 0), as the exporter writes them.
fn parse_line(s: &str) -> Option<Dim> {
    let (head, symbol, tail) = match s.find(['B', 'S']) {
        Some(at) => (&s[..at], &s[at..at + 1], &s[at + 1..]),
        None => return None,
    };
    let k = match head.strip_suffix('*') {
        Some(k) if !k.is_empty() && k.bytes().all(|d| d.is_ascii_digit()) => k.parse().ok().filter(|k: &i64| *k > 0)?,
        None if head.is_empty() => 1,
        _ => return None,
    };
    let c = match tail.chars().next() {
        None => 0,
        Some('+' | '-') if tail.len() > 1 && tail[1..].bytes().all(|d| d.is_ascii_digit()) => tail.parse().ok()?,
        Some(_) => return None,
    };
    match symbol {
        "B" if c == 0 => Some(Dim::Batch(k)),
        "S" => Some(Dim::Seq(k, c)),
        _ => None,
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
            Dim::Seq(1, 0) => write!(f, "S"),
            Dim::Seq(k, 0) => write!(f, "{k}*S"),
            Dim::Seq(1, c) => write!(f, "S{c:+}"),
            Dim::Seq(k, c) => write!(f, "{k}*S{c:+}"),
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
            Dim::Batch(k) => k.checked_mul(sizes.batch?),
            Dim::Seq(k, c) => k.checked_mul(sizes.seq?)?.checked_add(c),
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
    /// A first sequence dimension `k*S+c` (c other than 0) that no positive S gives.
    #[error("dimension {axis} must be {dim} for a positive sequence length S")]
    OffTheLine {
        /// The dimension.
        axis: usize,
        /// Its symbolic size.
        dim: Dim,
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
            let (k, c, seen, what) = match dim {
                Dim::Fixed(n) if n != size => return Err(ShapeMismatch::Fixed { axis, want: n }),
                Dim::Batch(k) => (k, 0, &mut sizes.batch, "batch size"),
                Dim::Seq(k, c) => (k, c, &mut sizes.seq, "sequence length"),
                _ => continue,
            };
            match *seen {
                Some(n) => {
                    let want = k.checked_mul(n).and_then(|kn| kn.checked_add(c)).unwrap_or(i64::MAX);
                    if want != size {
                        return Err(ShapeMismatch::Sized { axis, dim, want, what, seen: n });
                    }
                }
                None => {
                    let off = if c == 0 { ShapeMismatch::NotAMultiple { axis, multiple: k } } else { ShapeMismatch::OffTheLine { axis, dim } };
                    *seen = Some(symbol_of(size, k, c).ok_or(off)?);
                }
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

/// The positive `n` with `k*n+c == size`, if there is one.
fn symbol_of(size: i64, k: i64, c: i64) -> Option<i64> {
    let rest = size.checked_sub(c)?;
    (rest > 0 && rest % k == 0).then_some(rest / k)
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
        assert_eq!(dims, vec![Dim::Batch(1), Dim::Fixed(64), Dim::Batch(4), Dim::Dynamic, Dim::Seq(1, 0), Dim::Seq(3, 0)]);
        assert_eq!(serde_json::to_string(&dims).unwrap(), r#"["B",64,"4*B","?","S","3*S"]"#);
        assert_eq!(Dim::Batch(4).at(Sizes::batch(3)), Some(12));
        assert_eq!(Dim::Dynamic.at(Sizes::batch(3)), None);
        assert_eq!(Dim::Seq(3, 0).at(Sizes::batch_and_seq(2, Some(5))), Some(15));
        assert_eq!(Dim::Seq(1, 0).at(Sizes::batch(2)), None);
    }

    #[test]
    fn lines_in_the_sequence_length_parse_print_and_size() {
        let text = r#"["S-1","20*S+20","320*S+80","2*S-3"]"#;
        let dims: Vec<Dim> = serde_json::from_str(text).unwrap();
        assert_eq!(dims, vec![Dim::Seq(1, -1), Dim::Seq(20, 20), Dim::Seq(320, 80), Dim::Seq(2, -3)]);
        assert_eq!(serde_json::to_string(&dims).unwrap(), text);
        assert_eq!(Dim::Seq(320, 80).at(Sizes::batch_and_seq(2, Some(49))), Some(15760));
        assert_eq!(Dim::Seq(i64::MAX, 1).at(Sizes::batch_and_seq(1, Some(2))), None, "overflow is no size");
        for bad in [r#"["S+"]"#, r#"["S+-1"]"#, r#"["B+1"]"#, r#"["+2*S"]"#, r#"["2*S*3"]"#, r#"["S 1"]"#, r#"["*S"]"#] {
            let err = serde_json::from_str::<Vec<Dim>>(bad).unwrap_err().to_string();
            assert!(err.contains("is not an integer, B, k*B, S, k*S, k*S+c, k*S-c or ?"), "{bad}: {err}");
        }
    }

    #[test]
    fn a_waveform_on_the_line_gives_the_frames_and_one_off_it_is_refused() {
        // wav2vec2's waveform: 320*S+80 samples make exactly S frames.
        let wave = TensorSpec { dtype: DType::Float32, shape: vec![Dim::Batch(1), Dim::Seq(320, 80)] };
        let frames = TensorSpec { dtype: DType::Float32, shape: vec![Dim::Batch(1), Dim::Seq(1, 0), Dim::Fixed(8)] };
        let mut sizes = Sizes::default();
        wave.check_shape(DType::Float32, &[2, 16080], &mut sizes).unwrap();
        assert_eq!(sizes, Sizes::batch_and_seq(2, Some(50)));
        frames.check_shape(DType::Float32, &[2, 50, 8], &mut sizes).unwrap();
        let err = frames.check_shape(DType::Float32, &[2, 51, 8], &mut sizes).unwrap_err();
        assert_eq!(err.to_string(), "dimension 1 must be S = 50 for sequence length 50");
        let err = wave.check_shape(DType::Float32, &[2, 16000], &mut Sizes::default()).unwrap_err();
        assert_eq!(err.to_string(), "dimension 1 must be 320*S+80 for a positive sequence length S");
        let err = wave.check_shape(DType::Float32, &[2, 80], &mut Sizes::default()).unwrap_err();
        assert!(matches!(err, ShapeMismatch::OffTheLine { axis: 1, .. }), "S = 0 is no length: {err:?}");
        let shifted = TensorSpec { dtype: DType::Int64, shape: vec![Dim::Batch(1), Dim::Seq(1, -1)] };
        let err = shifted.check_shape(DType::Int64, &[2, 4], &mut sizes).unwrap_err();
        assert_eq!(err.to_string(), "dimension 1 must be S-1 = 49 for sequence length 50");
        let huge = TensorSpec { dtype: DType::Float32, shape: vec![Dim::Seq(2, i64::MIN)] };
        assert!(huge.check_shape(DType::Float32, &[5], &mut Sizes::default()).is_err(), "no overflow on a hostile manifest");
    }

    #[test]
    fn one_batch_size_and_one_sequence_length_per_boundary() {
        let mask = TensorSpec { dtype: DType::Bool, shape: vec![Dim::Batch(1), Dim::Fixed(1), Dim::Seq(1, 0), Dim::Seq(1, 0)] };
        let mut sizes = Sizes::default();
        mask.check_shape(DType::Bool, &[2, 1, 7, 7], &mut sizes).unwrap();
        assert_eq!(sizes, Sizes::batch_and_seq(2, Some(7)));
        let hidden = TensorSpec { dtype: DType::Float32, shape: vec![Dim::Batch(1), Dim::Seq(2, 0), Dim::Fixed(4)] };
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
        let mask = TensorSpec { dtype: DType::Bool, shape: vec![Dim::Batch(1), Dim::Fixed(1), Dim::Seq(1, 0), Dim::Seq(1, 0)] };
        assert_eq!(mask.bytes_at(Sizes::batch_and_seq(2, Some(8))), Some(2 * 8 * 8));
        let hidden = TensorSpec { dtype: DType::Float32, shape: vec![Dim::Batch(1), Dim::Seq(2, 0), Dim::Fixed(4)] };
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
