//! Continuous batching: every step of a model's sessions goes through its queue, one batch
//! at a time on the blocking pool. A decode step takes with it the decode steps of other
//! sessions at the same cut that came while the last batch ran (or within
//! `generation.max_wait`), up to `generation.max_batch` rows, so sessions join and leave
//! between steps. A prompt's step runs alone. The merged caches are a copy of the sessions'
//! own, held in the memory budget while the batch runs; where they do not fit, or the batch
//! fails, each step runs alone.

use cleave_common::pb;
use std::collections::VecDeque;
use std::time::{Duration, Instant};
use tch::Tensor;
use tokio::sync::{mpsc, oneshot};

use super::session::{run_together, BatchKey, Checked, Session};
use crate::budget::MemoryBudget;
use crate::config::GenerationOptions;
use crate::error::{catch_panic, RequestError};
use crate::metrics::Metrics;

/// A step's session back, with the step's output or why it failed.
pub(crate) struct Ran {
    pub(crate) session: Session,
    pub(crate) output: Result<Tensor, RequestError>,
    /// The time its batch (or the step alone) ran.
    pub(crate) compute: Duration,
}

/// A step as it came, to be checked on the blocking pool.
struct Job {
    session: Session,
    step: pb::GenerateStep,
    /// The largest answer (one message).
    answer_limit: u64,
    reply: oneshot::Sender<Ran>,
}

impl Job {
    /// Decode steps (one token a row) of one key may run as one batch; a prompt's runs alone.
    fn key(&self) -> Option<BatchKey> {
        (self.step.tokens == 1).then(|| self.session.batch_key())
    }
}

/// A step checked, its session unchanged.
struct Ready {
    session: Session,
    step: Checked,
    reply: oneshot::Sender<Ran>,
}

/// A model's queue of generation steps; cheap to clone.
#[derive(Clone)]
pub(crate) struct StepQueue {
    jobs: mpsc::Sender<Job>,
}

/// What the queue's worker runs with.
struct Worker {
    options: GenerationOptions,
    budget: MemoryBudget,
    metrics: Metrics,
    label: String,
}

impl StepQueue {
    /// Starts the queue's worker (on the calling runtime) for the model labelled `label`.
    /// Each session has one step in the queue at most: `generation.max_sessions` steps fit.
    pub(crate) fn start(options: GenerationOptions, budget: MemoryBudget, metrics: Metrics, label: String) -> Self {
        let (jobs, queued) = mpsc::channel(options.max_sessions as usize);
        tokio::spawn(Worker { options, budget, metrics, label }.serve(queued));
        Self { jobs }
    }

    /// Runs `step` of `session`: the session back with the output; `None` where the worker
    /// is gone (the runtime is shutting down) and the session with it.
    /// `answer_limit` bounds the output's bytes (it must fit in one message).
    pub(crate) async fn run(&self, session: Session, step: pb::GenerateStep, answer_limit: u64) -> Option<Ran> {
        let (reply, ran) = oneshot::channel();
        self.jobs.send(Job { session, step, answer_limit, reply }).await.ok()?;
        ran.await.ok()
    }
}

impl Worker {
    async fn serve(self, mut queued: mpsc::Receiver<Job>) {
        // Steps taken from the channel that did not fit the batch being gathered.
        let mut waiting = VecDeque::new();
        loop {
            let first = match waiting.pop_front() {
                Some(job) => job,
                None => match queued.recv().await {
                    Some(job) => job,
                    None => return,
                },
            };
            let batch = self.gather(first, &mut waiting, &mut queued).await;
            let held = self.hold_merged_caches(&batch);
            let (metrics, label) = (self.metrics.clone(), self.label.clone());
            let ran = tokio::task::spawn_blocking(move || run_batch(batch, held.is_some(), &metrics, &label));
            // A batch lost to the blocking pool drops its replies: those streams end.
            let _ = ran.await;
        }
    }

    /// `first` and, where it is a decode step, the decode steps of its key waiting or coming
    /// within `max_wait`, up to `max_batch` rows.
    async fn gather(&self, first: Job, waiting: &mut VecDeque<Job>, queued: &mut mpsc::Receiver<Job>) -> Vec<Job> {
        let Some(key) = first.key() else { return vec![first] };
        let max_rows = self.options.max_batch as usize;
        let mut rows = first.session.rows();
        let mut batch = vec![first];
        let fits = |job: &Job, rows: usize| job.key() == Some(key) && rows + job.session.rows() <= max_rows;
        let mut i = 0;
        while i < waiting.len() && rows < max_rows {
            if fits(&waiting[i], rows) {
                let job = waiting.remove(i).expect("in range");
                rows += job.session.rows();
                batch.push(job);
            } else {
                i += 1;
            }
        }
        let deadline = tokio::time::Instant::now() + self.options.max_wait;
        while rows < max_rows {
            let job = match queued.try_recv() {
                Ok(job) => job,
                Err(_) if self.options.max_wait.is_zero() => break,
                Err(_) => match tokio::time::timeout_at(deadline, queued.recv()).await {
                    Ok(Some(job)) => job,
                    _ => break,
                },
            };
            if fits(&job, rows) {
                rows += job.session.rows();
                batch.push(job);
            } else {
                waiting.push_back(job);
            }
        }
        batch
    }

    /// The merged caches' bytes, held in the memory budget; `None` where they do not fit
    /// now (then each step runs alone, on its own caches).
    fn hold_merged_caches(&self, batch: &[Job]) -> Option<crate::budget::Reservation> {
        if batch.len() < 2 {
            return None;
        }
        self.budget.try_reserve(batch.iter().map(|job| job.session.cache_bytes()).sum())
    }
}

/// Runs `batch` (on the blocking pool) and answers each job: those whose steps pass their
/// checks as one batch where `together` (room for the merged caches) and there are more than
/// one, else (or where that fails) each alone.
fn run_batch(batch: Vec<Job>, together: bool, metrics: &Metrics, label: &str) {
    let mut ready = Vec::with_capacity(batch.len());
    for Job { session, step, answer_limit, reply } in batch {
        match catch_panic("checking a generation step", || session.check(&step, answer_limit)) {
            Ok(step) => ready.push(Ready { session, step, reply }),
            Err(e) => {
                let _ = reply.send(Ran { session, output: Err(e), compute: Duration::ZERO });
            }
        }
    }
    let alone = if together && ready.len() > 1 { try_together(ready, metrics, label) } else { Some(ready) };
    for Ready { mut session, step, reply } in alone.unwrap_or_default() {
        let started = Instant::now();
        let output = catch_panic("a generation step", || session.run(step));
        let _ = reply.send(Ran { session, output, compute: started.elapsed() });
    }
}

/// Runs `ready` as one batch and answers it; gives it back where that failed (no session
/// changed: the stages run before any is written).
fn try_together(mut ready: Vec<Ready>, metrics: &Metrics, label: &str) -> Option<Vec<Ready>> {
    let started = Instant::now();
    let ran = {
        let mut steps: Vec<(&mut Session, &Checked)> = ready.iter_mut().map(|r| (&mut r.session, &r.step)).collect();
        catch_panic("a batch of generation steps", || run_together(&mut steps))
    };
    match ran {
        Ok(outputs) => {
            metrics.generation_batch(label, ready.len());
            let compute = started.elapsed();
            for (r, output) in ready.into_iter().zip(outputs) {
                let _ = r.reply.send(Ran { session: r.session, output: Ok(output), compute });
            }
            None
        }
        Err(e) => {
            tracing::warn!(error = %e, sessions = ready.len(), "a batch of generation steps failed; each runs alone");
            Some(ready)
        }
    }
}
