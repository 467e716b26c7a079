//! Checkpoints: one safetensors file per side, with the parameters (`param.NAME`), buffers
//! (`buffer.NAME`) and optimizer state (`optim.NAME.FIELD`) of the stages it trains, and a
//! JSON description in the file's metadata (`cleave.checkpoint`) that a resume checks against.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use super::optim::{Optimizer, OptimizerConfig};
use super::{TrainError, TrainableStages};

/// The metadata key holding [`CheckpointMeta`] as JSON.
pub const META_KEY: &str = "cleave.checkpoint";

/// Ends the name of the temporary file a checkpoint is written to before it is renamed
/// into place (`NAME.safetensors.partial`): one left behind by a crash is never a checkpoint.
pub const TEMPORARY_SUFFIX: &str = ".partial";

/// What a checkpoint is of.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointMeta {
    /// The bundle trained.
    pub bundle_id: String,
    /// The stage ranges the file holds (`[start, end)` each).
    pub ranges: Vec<[usize; 2]>,
    /// Optimizer steps taken.
    pub step: u64,
    /// The optimizer (a resume must use the same).
    pub optimizer: OptimizerConfig,
    /// The session seed (dropout masks).
    pub seed: u64,
    /// Whatever else the side needs to resume (the host: epoch and data position).
    #[serde(default)]
    pub extra: serde_json::Value,
}

fn fail(path: &Path, message: impl Into<String>) -> TrainError {
    TrainError::Checkpoint { path: path.to_path_buf(), message: message.into() }
}

/// Writes the state of `parts` and `optimizer` to `path` (through a temporary file renamed
/// into place, so a crash never leaves half a checkpoint).
pub fn save(path: &Path, meta: &CheckpointMeta, parts: &[&TrainableStages], optimizer: &Optimizer) -> Result<(), TrainError> {
    write(path, meta, parts, optimizer)?.commit()
}

/// The tensor bytes a checkpoint of `parts` and `optimizer` holds: its file is this plus a
/// header of a few KiB. Known before anything is written, so that a quota can refuse first.
pub fn tensor_bytes(parts: &[&TrainableStages], optimizer: &Optimizer) -> u64 {
    let tensors = parts.iter().flat_map(|p| p.state()).chain(optimizer.state_tensors());
    tensors.map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64).sum()
}

/// A checkpoint written to a temporary file beside its path, not yet in place: [`Self::commit`]
/// renames it there; dropping it removes the temporary file.
#[derive(Debug)]
pub struct WrittenCheckpoint {
    path: PathBuf,
    temporary: PathBuf,
    bytes: u64,
    committed: bool,
}

impl WrittenCheckpoint {
    /// The file's size.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Renames the file into place (replacing a checkpoint of the same name).
    pub fn commit(mut self) -> Result<(), TrainError> {
        std::fs::rename(&self.temporary, &self.path)
            .map_err(|e| fail(&self.path, format!("cannot rename {} into place: {e}", self.temporary.display())))?;
        self.committed = true;
        Ok(())
    }
}

impl Drop for WrittenCheckpoint {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.temporary);
        }
    }
}

/// Writes the state of `parts` and `optimizer` to a temporary file beside `path` (its name
/// with [`TEMPORARY_SUFFIX`] added), flushed to disk; the caller checks its size and commits it.
pub fn write(path: &Path, meta: &CheckpointMeta, parts: &[&TrainableStages], optimizer: &Optimizer) -> Result<WrittenCheckpoint, TrainError> {
    let mut tensors: Vec<(String, Tensor)> = parts.iter().flat_map(|p| p.state()).collect();
    tensors.extend(optimizer.state_tensors());
    let mut encoded = Vec::with_capacity(tensors.len());
    for (name, t) in &tensors {
        let t = t.to_device(tch::Device::Cpu).contiguous();
        let dtype =
            safetensors_dtype(t.kind()).ok_or_else(|| fail(path, format!("{name} has dtype {:?}, which checkpoints do not store", t.kind())))?;
        let mut data = vec![0u8; t.numel() * t.kind().elt_size_in_bytes()];
        t.f_copy_data_u8(&mut data, t.numel()).map_err(|e| fail(path, format!("{name}: {e}")))?;
        encoded.push((name.clone(), dtype, t.size().iter().map(|&d| d as usize).collect::<Vec<_>>(), data));
    }
    let views = encoded
        .iter()
        .map(|(name, dtype, shape, data)| Ok((name.as_str(), safetensors::tensor::TensorView::new(*dtype, shape.clone(), data)?)))
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()
        .map_err(|e| fail(path, e.to_string()))?;
    let json = serde_json::to_string(meta).map_err(|e| fail(path, e.to_string()))?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| fail(path, format!("cannot create {}: {e}", dir.display())))?;
    }
    // From here on, dropping `written` removes what was written.
    let mut written = WrittenCheckpoint { path: path.to_path_buf(), temporary: temporary_beside(path), bytes: 0, committed: false };
    safetensors::serialize_to_file(views, Some(HashMap::from([(META_KEY.to_string(), json)])), &written.temporary)
        .map_err(|e| fail(path, e.to_string()))?;
    // On disk before it is renamed: a crash after the rename finds the whole file.
    let file = std::fs::File::open(&written.temporary).and_then(|f| f.sync_all().map(|()| f));
    let file = file.map_err(|e| fail(path, format!("cannot flush {}: {e}", written.temporary.display())))?;
    written.bytes = file.metadata().map_err(|e| fail(path, format!("cannot read the size of {}: {e}", written.temporary.display())))?.len();
    Ok(written)
}

fn temporary_beside(path: &Path) -> PathBuf {
    let mut name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(TEMPORARY_SUFFIX);
    path.with_file_name(name)
}

/// Reads a checkpoint: its metadata and its tensors (on the CPU).
pub fn read(path: &Path) -> Result<(CheckpointMeta, HashMap<String, Tensor>), TrainError> {
    let bytes = std::fs::read(path).map_err(|e| fail(path, format!("cannot read: {e}")))?;
    let file = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| fail(path, format!("not a safetensors file: {e}")))?;
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| fail(path, e.to_string()))?;
    let json = header
        .metadata()
        .as_ref()
        .and_then(|m| m.get(META_KEY))
        .ok_or_else(|| fail(path, format!("no {META_KEY} metadata: not a cleave checkpoint")))?;
    let meta: CheckpointMeta = serde_json::from_str(json).map_err(|e| fail(path, format!("bad {META_KEY} metadata: {e}")))?;
    let mut tensors = HashMap::new();
    for (name, view) in file.tensors() {
        let kind = tch_kind(view.dtype()).ok_or_else(|| fail(path, format!("{name} has dtype {:?}", view.dtype())))?;
        let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        let t = Tensor::f_from_data_size(view.data(), &shape, kind).map_err(|e| fail(path, format!("{name}: {e}")))?;
        tensors.insert(name, t);
    }
    Ok((meta, tensors))
}

/// Restores `parts` and `optimizer` from a checkpoint written for the same bundle, stage
/// ranges and optimizer; returns its metadata.
pub fn restore(path: &Path, parts: &[&TrainableStages], optimizer: &mut Optimizer) -> Result<CheckpointMeta, TrainError> {
    let (meta, tensors) = read(path)?;
    let bundle = parts.first().map(|p| p.bundle().id().to_string()).unwrap_or_default();
    if meta.bundle_id != bundle {
        return Err(fail(path, format!("it is of bundle {}, these stages are of bundle {bundle}", meta.bundle_id)));
    }
    let ranges: Vec<[usize; 2]> = parts.iter().map(|p| [p.range().start, p.range().end]).collect();
    if meta.ranges != ranges {
        return Err(fail(path, format!("it holds stages {:?}, this side trains {:?}", meta.ranges, ranges)));
    }
    if &meta.optimizer != optimizer.config() {
        return Err(fail(path, format!("it was trained with {:?}, this run uses {:?}", meta.optimizer, optimizer.config())));
    }
    let state = |error| TrainError::State { path: path.to_path_buf(), error };
    for part in parts {
        part.load_state(&tensors).map_err(state)?;
    }
    let params: Vec<(String, Tensor)> = parts.iter().flat_map(|p| p.parameters().iter().map(|(n, t)| (n.clone(), t.shallow_clone()))).collect();
    optimizer.load_state(&params, &tensors).map_err(state)?;
    Ok(meta)
}

fn safetensors_dtype(kind: Kind) -> Option<safetensors::Dtype> {
    use safetensors::Dtype as D;
    Some(match kind {
        Kind::Float => D::F32,
        Kind::Double => D::F64,
        Kind::Half => D::F16,
        Kind::BFloat16 => D::BF16,
        Kind::Int64 => D::I64,
        Kind::Int => D::I32,
        Kind::Int16 => D::I16,
        Kind::Int8 => D::I8,
        Kind::Uint8 => D::U8,
        Kind::Bool => D::BOOL,
        _ => return None,
    })
}

fn tch_kind(dtype: safetensors::Dtype) -> Option<Kind> {
    use safetensors::Dtype as D;
    Some(match dtype {
        D::F32 => Kind::Float,
        D::F64 => Kind::Double,
        D::F16 => Kind::Half,
        D::BF16 => Kind::BFloat16,
        D::I64 => Kind::Int64,
        D::I32 => Kind::Int,
        D::I16 => Kind::Int16,
        D::I8 => Kind::Int8,
        D::U8 => Kind::Uint8,
        D::BOOL => Kind::Bool,
        _ => return None,
    })
}
