//! Tensor element types, named as PyTorch names them.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[allow(missing_docs)]
pub enum DType {
    Float32,
    Float64,
    Float16,
    Bfloat16,
    Int64,
    Int32,
    Int16,
    Int8,
    Uint8,
    Bool,
}

impl DType {
    /// Every dtype, in a fixed order.
    pub const ALL: [DType; 10] =
        [Self::Float32, Self::Float64, Self::Float16, Self::Bfloat16, Self::Int64, Self::Int32, Self::Int16, Self::Int8, Self::Uint8, Self::Bool];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::Float64 | Self::Int64 => 8,
            Self::Float32 | Self::Int32 => 4,
            Self::Float16 | Self::Bfloat16 | Self::Int16 => 2,
            Self::Int8 | Self::Uint8 | Self::Bool => 1,
        }
    }

    /// Whether it is a floating-point dtype (gradients flow only to those).
    pub fn is_float(self) -> bool {
        matches!(self, Self::Float32 | Self::Float64 | Self::Float16 | Self::Bfloat16)
    }

    /// The PyTorch name (`float32`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Self::Float32 => "float32",
            Self::Float64 => "float64",
            Self::Float16 => "float16",
            Self::Bfloat16 => "bfloat16",
            Self::Int64 => "int64",
            Self::Int32 => "int32",
            Self::Int16 => "int16",
            Self::Int8 => "int8",
            Self::Uint8 => "uint8",
            Self::Bool => "bool",
        }
    }

    /// The dtype with this PyTorch name.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|d| d.name() == name)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
