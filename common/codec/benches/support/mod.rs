//! Real boundary tensors for the codec benches: the safetensors file that
//! `make bench-activations` writes (resnet18 at 224x224, batch 8, three cuts), with tensors
//! named `cut{i}/{tensor name}`.

use std::path::PathBuf;

use cleave_codec::{DType, TensorData};
use safetensors::{Dtype, SafeTensors};

/// The variable that names the activations file.
pub(crate) const ACTIVATIONS_VAR: &str = "CLEAVE_BENCH_ACTIVATIONS";

/// The tensors live at one cut.
pub(crate) struct Cut {
    /// The cut's index in the bundle.
    pub(crate) index: u32,
    /// Its tensors, by name.
    pub(crate) tensors: Vec<TensorData>,
}

impl Cut {
    /// Tensor bytes at this cut, before any encoding.
    pub(crate) fn raw_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.data.len() as u64).sum()
    }

    /// `cut4`.
    pub(crate) fn id(&self) -> String {
        format!("cut{}", self.index)
    }

    /// `cut4 (maxpool float32[8, 64, 56, 56])`, for people.
    pub(crate) fn describe(&self) -> String {
        let tensors: Vec<String> = self.tensors.iter().map(|t| format!("{} {}{:?}", t.name, t.dtype, t.shape)).collect();
        format!("{} ({})", self.id(), tensors.join(", "))
    }
}

/// `$CLEAVE_BENCH_ACTIVATIONS`, or `bundles/resnet18-activations.safetensors`; a relative
/// path is taken from the workspace root (cargo runs benches in the package's directory,
/// examples wherever it was called, so the current directory would mean two things).
pub(crate) fn activations_path() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let root = root.canonicalize().unwrap_or(root);
    let path = std::env::var_os(ACTIVATIONS_VAR).map_or_else(|| PathBuf::from("bundles/resnet18-activations.safetensors"), PathBuf::from);
    root.join(path)
}

fn dtype(d: Dtype) -> Result<DType, String> {
    Ok(match d {
        Dtype::F32 => DType::Float32,
        Dtype::F64 => DType::Float64,
        Dtype::F16 => DType::Float16,
        Dtype::BF16 => DType::Bfloat16,
        Dtype::I64 => DType::Int64,
        Dtype::I32 => DType::Int32,
        Dtype::I16 => DType::Int16,
        Dtype::I8 => DType::Int8,
        Dtype::U8 => DType::Uint8,
        Dtype::BOOL => DType::Bool,
        other => return Err(format!("dtype {other:?} has no cleave equivalent")),
    })
}

/// Every cut in the file, in cut order.
pub(crate) fn load(path: &std::path::Path) -> Result<Vec<Cut>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let file = SafeTensors::deserialize(&bytes).map_err(|e| format!("{}: not a safetensors file: {e}", path.display()))?;
    let mut cuts: Vec<Cut> = Vec::new();
    for (name, view) in file.tensors() {
        let (cut, tensor) = name
            .strip_prefix("cut")
            .and_then(|rest| rest.split_once('/'))
            .and_then(|(index, tensor)| Some((index.parse::<u32>().ok()?, tensor)))
            .ok_or_else(|| format!("{}: tensor {name:?} is not named cut{{i}}/{{name}}", path.display()))?;
        let tensor = TensorData {
            dim_order: Vec::new(),
            name: tensor.to_string(),
            dtype: dtype(view.dtype()).map_err(|e| format!("{name}: {e}"))?,
            shape: view.shape().iter().map(|&d| d as i64).collect(),
            data: view.data().to_vec().into(),
        };
        match cuts.iter_mut().find(|c| c.index == cut) {
            Some(c) => c.tensors.push(tensor),
            None => cuts.push(Cut { index: cut, tensors: vec![tensor] }),
        }
    }
    cuts.sort_by_key(|c| c.index);
    for c in &mut cuts {
        c.tensors.sort_by(|a, b| a.name.cmp(&b.name));
    }
    if cuts.is_empty() {
        return Err(format!("{}: holds no tensor", path.display()));
    }
    Ok(cuts)
}

/// The cuts, or a message saying how to make the file and an exit (status 0: a missing
/// input skips the benches rather than failing a build that runs every target).
pub(crate) fn load_or_exit() -> Vec<Cut> {
    let path = activations_path();
    if !path.exists() {
        eprintln!(
            "no activations file at {} (set {ACTIVATIONS_VAR}, or run `make bench-activations` in the workspace root to write it); nothing measured",
            path.display()
        );
        std::process::exit(0);
    }
    match load(&path) {
        Ok(cuts) => cuts,
        Err(e) => {
            eprintln!("cannot read the activations: {e}");
            std::process::exit(1);
        }
    }
}
