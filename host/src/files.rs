//! The files a run needs on the edge: the bundle, opened on the blocking pool (it hashes
//! every file), and datasets, a missing one named with the `make` target that creates it.

use std::path::Path;

use cleave_common::examples::missing_hint;
use cleave_common::Bundle;

use crate::error::{HostError, Result};

/// `Ok` when `path` exists; else an error that names it and, for an example, its make target.
pub fn require(what: &'static str, path: &Path) -> Result<()> {
    if path.exists() {
        return Ok(());
    }
    Err(HostError::Missing { what, path: path.to_path_buf(), hint: missing_hint(path, "") })
}

/// Opens the bundle at `dir` on the blocking pool (hashing its files takes a while).
pub async fn open_bundle(dir: &Path) -> Result<Bundle> {
    let dir = dir.to_path_buf();
    tokio::task::spawn_blocking(move || Bundle::open(&dir))
        .await
        .map_err(|e| HostError::Invalid(format!("opening the bundle: {e}")))?
        .map_err(HostError::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_example_dataset_names_the_make_target_that_creates_it() {
        let err = require("dataset", Path::new("/nowhere/bundles/digits-train.safetensors")).unwrap_err().to_string();
        assert_eq!(err, "dataset /nowhere/bundles/digits-train.safetensors does not exist: run `make digits-cnn`, which creates it");
        let err = require("dataset", Path::new("/nowhere/mine.safetensors")).unwrap_err().to_string();
        assert_eq!(err, "dataset /nowhere/mine.safetensors does not exist");
        require("dataset", Path::new(env!("CARGO_MANIFEST_DIR"))).unwrap();
    }
}
