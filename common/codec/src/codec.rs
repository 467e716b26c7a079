//! What a codec is: a lossy precision, a byte shuffle and a compression, applied to each
//! tensor in that order, or `auto` (each tensor `raw` or `shuffle+lz4`, whichever suits it),
//! and its text form (`fp16+shuffle+lz4`, `raw`, `auto`).

use std::fmt;
use std::str::FromStr;

use crate::dtype::DType;

/// The precision float tensors travel in. Only `float32` and `float64` tensors are cast;
/// every other dtype travels as it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Precision {
    /// As they are (lossless).
    #[default]
    Full,
    /// IEEE half precision.
    Fp16,
    /// bfloat16 (float32's exponent range, 8 bits of mantissa).
    Bf16,
    /// Affine int8 with a scale and a zero point per channel (axis 1, or the whole tensor
    /// for tensors of rank 0 or 1).
    Int8,
}

impl Precision {
    /// Every precision.
    pub const ALL: [Precision; 4] = [Self::Full, Self::Fp16, Self::Bf16, Self::Int8];

    /// Its name in a codec string and in configs.
    pub fn name(self) -> &'static str {
        match self {
            Self::Full => "full",
            Self::Fp16 => "fp16",
            Self::Bf16 => "bf16",
            Self::Int8 => "int8",
        }
    }

    /// Whether a tensor of this dtype is cast (lossy) rather than carried as it is.
    pub fn casts(self, dtype: DType) -> bool {
        self != Self::Full && matches!(dtype, DType::Float32 | DType::Float64)
    }

    /// Bytes per element as carried.
    pub fn carried_size(self, dtype: DType) -> usize {
        match self {
            _ if !self.casts(dtype) => dtype.size(),
            Self::Fp16 | Self::Bf16 => 2,
            Self::Int8 => 1,
            Self::Full => dtype.size(),
        }
    }
}

/// The compression applied after the shuffle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Compression {
    /// None.
    #[default]
    None,
    /// LZ4 block format (lz4_flex).
    Lz4,
    /// Zstandard at a level (1..=22; negative levels are zstd's fast modes).
    Zstd(i32),
}

impl Compression {
    /// The family name, as servers list what they accept (`none`, `lz4`, `zstd`).
    pub fn family(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Lz4 => "lz4",
            Self::Zstd(_) => "zstd",
        }
    }
}

/// Zstandard's default level.
pub const DEFAULT_ZSTD_LEVEL: i32 = 3;

/// How every tensor of a payload is encoded. Encryption is not part of it: that depends on
/// the keys each side holds, not on the data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Codec {
    /// Lossy precision for float tensors.
    pub precision: Precision,
    /// Byte shuffle by element size (groups the bytes of equal significance, which is what
    /// makes float tensors compress).
    pub shuffle: bool,
    /// Compression.
    pub compression: Compression,
    /// Picks per tensor between [`Codec::RAW`] and [`Codec::SHUFFLE_LZ4`] (`auto`): raw when
    /// a sample of the tensor does not compress, so bytes that would not shrink are neither
    /// shuffled nor passed through the compressor. Each tensor's header says which it took.
    pub auto: bool,
}

impl Codec {
    /// No transformation at all.
    pub const RAW: Codec = Codec { precision: Precision::Full, shuffle: false, compression: Compression::None, auto: false };
    /// Lossless and fast: byte shuffle, then lz4.
    pub const SHUFFLE_LZ4: Codec = Codec { shuffle: true, compression: Compression::Lz4, ..Codec::RAW };
    /// Lossless and smaller, slower: byte shuffle, then zstd at level 1.
    pub const SHUFFLE_ZSTD_1: Codec = Codec { shuffle: true, compression: Compression::Zstd(1), ..Codec::RAW };
    /// `auto`: [`Codec::RAW`] or [`Codec::SHUFFLE_LZ4`] per tensor.
    pub const AUTO: Codec = Codec { auto: true, ..Codec::SHUFFLE_LZ4 };

    /// The codecs a tensor may travel with under this one: itself, or for `auto` its two.
    pub fn tensor_codecs(self) -> Vec<Codec> {
        if self.auto {
            vec![Codec::RAW, Codec::SHUFFLE_LZ4]
        } else {
            vec![self]
        }
    }
}

impl fmt::Display for Codec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.auto {
            return f.write_str("auto");
        }
        let mut parts = Vec::new();
        if self.precision != Precision::Full {
            parts.push(self.precision.name().to_string());
        }
        if self.shuffle {
            parts.push("shuffle".into());
        }
        match self.compression {
            Compression::None => {}
            Compression::Lz4 => parts.push("lz4".into()),
            Compression::Zstd(level) => parts.push(format!("zstd-{level}")),
        }
        if parts.is_empty() {
            f.write_str("raw")
        } else {
            f.write_str(&parts.join("+"))
        }
    }
}

impl FromStr for Codec {
    type Err = String;

    /// Parses `raw` or `+`-joined parts in any order: at most one precision (`fp16`,
    /// `bf16`, `int8`, `full`), `shuffle`, at most one compression (`lz4`, `zstd`,
    /// `zstd-LEVEL`, `none`).
    fn from_str(s: &str) -> Result<Self, String> {
        let mut codec = Codec::RAW;
        let (mut precision_set, mut compression_set) = (false, false);
        let s = s.trim();
        match s {
            "raw" => return Ok(codec),
            "auto" => return Ok(Codec::AUTO),
            _ if s.split('+').any(|part| part.trim() == "auto") => {
                return Err(format!("codec {s:?}: `auto` stands alone (it picks raw or shuffle+lz4 for each tensor)"))
            }
            _ => {}
        }
        for part in s.split('+').map(str::trim) {
            let precision = Precision::ALL.into_iter().find(|p| p.name() == part);
            let compression = match part {
                "none" => Some(Compression::None),
                "lz4" => Some(Compression::Lz4),
                "zstd" => Some(Compression::Zstd(DEFAULT_ZSTD_LEVEL)),
                _ => match part.strip_prefix("zstd-").or_else(|| part.strip_prefix("zstd:")) {
                    Some(level) => match level.parse::<i32>() {
                        Ok(l) if (-7..=22).contains(&l) && l != 0 => Some(Compression::Zstd(l)),
                        _ => return Err(format!("codec {s:?}: zstd level {level:?} must be -7..=-1 or 1..=22")),
                    },
                    None => None,
                },
            };
            match (precision, compression) {
                (Some(p), _) if !precision_set => (codec.precision, precision_set) = (p, true),
                (_, Some(c)) if !compression_set => (codec.compression, compression_set) = (c, true),
                (Some(_), _) => return Err(format!("codec {s:?}: more than one precision")),
                (_, Some(_)) => return Err(format!("codec {s:?}: more than one compression")),
                _ if part == "shuffle" && !codec.shuffle => codec.shuffle = true,
                _ => {
                    return Err(format!(
                        "codec {s:?}: unknown part {part:?}; expected `raw`, `auto` or parts joined by `+`: \
                         fp16, bf16, int8 (precision), shuffle, lz4, zstd, zstd-LEVEL (compression)"
                    ))
                }
            }
        }
        Ok(codec)
    }
}

/// What a receiver accepts. A payload outside it is refused with a message that names the
/// part; hosts check it at the handshake, before sending anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CodecPolicy {
    /// Precisions accepted.
    pub precisions: Vec<Precision>,
    /// Compression families accepted (`none`, `lz4`, `zstd`).
    pub compressions: Vec<String>,
    /// Whether payloads must be sealed (AES-256-GCM).
    pub require_encryption: bool,
}

impl Default for CodecPolicy {
    fn default() -> Self {
        Self { precisions: Precision::ALL.to_vec(), compressions: ["none", "lz4", "zstd"].map(String::from).to_vec(), require_encryption: false }
    }
}

/// The part of a codec a receiver does not accept.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// A precision outside the accepted ones.
    #[error("precision {refused} is not accepted (accepted: {})", accepted.join(", "))]
    Precision {
        /// The precision asked for.
        refused: &'static str,
        /// Those accepted.
        accepted: Vec<&'static str>,
    },
    /// A compression family outside the accepted ones.
    #[error("compression {refused} is not accepted (accepted: {})", accepted.join(", "))]
    Compression {
        /// The family asked for.
        refused: &'static str,
        /// Those accepted.
        accepted: Vec<String>,
    },
}

impl CodecPolicy {
    /// Whether `codec` is accepted (for `auto`, both codecs it may pick); the error names
    /// the part that is not.
    pub fn check(&self, codec: &Codec) -> Result<(), PolicyError> {
        codec.tensor_codecs().iter().try_for_each(|c| self.check_one(c))
    }

    fn check_one(&self, codec: &Codec) -> Result<(), PolicyError> {
        if !self.precisions.contains(&codec.precision) {
            let accepted = self.precisions.iter().map(|p| p.name()).collect();
            return Err(PolicyError::Precision { refused: codec.precision.name(), accepted });
        }
        if !self.compressions.iter().any(|c| c == codec.compression.family()) {
            return Err(PolicyError::Compression { refused: codec.compression.family(), accepted: self.compressions.clone() });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codec_strings_round_trip_and_bad_ones_say_why() {
        for s in ["raw", "auto", "shuffle+lz4", "fp16+shuffle+zstd-3", "int8+lz4", "bf16", "shuffle", "zstd-19", "zstd--1"] {
            assert_eq!(s.parse::<Codec>().unwrap().to_string(), s);
        }
        assert_eq!("lz4+shuffle".parse::<Codec>().unwrap().to_string(), "shuffle+lz4");
        assert_eq!("zstd".parse::<Codec>().unwrap().compression, Compression::Zstd(3));
        assert!("lz4+zstd".parse::<Codec>().unwrap_err().contains("more than one compression"));
        assert!("fp16+int8".parse::<Codec>().unwrap_err().contains("more than one precision"));
        assert!("gzip".parse::<Codec>().unwrap_err().contains("unknown part \"gzip\""));
        assert!("zstd-40".parse::<Codec>().unwrap_err().contains("zstd level"));
        assert!("fp16+auto".parse::<Codec>().unwrap_err().contains("`auto` stands alone"));
        assert_eq!("auto".parse::<Codec>().unwrap().tensor_codecs(), [Codec::RAW, Codec::SHUFFLE_LZ4]);
    }

    #[test]
    fn policies_name_what_they_refuse() {
        let policy = CodecPolicy { precisions: vec![Precision::Full], compressions: vec!["lz4".into()], require_encryption: false };
        assert!(policy.check(&"shuffle+lz4".parse().unwrap()).is_ok());
        assert_eq!(policy.check(&"fp16+lz4".parse().unwrap()).unwrap_err().to_string(), "precision fp16 is not accepted (accepted: full)");
        assert_eq!(policy.check(&"zstd".parse().unwrap()).unwrap_err(), PolicyError::Compression { refused: "zstd", accepted: vec!["lz4".into()] });
        // `auto` needs both of its codecs.
        assert!(policy.check(&Codec::AUTO).unwrap_err().to_string().contains("compression none is not accepted"));
    }
}
