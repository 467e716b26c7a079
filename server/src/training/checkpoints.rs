//! Where sessions keep their checkpoints: one namespace (a directory under
//! `training.checkpoint_dir`) per line of training, held by one session at a time, with a
//! count and a byte quota.
//!
//! A new session gets a fresh namespace (`YYYYMMDD-HHMMSS-SESSION`, never one that exists);
//! a session that resumes from `NAMESPACE/NAME` continues in that namespace. While a session
//! is open no other session can take its namespace, and a session writes only into its own,
//! so no session overwrites another's checkpoints (resuming is the one way to continue a
//! namespace, once its session has closed). Names are checked here: no paths, no `..`.
//! Checkpoints are written to a temporary file, flushed and renamed into place, so a crash
//! never leaves half a checkpoint under its name; temporary files a crash left are removed
//! when the namespace is next taken. The directory is shared by the sessions of one server;
//! two servers must not share one. Every namespace's checkpoints together stay within
//! `training.max_checkpoint_bytes_total` (saves are checked against it one at a time).
//! Nothing here deletes a checkpoint: that is an operator's decision.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::SystemTime;

use cleave_common::training::checkpoint::{self, CheckpointMeta, TEMPORARY_SUFFIX};
use cleave_common::training::optim::Optimizer;
use cleave_common::training::{SetupError, TrainableStages};

use crate::config::TrainingOptions;
use crate::error::{Busy, RequestError, SessionError};

/// A checkpoint file's extension.
const EXTENSION: &str = ".safetensors";

/// The server's checkpoint directory, its quotas, and the namespaces open sessions hold.
#[derive(Debug, Clone)]
pub(crate) struct CheckpointStore {
    dir: PathBuf,
    max_checkpoints: u32,
    max_bytes: u64,
    max_total_bytes: u64,
    /// Each namespace held now, with the session holding it.
    held: Arc<Mutex<HashMap<String, String>>>,
    /// Held by a save from its quota checks to its rename, so that two saves cannot both fit
    /// in the room that one leaves.
    saving: Arc<Mutex<()>>,
}

/// A checkpoint a request names to resume from: `NAMESPACE/NAME`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CheckpointRef {
    pub(crate) namespace: String,
    pub(crate) name: String,
}

fn refused(error: SetupError) -> RequestError {
    RequestError::Training(error.into())
}

/// Checks a checkpoint name: a file name, never a path.
pub(crate) fn check_name(name: &str) -> Result<(), RequestError> {
    let valid = !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if valid {
        Ok(())
    } else {
        Err(refused(SetupError::CheckpointName(name.to_string())))
    }
}

/// Checks a namespace: a directory name of letters, digits, '-' and '_'.
fn check_namespace(namespace: &str) -> Result<(), RequestError> {
    let valid = !namespace.is_empty() && namespace.len() <= 64 && namespace.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_'));
    if valid {
        Ok(())
    } else {
        Err(refused(SetupError::CheckpointNamespace(namespace.to_string())))
    }
}

impl CheckpointRef {
    /// Reads `NAMESPACE/NAME`, both parts checked.
    pub(crate) fn parse(text: &str) -> Result<Self, RequestError> {
        let Some((namespace, name)) = text.split_once('/') else {
            return Err(refused(SetupError::ResumeForm(text.to_string())));
        };
        check_namespace(namespace)?;
        check_name(name)?;
        Ok(Self { namespace: namespace.to_string(), name: name.to_string() })
    }
}

impl CheckpointStore {
    /// The store of a server with `options`; none without a checkpoint directory.
    pub(crate) fn new(options: &TrainingOptions) -> Option<Self> {
        let dir = options.checkpoint_dir.clone()?;
        Some(Self {
            dir,
            max_checkpoints: options.max_checkpoints,
            max_bytes: options.max_checkpoint_bytes,
            max_total_bytes: options.max_checkpoint_bytes_total,
            held: Arc::default(),
            saving: Arc::default(),
        })
    }

    /// Bytes of every checkpoint in every namespace.
    fn total_bytes(&self) -> Result<u64, RequestError> {
        let namespaces = match std::fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(error) => return Err(SessionError::CheckpointsUnlisted { what: "the checkpoint directory", dir: self.dir.clone(), error }.into()),
        };
        let mut total = 0;
        for namespace in namespaces.flatten().filter(|e| e.file_type().is_ok_and(|t| t.is_dir())) {
            total += checkpoints_in(&namespace.path())?.values().sum::<u64>();
        }
        Ok(total)
    }

    /// Takes a namespace for `session`: `resume`'s (refused while another session holds it),
    /// or a fresh one. Blocking (it looks at the directory): call it on the session's thread.
    pub(crate) fn claim(&self, session: &str, resume: Option<&str>) -> Result<Namespace, RequestError> {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let name = match resume {
            Some(namespace) => {
                if let Some(holder) = held.get(namespace) {
                    return Err(RequestError::AlreadyTraining { namespace: namespace.to_string(), holder: holder.clone() });
                }
                namespace.to_string()
            }
            None => {
                let stem = format!("{}-{session}", utc_stamp(SystemTime::now()));
                (1..)
                    .map(|k| if k == 1 { stem.clone() } else { format!("{stem}-{k}") })
                    .find(|n| !held.contains_key(n) && !self.dir.join(n).exists())
                    .expect("an unused name")
            }
        };
        held.insert(name.clone(), session.to_string());
        drop(held);
        let namespace = Namespace { store: self.clone(), name };
        if resume.is_some() {
            namespace.remove_temporaries();
        }
        Ok(namespace)
    }
}

/// A namespace one session holds: only it writes there while it is open. Dropping it
/// frees the namespace (and removes its directory if nothing was saved there).
#[derive(Debug)]
pub(crate) struct Namespace {
    store: CheckpointStore,
    name: String,
}

impl Drop for Namespace {
    fn drop(&mut self) {
        // Fails, as it should, when the directory holds anything.
        let _ = std::fs::remove_dir(self.dir());
        self.store.held.lock().unwrap_or_else(PoisonError::into_inner).remove(&self.name);
    }
}

impl Namespace {
    /// Its name, which the session is told.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    fn dir(&self) -> PathBuf {
        self.store.dir.join(&self.name)
    }

    /// The file of checkpoint `name` in this namespace.
    pub(crate) fn path(&self, name: &str) -> Result<PathBuf, RequestError> {
        check_name(name)?;
        Ok(self.dir().join(format!("{name}{EXTENSION}")))
    }

    /// Temporary files are this session's alone while it holds the namespace: any found
    /// when it is taken were left by a crash.
    fn remove_temporaries(&self) {
        let Ok(entries) = std::fs::read_dir(self.dir()) else { return };
        for entry in entries.flatten() {
            let is_file = entry.file_type().is_ok_and(|t| t.is_file());
            if is_file && entry.file_name().to_string_lossy().ends_with(TEMPORARY_SUFFIX) {
                tracing::info!(path = %entry.path().display(), "removing a checkpoint a crash left half written");
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }

    /// The checkpoints in this namespace now, each with its size.
    fn checkpoints(&self) -> Result<HashMap<String, u64>, RequestError> {
        checkpoints_in(&self.dir())
    }

    /// Saves checkpoint `name` of `parts` and `optimizer` in this namespace, within its
    /// quotas: refused (RESOURCE_EXHAUSTED, nothing left on disk) when it would be one
    /// checkpoint more than `training.max_checkpoints`, take the namespace over
    /// `training.max_checkpoint_bytes` or the server's checkpoints over
    /// `training.max_checkpoint_bytes_total`; a checkpoint of the same name is replaced, and
    /// counts once.
    pub(crate) fn save(&self, name: &str, meta: &CheckpointMeta, parts: &[&TrainableStages], optimizer: &Optimizer) -> Result<u64, RequestError> {
        let path = self.path(name)?;
        let _one_at_a_time = self.store.saving.lock().unwrap_or_else(PoisonError::into_inner);
        let existing = self.checkpoints()?;
        let elsewhere = self.store.total_bytes()?.saturating_sub(existing.values().sum::<u64>());
        let replaced = existing.get(name).copied();
        let (max_count, max_bytes) = (self.store.max_checkpoints, self.store.max_bytes);
        if replaced.is_none() && existing.len() >= max_count as usize {
            let (name, namespace) = (name.to_string(), self.name.clone());
            return Err(Busy::CheckpointCount { name, namespace, held: existing.len(), max: max_count }.into());
        }
        let others: u64 = existing.values().sum::<u64>() - replaced.unwrap_or(0);
        let over = |bytes: u64, what: &'static str| -> RequestError {
            let (name, namespace) = (name.to_string(), self.name.clone());
            Busy::CheckpointBytes { name, what, bytes, namespace, others, max: max_bytes }.into()
        };
        let max_total = self.store.max_total_bytes;
        let over_total = |bytes: u64, what: &'static str| -> RequestError {
            Busy::CheckpointBytesTotal { name: name.to_string(), what, bytes, others: elsewhere + others, max: max_total }.into()
        };
        let estimate = checkpoint::tensor_bytes(parts, optimizer);
        if others.saturating_add(estimate) > max_bytes {
            return Err(over(estimate, "would hold at least"));
        }
        if (elsewhere + others).saturating_add(estimate) > max_total {
            return Err(over_total(estimate, "would hold at least"));
        }
        let written = checkpoint::write(&path, meta, parts, optimizer)?;
        let bytes = written.bytes();
        // Dropping `written` removes the temporary file.
        if others.saturating_add(bytes) > max_bytes {
            return Err(over(bytes, "holds"));
        }
        if (elsewhere + others).saturating_add(bytes) > max_total {
            return Err(over_total(bytes, "holds"));
        }
        written.commit()?;
        Ok(bytes)
    }
}

/// The checkpoints in directory `dir`, each with its size (none when it does not exist).
fn checkpoints_in(dir: &std::path::Path) -> Result<HashMap<String, u64>, RequestError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(HashMap::new()),
        Err(error) => return Err(SessionError::CheckpointsUnlisted { what: "checkpoint namespace", dir: dir.to_path_buf(), error }.into()),
    };
    let mut found = HashMap::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(stem) = name.strip_suffix(EXTENSION) else { continue };
        // Only files count: an entry's metadata does not follow a link.
        if let Some(meta) = entry.metadata().ok().filter(|m| m.is_file()) {
            found.insert(stem.to_string(), meta.len());
        }
    }
    Ok(found)
}

fn utc_stamp(at: SystemTime) -> String {
    let secs = at.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rest) = ((secs / 86_400) as i64, secs % 86_400);
    // Days since 1970-01-01 to a civil date (proleptic Gregorian; H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}{month:02}{day:02}-{:02}{:02}{:02}", rest / 3600, rest % 3600 / 60, rest % 60)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn stamps_are_utc_dates() {
        let at = |secs: u64| utc_stamp(SystemTime::UNIX_EPOCH + Duration::from_secs(secs));
        assert_eq!(at(0), "19700101-000000");
        assert_eq!(at(951_782_400 + 3_661), "20000229-010101");
        assert_eq!(at(1_718_022_794), "20240610-123314");
    }

    #[test]
    fn resume_names_a_namespace_and_a_file_name() {
        assert_eq!(CheckpointRef::parse("s-1/step-3").unwrap(), CheckpointRef { namespace: "s-1".into(), name: "step-3".into() });
        for (text, says) in [
            ("step-3", "NAMESPACE/NAME"),
            ("../step-3", "checkpoint namespace"),
            ("a/../b", "checkpoint name"),
            ("a/b/c", "checkpoint name"),
            ("/step-3", "checkpoint namespace"),
            ("a./step-3", "checkpoint namespace"),
            ("a/.hidden", "checkpoint name"),
        ] {
            let err = CheckpointRef::parse(text).unwrap_err().to_string();
            assert!(err.contains(says), "{text}: {err}");
        }
    }

    #[test]
    fn a_held_namespace_is_refused_and_freed_when_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let options = TrainingOptions { checkpoint_dir: Some(dir.path().to_path_buf()), ..TrainingOptions::default() };
        let store = CheckpointStore::new(&options).unwrap();
        let a = store.claim("s1", None).unwrap();
        let b = store.claim("s1", None).unwrap();
        assert_ne!(a.name(), b.name(), "fresh namespaces are distinct");
        assert!(a.name().ends_with("-s1"), "{}", a.name());
        let err = store.claim("s2", Some(a.name())).unwrap_err().to_string();
        assert!(err.contains("held by session s1"), "{err}");
        // A crash's temporary file is removed when the namespace is taken again.
        std::fs::create_dir(dir.path().join(a.name())).unwrap();
        let partial = dir.path().join(a.name()).join(format!("step-1{EXTENSION}{TEMPORARY_SUFFIX}"));
        std::fs::write(&partial, b"half").unwrap();
        let name = a.name().to_string();
        drop(a);
        let again = store.claim("s2", Some(&name)).unwrap();
        assert!(!partial.exists());
        drop((again, b));
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "empty namespaces are removed");
    }
}
