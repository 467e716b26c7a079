//! Continuous batching. A model's decode steps (one token a row) go through its queue, one
//! batch at a time on its device's scheduler (a [`DeviceTask`](crate::scheduler::DeviceTask),
//! in its turn among the device's other work): a step takes with it the decode steps of other
//! sessions of its range that came while the last batch ran, or within `generation.max_wait`
//! of its own arrival while other sessions are open, up to `generation.max_batch` rows, so
//! sessions join and leave between steps. A batch is filled by turns from the steps waiting
//! when it is gathered: every peer with one has one in it before any peer has a second, so a
//! peer with many sessions does not push another's steps to later batches (steps that come
//! during `max_wait` join in their order of arrival). A batch's caches are a copy of the positions its
//! rows have written, held in the memory budget while it runs; where they do not fit, or the
//! batch fails, each of its steps runs alone.
//!
//! A prompt's step (and every step where `max_batch` is 1) goes to the scheduler by itself,
//! beside the batches, in parts of at most `generation.prefill_chunk_tokens` rows x positions,
//! each part a turn of its own; a peer has one part in the device's queue at a time. So a long
//! prompt, or a peer's many prompts, hold the device a part at a time, and the work of every
//! other peer and of the batches runs between them.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cleave_common::pb;
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use super::admission::Generation;
use super::session::{run_together, Answer, Checked, Partial, Session};
use crate::budget::{MemoryBudget, Reservation};
use crate::config::GenerationOptions;
use crate::error::{catch_panic, lock, RequestError};
use crate::log_every::LogEvery;
use crate::metrics::Metrics;
use crate::models::Model;
use crate::peer::Peer;
use crate::scheduler::DeviceScheduler;

/// A step's session back, with the step's output or why it failed.
pub(crate) struct Ran {
    pub(crate) session: Session,
    pub(crate) output: Result<Answer, RequestError>,
    /// The time its checks took (its tensors made from its bytes).
    pub(crate) decode: Duration,
    /// The time its batch (or the step alone) ran.
    pub(crate) compute: Duration,
}

/// A decode step as it came, to be checked on the blocking pool.
struct Job {
    session: Session,
    step: pb::GenerateStep,
    /// The largest answer (one message).
    answer_limit: u64,
    arrived: tokio::time::Instant,
    reply: oneshot::Sender<Ran>,
}

/// A step checked, its session unchanged.
struct Ready {
    session: Session,
    step: Checked,
    decode: Duration,
}

/// What a turn of the device did with a step run by itself: ran it, or the part of it it
/// may run in one turn.
enum Turned {
    Ran(Ran),
    Part(Part),
}

/// A step run by itself, part-way.
struct Part {
    session: Session,
    partial: Partial,
    decode: Duration,
    /// The time its parts have taken so far.
    compute: Duration,
}

/// Every model's step queue, each started at its model's first decode step; cheap to clone.
#[derive(Clone)]
pub(crate) struct StepQueues {
    inner: Arc<Inner>,
}

struct Inner {
    shared: Shared,
    /// By bundle id.
    queues: Mutex<HashMap<String, mpsc::Sender<Job>>>,
    /// Each peer's one place in each device's queue for the steps it runs by itself, by peer
    /// and device.
    places: Mutex<HashMap<(Peer, String), Arc<Semaphore>>>,
}

/// What every queue's worker shares.
#[derive(Clone)]
struct Shared {
    /// The options, and how many sessions of the batch's range are open: a batch holding all
    /// of them waits for no more.
    generation: Generation,
    budget: MemoryBudget,
    metrics: Metrics,
}

/// What a model's queue's worker runs with.
struct Worker {
    shared: Shared,
    /// The model's label (its bundle id).
    label: String,
    /// Its device's scheduler, and its index there.
    device: DeviceScheduler,
    index: usize,
    /// Its batches that failed, for a log line at most every [`FAILED_BATCH_LOG_EVERY`].
    failures: Arc<Mutex<LogEvery>>,
}

/// A failed batch of a model is logged at most once this often: a peer can make each of its
/// batches fail (steps whose logits rank nothing), and a line each would flood the log.
const FAILED_BATCH_LOG_EVERY: Duration = Duration::from_secs(10);

/// What a step's rows are to the scheduler.
const TASK: &str = "generate";

impl StepQueues {
    pub(crate) fn new(generation: Generation, budget: MemoryBudget, metrics: Metrics) -> Self {
        let shared = Shared { generation, budget, metrics };
        Self { inner: Arc::new(Inner { shared, queues: Mutex::default(), places: Mutex::default() }) }
    }

    /// Runs `step` of `session`, a session of `model`, on its device: the session back with
    /// the output; `None` where the device or the queue lost it (the device failed, the
    /// runtime is shutting down), or its caller is `gone` between two parts of a step run by
    /// itself. `answer_limit` bounds the output's bytes (it must fit in one message).
    pub(crate) async fn run(
        &self,
        model: &Model,
        session: Session,
        step: pb::GenerateStep,
        answer_limit: u64,
        gone: &CancellationToken,
    ) -> Option<Ran> {
        if step.tokens != 1 || self.inner.shared.generation.options().max_batch == 1 {
            return self.run_alone(model, session, step, answer_limit, gone).await;
        }
        let (reply, ran) = oneshot::channel();
        let job = Job { session, step, answer_limit, arrived: tokio::time::Instant::now(), reply };
        self.queue(model).send(job).await.ok()?;
        ran.await.ok()
    }

    /// Runs `step` by itself, a part at a time (see the module's text): each part waits for
    /// its peer's place, then for its turn of the device; none runs once its caller is `gone`.
    async fn run_alone(&self, model: &Model, session: Session, step: pb::GenerateStep, answer_limit: u64, gone: &CancellationToken) -> Option<Ran> {
        let (rows, peer) = (session.rows(), session.peer().cloned());
        let positions = (i64::from(self.inner.shared.generation.options().prefill_chunk_tokens) / rows as i64).max(1);
        let mut turned = {
            let _place = self.place(peer.as_ref(), model).await;
            model.scheduler.run(model.index, TASK, rows, move || start_alone(session, &step, answer_limit, positions)).await.ok()?
        };
        loop {
            match turned {
                Turned::Ran(ran) => return Some(ran),
                Turned::Part(_) if gone.is_cancelled() => return None,
                Turned::Part(part) => {
                    let _place = self.place(peer.as_ref(), model).await;
                    turned = model.scheduler.run(model.index, TASK, rows, move || part.run_next(positions)).await.ok()?;
                }
            }
        }
    }

    /// `peer`'s place in `model`'s device's queue, once its last part there has run (none
    /// in-process).
    async fn place(&self, peer: Option<&Peer>, model: &Model) -> Option<OwnedSemaphorePermit> {
        let key = (peer?.clone(), model.device.clone());
        let place = {
            let mut places = lock(&self.inner.places);
            match places.get(&key) {
                Some(place) => Arc::clone(place),
                None => {
                    // (The places of peers with nothing waiting are forgotten as others are made.)
                    places.retain(|_, place| Arc::strong_count(place) > 1);
                    Arc::clone(places.entry(key).or_insert_with(|| Arc::new(Semaphore::new(1))))
                }
            }
        };
        place.acquire_owned().await.ok()
    }

    /// `model`'s queue, its worker started (on the calling runtime) where there is none or
    /// the last is gone. Each session has one step in a queue at most: `max_sessions` fit.
    fn queue(&self, model: &Model) -> mpsc::Sender<Job> {
        let label = model.bundle.id();
        let mut queues = lock(&self.inner.queues);
        match queues.get(label) {
            Some(jobs) if !jobs.is_closed() => jobs.clone(),
            _ => {
                let (jobs, queued) = mpsc::channel(self.inner.shared.generation.options().max_sessions as usize);
                let worker = Worker {
                    shared: self.inner.shared.clone(),
                    label: label.to_string(),
                    device: model.scheduler.clone(),
                    index: model.index,
                    failures: Arc::new(Mutex::new(LogEvery::new(FAILED_BATCH_LOG_EVERY))),
                };
                tokio::spawn(worker.serve(queued));
                queues.insert(label.to_string(), jobs.clone());
                jobs
            }
        }
    }
}

impl Worker {
    fn options(&self) -> GenerationOptions {
        self.shared.generation.options()
    }

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
            let (together, metrics, label, failures) = (held.is_some(), self.shared.metrics.clone(), self.label.clone(), Arc::clone(&self.failures));
            let rows = batch.iter().map(|job| job.session.rows()).sum();
            let ran = self.device.run(self.index, TASK, rows, move || {
                // The merged caches' bytes are held until the batch has run.
                let _held = held;
                run_batch(batch, together, &metrics, &label, &failures)
            });
            // Answered here, once the device has counted the batch; a batch the device lost
            // drops its replies: those streams end.
            for (reply, ran) in ran.await.unwrap_or_default() {
                let _ = reply.send(ran);
            }
        }
    }

    /// `first` and the decode steps of its key waiting or coming, up to `max_batch` rows,
    /// taken by turns: of the steps waiting that fit, the one whose peer has the fewest rows
    /// in the batch, the earliest among equals. It waits for more until `max_wait` after
    /// `first` came while it holds fewer steps than sessions of its model and range are open
    /// (a lone session never waits, whatever other models' or ranges' sessions do), and not at
    /// all while steps of other keys wait (a batch never holds up another).
    async fn gather(&self, first: Job, waiting: &mut VecDeque<Job>, queued: &mut mpsc::Receiver<Job>) -> Vec<Job> {
        let key = first.session.batch_key();
        let options = self.options();
        let max_rows = options.max_batch as usize;
        let fits = |job: &Job, rows: usize| job.session.batch_key() == key && rows + job.session.rows() <= max_rows;
        while let Ok(job) = queued.try_recv() {
            waiting.push_back(job);
        }
        let mut rows = first.session.rows();
        let mut batch = vec![first];
        while let Some(i) = next_turn(waiting, &batch, |job| fits(job, rows)) {
            let job = waiting.remove(i).expect("in range");
            rows += job.session.rows();
            batch.push(job);
        }
        let deadline = batch[0].arrived + options.max_wait;
        let open = self.shared.generation.open_sessions(&self.label, key.range);
        while rows < max_rows {
            let job = match queued.try_recv() {
                Ok(job) => job,
                // Not a timer already past its deadline: tokio's fire at its next millisecond
                // tick, which added about 1 ms to every decode step with `max_wait` 0.
                Err(_) if !waiting.is_empty() || batch.len() >= open || tokio::time::Instant::now() >= deadline => break,
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

    /// The merged caches' bytes (every session's up to the furthest position the batch
    /// writes, as the steps say before they are checked), held in the memory budget; `None`
    /// where they do not fit now (then each step runs alone, on its own caches).
    fn hold_merged_caches(&self, batch: &[Job]) -> Option<Reservation> {
        if batch.len() < 2 {
            return None;
        }
        let reach = batch.iter().flat_map(|job| &job.step.positions_from).map(|&at| u64::from(at) + 1).max().unwrap_or(1);
        let per_position: u64 = batch.iter().map(|job| job.session.cache_bytes_per_position()).sum();
        self.shared.budget.try_reserve(per_position.saturating_mul(reach))
    }
}

/// Of the steps `waiting` that `fit`, the index of the one whose turn it is in `batch`: its
/// peer's rows there the fewest, the earliest among equals.
fn next_turn(waiting: &VecDeque<Job>, batch: &[Job], fit: impl Fn(&Job) -> bool) -> Option<usize> {
    fn of(job: &Job) -> (Option<&Peer>, usize) {
        (job.session.peer(), job.session.rows())
    }
    turn_among(waiting.iter().map(|job| (of(job), fit(job))), batch.iter().map(of))
}

/// [`next_turn`] over each waiting step's peer and rows, and whether it fits.
fn turn_among<'a>(
    waiting: impl Iterator<Item = ((Option<&'a Peer>, usize), bool)>,
    batch: impl Iterator<Item = (Option<&'a Peer>, usize)> + Clone,
) -> Option<usize> {
    let rows_of = |peer| batch.clone().filter(|(p, _)| *p == peer).map(|(_, rows)| rows).sum::<usize>();
    waiting.enumerate().filter(|(_, (_, fits))| *fits).min_by_key(|(i, ((peer, _), _))| (rows_of(*peer), *i)).map(|(i, _)| i)
}

/// Checks `step` and runs its first `positions` (every row's).
fn start_alone(session: Session, step: &pb::GenerateStep, answer_limit: u64, positions: i64) -> Turned {
    match check(session, step, answer_limit) {
        Ok(Ready { session, step, decode }) => Part { session, partial: step.in_parts(), decode, compute: Duration::ZERO }.run_next(positions),
        Err(ran) => Turned::Ran(*ran),
    }
}

impl Part {
    /// Runs its next `positions`: the session back with the answer once the step has run.
    fn run_next(mut self, positions: i64) -> Turned {
        let started = Instant::now();
        let output = catch_panic("a generation step", || self.session.run_part(&mut self.partial, positions));
        self.compute += started.elapsed();
        let output = match output {
            Ok(None) => return Turned::Part(self),
            Ok(Some(answer)) => Ok(answer),
            Err(e) => Err(e),
        };
        Turned::Ran(Ran { session: self.session, output, decode: self.decode, compute: self.compute })
    }
}

/// `step` checked against `session` (timed), or the session back with why not.
fn check(session: Session, step: &pb::GenerateStep, answer_limit: u64) -> Result<Ready, Box<Ran>> {
    let started = Instant::now();
    let checked = catch_panic("checking a generation step", || session.check(step, answer_limit));
    let decode = started.elapsed();
    match checked {
        Ok(step) => Ok(Ready { session, step, decode }),
        Err(e) => Err(Box::new(Ran { session, output: Err(e), decode, compute: Duration::ZERO })),
    }
}

impl Ready {
    fn run_alone(mut self) -> Ran {
        let started = Instant::now();
        let output = catch_panic("a generation step", || self.session.run(self.step));
        Ran { session: self.session, output, decode: self.decode, compute: started.elapsed() }
    }
}

/// Runs `batch` (on its device's scheduler): each job's reply with its answer, for the worker
/// to send once the device has counted the batch. Steps that pass their checks run as one
/// batch where `together` (room for the merged caches) and there are more than one, else each
/// alone.
fn run_batch(batch: Vec<Job>, together: bool, metrics: &Metrics, label: &str, failures: &Mutex<LogEvery>) -> Vec<(oneshot::Sender<Ran>, Ran)> {
    let (mut ready, mut replies, mut answers) = (Vec::with_capacity(batch.len()), Vec::with_capacity(batch.len()), Vec::new());
    for Job { session, step, answer_limit, reply, .. } in batch {
        match check(session, &step, answer_limit) {
            Ok(checked) => {
                ready.push(checked);
                replies.push(reply);
            }
            Err(ran) => answers.push((reply, *ran)),
        }
    }
    let ran = if together && ready.len() > 1 {
        run_together_or_alone(ready, metrics, label, failures)
    } else {
        ready.into_iter().map(Ready::run_alone).collect()
    };
    answers.extend(replies.into_iter().zip(ran));
    answers
}

/// Runs `ready` as one batch; where that fails (before any session changed), each alone.
fn run_together_or_alone(mut ready: Vec<Ready>, metrics: &Metrics, label: &str, failures: &Mutex<LogEvery>) -> Vec<Ran> {
    let started = Instant::now();
    let ran = {
        let mut steps: Vec<(&mut Session, &Checked)> = ready.iter_mut().map(|r| (&mut r.session, &r.step)).collect();
        catch_panic("a batch of generation steps", || run_together(&mut steps))
    };
    match ran {
        Ok(outputs) => {
            metrics.generation_batch(label, ready.len());
            let compute = started.elapsed();
            ready.into_iter().zip(outputs).map(|(r, output)| Ran { session: r.session, output: Ok(output), decode: r.decode, compute }).collect()
        }
        Err(e) => {
            if let Some(unlogged) = lock(failures).came(Instant::now()) {
                tracing::warn!(error = %e, sessions = ready.len(), unlogged, "a batch of generation steps failed; each runs alone");
            }
            ready.into_iter().map(Ready::run_alone).collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The batch each peer's steps make, filled by [`turn_among`] from `waiting` (peer, rows)
    /// up to `max_rows`, `first` already in it.
    fn fill<'a>(first: (Option<&'a Peer>, usize), waiting: &[(Option<&'a Peer>, usize)], max_rows: usize) -> Vec<(Option<&'a Peer>, usize)> {
        let mut waiting = waiting.to_vec();
        let mut batch = vec![first];
        loop {
            let rows: usize = batch.iter().map(|(_, r)| r).sum();
            let candidates = waiting.iter().map(|&step| (step, rows + step.1 <= max_rows));
            let Some(i) = turn_among(candidates, batch.iter().copied()) else { return batch };
            batch.push(waiting.remove(i));
        }
    }

    #[test]
    fn a_batch_is_filled_by_turns_every_peer_once_before_any_twice() {
        let peer = |last: u8| Peer::Address(crate::peer::PeerGroup::of(std::net::IpAddr::from([192, 0, 2, last])));
        let peers = [peer(1), peer(2), peer(3)];
        let (hog, other, third) = (Some(&peers[0]), Some(&peers[1]), Some(&peers[2]));
        // The hog's steps came first, the others' last: each other peer still has one in the
        // batch of 4, and the hog's second comes after them.
        let waiting = [(hog, 1), (hog, 1), (hog, 1), (hog, 1), (other, 1), (third, 1)];
        assert_eq!(fill((hog, 1), &waiting, 4), [(hog, 1), (other, 1), (third, 1), (hog, 1)]);
        // Turns count rows: a peer with a 3-row step in the batch waits behind one of 1 row.
        let waiting = [(other, 1), (hog, 1), (other, 1), (third, 2)];
        assert_eq!(fill((other, 3), &waiting, 8), [(other, 3), (hog, 1), (third, 2), (other, 1), (other, 1)]);
        // A step that does not fit is passed over for one that does, the earliest first.
        let waiting = [(other, 4), (hog, 1), (third, 1)];
        assert_eq!(fill((hog, 2), &waiting, 4), [(hog, 2), (third, 1), (hog, 1)]);
        // In-process steps (no peer) are one peer.
        assert_eq!(fill((None, 1), &[(None, 1), (hog, 1)], 2), [(None, 1), (hog, 1)]);
    }
}
