//! The files a run needs on the edge: the bundle, opened on the blocking pool (it hashes
//! every file), and datasets, a missing one named with the `make` target that creates it;
//! and the one rule for every command's output directory ([`claim_output`]).

use std::path::Path;

use cleave_common::config::relative_paths_note;
use cleave_common::{Bundle, BundleError};

use crate::config::EdgeConfig;
use crate::error::{HostError, OutputError, Result};
use crate::examples::missing_hint;

/// `Ok` when `path` exists; else an error that names it and, for an example, its make target.
pub fn require(what: &'static str, path: &Path) -> Result<()> {
    if path.exists() {
        return Ok(());
    }
    Err(HostError::Missing { what, path: path.to_path_buf(), hint: missing_hint(path, "") })
}

/// Opens the bundle `config` names; a missing one is said with where the config's relative
/// paths start (a config copied elsewhere looks for its bundle there).
pub async fn open_config_bundle(config: &EdgeConfig) -> Result<Bundle> {
    open_bundle(&config.bundle).await.map_err(|e| match e {
        HostError::Missing { what: BUNDLE, path, hint } => {
            HostError::Missing { what: BUNDLE, path, hint: format!("{}{hint}", relative_paths_note(&config.source)) }
        }
        e => e,
    })
}

/// Opens the bundle at `dir` on the blocking pool (hashing its files takes a while).
pub async fn open_bundle(dir: &Path) -> Result<Bundle> {
    let dir = dir.to_path_buf();
    tokio::task::spawn_blocking(move || bundle(&dir)).await.map_err(|error| HostError::Task { what: "opening the bundle", error })?
}

/// Opens the bundle at `dir`; a missing one is named with how to make it (the `make` target
/// of an example, else the exporter).
pub fn bundle(dir: &Path) -> Result<Bundle> {
    Bundle::open(dir).map_err(|e| match e {
        BundleError::NotFound { dir } => {
            let hint = missing_hint(&dir, ": export one with `python -m cleave_export` (see README.md)");
            HostError::Missing { what: BUNDLE, path: dir, hint }
        }
        e => e.into(),
    })
}

/// What a missing bundle is called in [`HostError::Missing`].
const BUNDLE: &str = "bundle";

/// What to do with an output directory that holds an earlier run (`--force`, `--resume`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum OutputMode {
    /// Refuse it: a run never silently overwrites results.
    #[default]
    Fresh,
    /// Replace it (`--force`).
    Force,
    /// Continue it (`--resume`): requests it answered with a result are kept and not sent
    /// again; those that failed or have no outcome are sent.
    Resume,
}

/// What an earlier run of one command leaves in its output directory.
#[derive(Debug, Clone, Copy)]
pub struct EarlierRun<'a> {
    /// `run`, `training run`, `load run`.
    pub kind: &'a str,
    /// Its files and directories.
    pub files: &'a [&'a str],
    /// How that command continues one (`--resume to continue it`), when it can.
    pub continue_with: Option<&'a str>,
}

/// The one rule for every command's output directory (a run, training, `host load`): created
/// when missing; one that holds an earlier run's files is refused, unless `--force` replaces
/// them (they are removed) or the command continues that run (`Resume`: they are kept).
pub fn claim_output(dir: &Path, earlier: &EarlierRun, mode: OutputMode) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|error| HostError::Io { action: "cannot create output directory", path: dir.into(), error })?;
    let found: Vec<&str> = earlier.files.iter().copied().filter(|f| dir.join(f).exists()).collect();
    match mode {
        _ if found.is_empty() => Ok(()),
        OutputMode::Fresh => Err(OutputError::EarlierRun {
            dir: dir.into(),
            kind: earlier.kind.to_string(),
            found: found.iter().map(|f| f.to_string()).collect(),
            continue_with: earlier.continue_with.map(str::to_string),
        }
        .into()),
        OutputMode::Force => {
            for name in found {
                let path = dir.join(name);
                let removed = if path.is_dir() { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) };
                removed.map_err(|e| HostError::write(&path, e))?;
            }
            Ok(())
        }
        OutputMode::Resume => Ok(()),
    }
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
