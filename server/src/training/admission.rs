//! Who may train: an `OpenSession` checked against the bundle (a usable range, an
//! optimizer, a loss exactly when the server holds the last stage, a checkpoint to resume
//! from named `NAMESPACE/NAME`), and
//! the sessions open now. By default a bundle has at most one session at a time, so two
//! hosts cannot train the same weights unknowingly; `training.concurrent_sessions` lets each
//! train its own copy, and the sessions of one client group ([`super::group`]) train one
//! copy together.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cleave_common::pb;
use cleave_common::training::loss::LossKind;
use cleave_common::training::optim::OptimizerConfig;
use cleave_common::training::schedule::{check_clip_norm, Schedule};
use cleave_common::training::SetupError;
use cleave_common::{Bundle, DeviceSpec, StageRange};

use super::checkpoints::{CheckpointRef, CheckpointStore};
use super::group::{Groups, Member};
use super::session::{no_checkpoint_dir, SessionSetup};
use crate::budget::MemoryBudget;
use crate::config::TrainingOptions;
use crate::error::{Busy, GroupError, RequestError};
use crate::peer::Peer;
use crate::scheduler::Turns;

/// The training side of the service: options and the sessions open now.
#[derive(Debug, Clone, Default)]
pub(crate) struct Training {
    pub(crate) options: TrainingOptions,
    sessions: Arc<Sessions>,
    /// The checkpoint directory's namespaces (none without `training.checkpoint_dir`).
    checkpoints: Option<CheckpointStore>,
    groups: Arc<Groups>,
}

#[derive(Debug, Default)]
struct Sessions {
    open: Mutex<Vec<OpenEntry>>,
    next: AtomicU64,
}

/// A session open now.
#[derive(Debug)]
struct OpenEntry {
    id: String,
    bundle: String,
    /// Its client group's name: the sessions of one group train the bundle together.
    group: Option<String>,
    /// Its host's address, when known.
    peer: Option<Peer>,
    opened: Instant,
    /// When its host last sent a frame (a session idle for `training.session_idle_timeout`
    /// is closed).
    heard: Instant,
}

/// A session's place among the open ones; dropping it closes the session.
pub(crate) struct SessionSlot {
    sessions: Arc<Sessions>,
    pub(crate) id: String,
}

impl SessionSlot {
    /// Its host has just sent a frame.
    pub(crate) fn heard(&self) {
        let mut open = self.sessions.open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(entry) = open.iter_mut().find(|e| e.id == self.id) {
            entry.heard = Instant::now();
        }
    }
}

impl Drop for SessionSlot {
    fn drop(&mut self) {
        self.sessions.open.lock().unwrap_or_else(|p| p.into_inner()).retain(|e| e.id != self.id);
        tracing::info!(session = %self.id, "training session closed");
    }
}

impl Training {
    pub(crate) fn new(options: TrainingOptions) -> Self {
        let checkpoints = CheckpointStore::new(&options);
        Self { options, sessions: Arc::default(), checkpoints, groups: Arc::default() }
    }

    /// Takes a place for a new session on `bundle` (of client group `group`) for `peer`, or
    /// says why not.
    pub(crate) fn admit(&self, bundle: &Bundle, group: Option<&str>, peer: Option<Peer>) -> Result<SessionSlot, RequestError> {
        let mut open = self.sessions.open.lock().unwrap_or_else(|p| p.into_inner());
        let several = self.options.concurrent_sessions || group.is_some();
        if several && open.len() >= self.options.max_sessions as usize {
            return Err(Busy::Sessions { open: open.len() }.into());
        }
        let same_bundle = open.iter().find(|e| e.bundle == bundle.id() && (group.is_none() || e.group.as_deref() != group));
        if let Some(holder) = same_bundle.filter(|_| !self.options.concurrent_sessions) {
            return Err(Busy::BundleTrained {
                bundle: bundle.id().to_string(),
                holder: holder.id.clone(),
                open_s: holder.opened.elapsed().as_secs(),
                heard_s: holder.heard.elapsed().as_secs(),
                idle_timeout_s: self.options.session_idle_timeout.as_secs(),
            }
            .into());
        }
        if let Some(peer) = peer.as_ref().filter(|_| several) {
            self.check_peer_share(&open, peer, group)?;
        }
        let id = format!("s{}", self.sessions.next.fetch_add(1, Ordering::Relaxed) + 1);
        let now = Instant::now();
        let entry = OpenEntry { id: id.clone(), bundle: bundle.id().to_string(), group: group.map(str::to_string), peer, opened: now, heard: now };
        open.push(entry);
        Ok(SessionSlot { sessions: Arc::clone(&self.sessions), id })
    }

    /// Refuses a session of `peer` that holds its share of places already
    /// (`training.max_sessions_per_peer`): the sessions of one client group take one place,
    /// its edges being one job, often on one machine.
    fn check_peer_share(&self, open: &[OpenEntry], peer: &Peer, group: Option<&str>) -> Result<(), RequestError> {
        let mine = open.iter().filter(|e| e.peer.as_ref() == Some(peer));
        if group.is_some() && mine.clone().any(|e| e.group.as_deref() == group) {
            return Ok(());
        }
        // A group's name is the host's to choose: it is kept apart from session ids.
        let mut jobs: Vec<(bool, &str)> = mine.map(|e| e.group.as_deref().map_or((false, e.id.as_str()), |g| (true, g))).collect();
        jobs.sort_unstable();
        jobs.dedup();
        let max = self.options.max_sessions_per_peer;
        if jobs.len() >= max as usize {
            return Err(Busy::PeerSessions { peer: peer.to_string(), max }.into());
        }
        Ok(())
    }

    /// Places a session of a client group among its edges (none for a session alone).
    pub(crate) fn join(&self, bundle: &Bundle, open: &pb::OpenSession) -> Result<Option<Member>, RequestError> {
        if open.clients.is_none() {
            return Ok(None);
        }
        let (max_edges, wait) = (self.options.max_sessions, self.options.client_wait_timeout);
        self.groups.join(bundle.id(), open, max_edges, wait).map(Some)
    }

    /// Checks an `OpenSession` against `bundle`; the session then loads on `device` and runs
    /// each call in a turn of that device's scheduler.
    pub(crate) fn setup(
        &self,
        bundle: &Bundle,
        (device, turns): (DeviceSpec, Turns),
        budget: MemoryBudget,
        open: &pb::OpenSession,
    ) -> Result<SessionSetup, RequestError> {
        let n = bundle.stage_count();
        let (start, end) = (open.start as usize, open.end as usize);
        let refused = |e: SetupError| RequestError::Training(e.into());
        if !(start < end && end <= n) {
            return Err(refused(SetupError::StageRange { start, end, stages: n }));
        }
        for cut in [start, end] {
            let info = bundle.cut(cut);
            if !info.usable && cut != n {
                let reason = info.reason.clone().unwrap_or_else(|| "unusable".into());
                return Err(refused(SetupError::Unsplittable { cut, name: info.name.clone(), reason }));
            }
        }
        let optimizer = open.optimizer.as_ref().ok_or_else(|| refused(SetupError::NoOptimizer))?;
        let optimizer = OptimizerConfig::try_from(optimizer).map_err(|e| RequestError::Training(e.into()))?;
        let loss = match (end == n, open.loss.as_str()) {
            (true, "") => return Err(refused(SetupError::LossNotNamed)),
            (true, name) => Some(name.parse::<LossKind>().map_err(|e| refused(SetupError::UnknownLoss(e)))?),
            (false, "") => None,
            (false, name) => return Err(refused(SetupError::LossOnTheEdge { name: name.to_string(), end, stages: n })),
        };
        let schedule = match &open.schedule {
            Some(s) => Schedule::try_from(s).map_err(|e| RequestError::Training(e.into()))?,
            None => Schedule::default(),
        };
        if open.clip_grad_norm != 0.0 {
            check_clip_norm(open.clip_grad_norm).map_err(|e| RequestError::Training(e.into()))?;
        }
        let pipeline_depth = open.pipeline_depth.max(1);
        if pipeline_depth > self.options.max_pipeline_depth {
            return Err(refused(SetupError::PipelineDepth { asked: pipeline_depth, max: self.options.max_pipeline_depth }));
        }
        let resume = match open.resume.as_str() {
            "" => None,
            _ if open.clients.is_some() => return Err(GroupError::NoResume.into()),
            _ if self.checkpoints.is_none() => return Err(no_checkpoint_dir()),
            text => Some(CheckpointRef::parse(text)?),
        };
        Ok(SessionSetup {
            bundle: bundle.clone(),
            range: StageRange::new(start, end),
            device,
            turns,
            optimizer,
            schedule,
            clips: open.clip_grad_norm != 0.0,
            pipeline_depth,
            max_kept_answer_bytes: self.options.max_kept_answer_bytes,
            budget,
            loss,
            seed: open.seed,
            resume,
            checkpoints: self.checkpoints.clone(),
            member: None,
        })
    }
}
