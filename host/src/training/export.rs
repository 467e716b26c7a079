//! Writing trained weights back into a bundle, so that split inference serves them.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use tch::Tensor;

use cleave_common::bundle::{sha256_file, Bundle};
use cleave_common::device::DeviceSpec;
use cleave_common::stages::StageRange;
use cleave_common::training::checkpoint;
use cleave_common::training::{TrainError, TrainableStages};

fn fail(path: &Path, message: impl Into<String>) -> TrainError {
    TrainError::Checkpoint { path: path.to_path_buf(), message: message.into() }
}

/// Writes a copy of `bundle` to `out` with the parameters and buffers of `checkpoints`
/// (together they must cover every stage): the stage files are saved again with the new
/// weights, the reference outputs are recomputed from the reference inputs (so `server
/// check` and `host verify` keep working), the manifest's hashes are updated and it records
/// where the weights came from. Frozen inference stages are left out (they hold the old
/// weights): the new bundle serves its trainable stages until it is exported again. Written beside `out` and renamed into place; an existing
/// `out` is replaced only once the new bundle is complete.
pub fn write_trained_bundle(bundle: &Bundle, checkpoints: &[PathBuf], out: &Path) -> Result<Bundle, TrainError> {
    let mut state: HashMap<String, Tensor> = HashMap::new();
    let mut sources = Vec::new();
    for path in checkpoints {
        let (meta, tensors) = checkpoint::read(path)?;
        if meta.bundle_id != bundle.id() {
            return Err(fail(path, format!("it is of bundle {}, not {}", meta.bundle_id, bundle.id())));
        }
        sources.push(serde_json::json!({ "file": path.display().to_string(), "ranges": meta.ranges, "step": meta.step }));
        state.extend(tensors);
    }
    let mut stages = TrainableStages::load(bundle, StageRange::all(bundle), DeviceSpec::Cpu, 0)?;
    stages
        .load_state(&state)
        .map_err(|error| TrainError::NotCovered { path: checkpoints.first().map_or(out, |p| p.as_path()).to_path_buf(), error })?;

    let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| fail(out, format!("cannot create {}: {e}", parent.display())))?;
    let tmp = parent.join(format!(".{}.partial", out.file_name().and_then(|n| n.to_str()).unwrap_or("bundle")));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| fail(&tmp, e.to_string()))?;
    let written = (|| -> Result<(), TrainError> {
        stages.save_stage_files(&tmp)?;
        let manifest = bundle.manifest();
        for reference in &manifest.references {
            let (input, _) = bundle.reference(reference.batch_size)?;
            let output = stages.evaluate(&input)?;
            let mut tensors: Vec<(String, Tensor)> = input.tensors().into_iter().map(|(n, t)| (format!("input.{n}"), t.shallow_clone())).collect();
            tensors.extend(output.tensors().into_iter().map(|(n, t)| (format!("output.{n}"), t.to_device(tch::Device::Cpu).contiguous())));
            Tensor::write_safetensors(&tensors, tmp.join(&reference.file)).map_err(|e| fail(&tmp, e.to_string()))?;
        }
        let rewritten: Vec<&str> =
            manifest.stages.iter().map(|s| s.file.as_str()).chain(manifest.references.iter().map(|r| r.file.as_str())).collect();
        let raw_path = bundle.dir().join("manifest.json");
        let raw = std::fs::read(&raw_path).map_err(|e| fail(&raw_path, e.to_string()))?;
        let mut raw: serde_json::Value = serde_json::from_slice(&raw).map_err(|e| fail(&raw_path, e.to_string()))?;
        // The frozen inference stages hold the old weights and only the exporter can freeze:
        // the trained bundle serves its trainable stages.
        let stale: Vec<&str> = manifest.stages.iter().filter_map(|s| s.inference_file.as_deref()).collect();
        for stage in raw["stages"].as_array_mut().ok_or_else(|| fail(&raw_path, "no `stages` list"))? {
            stage.as_object_mut().map(|s| s.remove("inference_file"));
        }
        let files = raw["files"].as_object_mut().ok_or_else(|| fail(&raw_path, "no `files` map"))?;
        files.retain(|name, _| !stale.contains(&name.as_str()));
        for (name, hash) in files.iter_mut() {
            if !rewritten.contains(&name.as_str()) {
                std::fs::copy(bundle.dir().join(name), tmp.join(name)).map_err(|e| fail(&tmp, format!("copying {name}: {e}")))?;
            }
            *hash = serde_json::Value::String(sha256_file(&tmp, name)?);
        }
        raw["trained"] = serde_json::json!({ "from_bundle": bundle.id(), "checkpoints": sources });
        let text = serde_json::to_string_pretty(&raw).map_err(|e| fail(&tmp, e.to_string()))? + "\n";
        std::fs::write(tmp.join("manifest.json"), text).map_err(|e| fail(&tmp, e.to_string()))?;
        Ok(())
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if out.exists() {
        std::fs::remove_dir_all(out).map_err(|e| fail(out, format!("cannot replace it: {e}")))?;
    }
    std::fs::rename(&tmp, out).map_err(|e| fail(out, format!("cannot move the new bundle into place: {e}")))?;
    Ok(Bundle::open(out)?)
}
