//! One scheduler per device: a thread that owns the stages of every model loaded there and
//! decides what runs next (`cleave_common::scheduling`, the rules shared with the fleet
//! planner's simulation): inference batches, generation steps, profiles, and training steps.
//!
//! libtorch modules are not `Sync` and autograd mode is per thread, so compute never runs on
//! the async runtime. Streams hand requests over a bounded channel (backpressure) and get
//! each answer through a oneshot channel; at most `limits.queue_depth` requests wait in the
//! scheduler's queue, as many more in the channel.
//!
//! Batching: requests of one model at one batchable cut (and of one sequence length, in
//! bundles with one) are concatenated along the batch dimension, run together and split
//! back. A batch that entered at cut `a` runs only up to the first later cut `b` where other
//! requests of its model and length wait, and joins them there (`batching.merge_cuts`). A merged batch that fails is run again request by request, so
//! one bad request fails alone.
//!
//! Generation steps (a batch of decode steps, or a prompt's step) come as [`DeviceTask`]s:
//! each is keyed by the policy like a request of its model (by `kinds.generate`, else its
//! model's SLO and priority) and run on this thread in its turn, so an inference SLO sees the
//! device's whole load.
//!
//! Training sessions run on threads of their own, with their own copy of the stages; before
//! each step a session asks for a [`Turn`], which the scheduler grants between inference
//! batches at the lowest priority (its key is its arrival plus `scheduler.max_age`), or by its
//! model's `kinds.train` target when it has one. While a
//! session holds the device the scheduler runs nothing, yet it is not blocked: it takes in
//! what arrives (a profile waits in the queue) and drops what was abandoned, until the
//! session's [`Turn`] drops.
//!
//! A panic while running a batch or a profile is caught: those requests are answered
//! INTERNAL and the scheduler goes on. A panic anywhere else ends the thread: the requests
//! it holds are answered INTERNAL once, and `watch`, which starts each device's scheduler,
//! restarts it or reports the device down.

pub(crate) mod watch;

use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use cleave_common::spec::BoundarySizes;
use cleave_common::{Boundary, LoadedStages, StageRange};
use tokio::sync::oneshot;

use crate::config::{Batching, SchedulerConfig, WorkTarget};
use crate::error::{catch_panic, panic_message, Busy, DeviceFailure, Internal, RequestError};
use crate::metrics::Metrics;
use cleave_common::scheduling::{Entry, Group, Pick, Queue};

/// A model's stages on a device and how the scheduler treats its requests.
pub(crate) struct DeviceModel {
    /// The label its metrics carry (the bundle id).
    label: String,
    stages: LoadedStages,
    batching: Batching,
    slo: Option<Duration>,
    priority: f64,
    /// How its generation steps and its training calls are keyed (`kinds:`).
    generate: WorkTarget,
    train: WorkTarget,
    /// By cut: whether requests entering there merge ([`cleave_common::Bundle::batchable_cuts`]).
    batchable: Vec<bool>,
    /// Batch sizes warmed besides the smallest and the batch limit (`warm_batches`).
    warm_batches: Vec<i64>,
}

impl DeviceModel {
    pub(crate) fn new(stages: LoadedStages, batching: Batching, slo: Option<Duration>, priority: f64) -> Self {
        let bundle = stages.bundle();
        let mut batchable = vec![false; bundle.stage_count() + 1];
        for cut in bundle.batchable_cuts() {
            batchable[cut] = true;
        }
        let (generate, train) = (WorkTarget { slo, priority }, WorkTarget::default());
        Self { label: bundle.id().to_string(), stages, batching, slo, priority, generate, train, batchable, warm_batches: Vec::new() }
    }

    /// The same, its generation steps and training calls keyed by `generate` and `train`.
    pub(crate) fn keyed(self, generate: WorkTarget, train: WorkTarget) -> Self {
        Self { generate, train, ..self }
    }

    /// The same, warmed at `batches` too.
    pub(crate) fn warmed_at(self, batches: &[i64]) -> Self {
        Self { warm_batches: batches.to_vec(), ..self }
    }

    /// Runs its stages at the smallest batch and the largest a merged batch reaches, on the
    /// calling thread: the scheduler's own, whose first operations would otherwise start
    /// libtorch's per-thread state (its OpenMP team, allocator caches) on a request.
    fn warm_up(&self) -> cleave_common::Result<()> {
        let smallest = self.stages.bundle().manifest().batch.min;
        let mut batches = vec![smallest, self.batch_limit().max(smallest)];
        batches.extend(&self.warm_batches);
        batches.sort_unstable();
        batches.dedup();
        self.stages.warm_up(&batches)
    }

    /// The device its stages are on (`cpu`, `cuda:0`).
    pub(crate) fn device(&self) -> String {
        cleave_common::device::device_name(self.stages.device())
    }

    /// The libtorch device its stages are on.
    pub(crate) fn torch_device(&self) -> tch::Device {
        self.stages.device()
    }

    fn batch_limit(&self) -> i64 {
        i64::from(self.batching.limit(self.stages.bundle()))
    }
}

/// One suffix to run.
pub(crate) struct InferJob {
    /// The model's index on its device.
    pub(crate) model: usize,
    /// The cut the boundary is at.
    pub(crate) split: usize,
    /// The boundary at that cut, checked against the manifest.
    pub(crate) input: Boundary,
    /// Its batch size and sequence length, from that check.
    pub(crate) sizes: BoundarySizes,
    /// Where the answer goes.
    pub(crate) reply: oneshot::Sender<JobResult>,
    /// The request's span: its queue and compute spans go under it, its batches link to it.
    pub(crate) trace: tracing::Span,
}

/// The answer to a job.
pub(crate) struct JobResult {
    /// The boundary at the last cut, or why not.
    pub(crate) output: Result<Boundary, RequestError>,
    /// Time spent waiting for the device.
    pub(crate) queue: Duration,
    /// Time the device spent running the batches it was part of.
    pub(crate) compute: Duration,
}

/// Times every stage of a model at a batch size (the planner's server profile).
pub(crate) struct ProfileJob {
    pub(crate) model: usize,
    pub(crate) batch: i64,
    pub(crate) repeats: usize,
    /// Each stage's median ms; `None` when the caller went away and the profile stopped.
    pub(crate) reply: oneshot::Sender<Result<Option<Vec<f64>>, RequestError>>,
}

/// Work of another kind for the device, run on its thread in its turn: a batch of generation
/// steps or a prompt's step. `run` does the work and gives back what answers its caller,
/// called once the work is counted (a scrape after an answer counts its work); dropped unrun
/// (the device is down), its caller sees that answer gone.
pub(crate) struct DeviceTask {
    /// The model (its index on the device) whose SLO and priority key it.
    pub(crate) model: usize,
    /// What it is, for its span.
    pub(crate) kind: &'static str,
    /// The rows it carries.
    pub(crate) rows: usize,
    pub(crate) run: Box<dyn FnOnce() -> Box<dyn FnOnce() + Send> + Send>,
}

/// A training session's request for the device; granted with the sender the session drops
/// to give the device back.
pub(crate) struct TurnRequest {
    /// The model whose session asks (its `kinds.train` keys the turn).
    model: usize,
    grant: std_mpsc::Sender<flume::Sender<()>>,
}

/// What a device's scheduler receives.
pub(crate) enum Work {
    Infer(InferJob, Instant),
    Profile(ProfileJob),
    Task(DeviceTask, Instant),
    Turn(TurnRequest, Instant),
    /// Tests only: the thread panics outside any request, as a bug in the scheduler would.
    #[cfg(feature = "fault-injection")]
    Crash(String),
}

impl Work {
    /// Answers it with `error` instead of running it (its device is down).
    fn refuse(self, error: &Internal) {
        match self {
            Work::Infer(job, _) => {
                let _ = job.reply.send(JobResult { output: Err(error.clone().into()), queue: Duration::ZERO, compute: Duration::ZERO });
            }
            Work::Profile(job) => {
                let _ = job.reply.send(Err(error.clone().into()));
            }
            // The session's turn fails when its request is dropped, a task's caller when its
            // answer is.
            Work::Turn(..) | Work::Task(..) => {}
            #[cfg(feature = "fault-injection")]
            Work::Crash(_) => {}
        }
    }
}

/// The device is a training session's until this drops.
pub(crate) struct Turn {
    _release: flume::Sender<()>,
}

/// The handle streams and sessions use to reach a device's scheduler.
#[derive(Clone)]
pub(crate) struct DeviceScheduler {
    work: flume::Sender<Work>,
}

impl DeviceScheduler {
    /// Tests only: makes the scheduler thread panic outside any request.
    #[cfg(feature = "fault-injection")]
    pub(crate) fn crash(&self, message: &str) {
        let _ = self.work.send(Work::Crash(message.to_string()));
    }

    /// Queues a suffix (waiting while the queue is full).
    pub(crate) async fn submit(&self, job: InferJob) -> Result<(), RequestError> {
        self.work.send_async(Work::Infer(job, Instant::now())).await.map_err(|_| Internal::SchedulerGone.into())
    }

    /// Queues a profile.
    pub(crate) async fn profile(&self, job: ProfileJob) -> Result<(), RequestError> {
        self.work.send_async(Work::Profile(job)).await.map_err(|_| Internal::SchedulerGone.into())
    }

    /// Runs `work` on the device's thread in its turn, as a task of `model` carrying `rows`
    /// rows (see [`DeviceTask`]); what it returns, or why the device never ran it.
    pub(crate) async fn run<T: Send + 'static>(
        &self,
        model: usize,
        kind: &'static str,
        rows: usize,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, RequestError> {
        let (done, answer) = oneshot::channel();
        let run = Box::new(move || -> Box<dyn FnOnce() + Send> {
            let output = work();
            Box::new(move || {
                let _ = done.send(output);
            })
        });
        self.work.send_async(Work::Task(DeviceTask { model, kind, rows, run }, Instant::now())).await.map_err(|_| Internal::SchedulerGone)?;
        answer.await.map_err(|_| Internal::SchedulerGone.into())
    }

    /// How the training sessions of model `model` (its index on the device) take the device.
    pub(crate) fn turns(&self, model: usize) -> Turns {
        Turns { scheduler: self.clone(), model }
    }
}

/// How one model's training sessions take their device, a call at a time.
#[derive(Clone)]
pub(crate) struct Turns {
    scheduler: DeviceScheduler,
    model: usize,
}

impl Turns {
    /// Blocks the calling thread (a training session's) until the device is its own.
    pub(crate) fn turn(&self) -> Result<Turn, RequestError> {
        let (grant, granted) = std_mpsc::channel();
        let request = TurnRequest { model: self.model, grant };
        self.scheduler.work.send(Work::Turn(request, Instant::now())).map_err(|_| Internal::SchedulerGone)?;
        let release = granted.recv().map_err(|_| Internal::SchedulerGone)?;
        Ok(Turn { _release: release })
    }
}

/// A request waiting in the queue, maybe part-way through its stages.
struct Waiting {
    model: usize,
    /// The cut its boundary is at now.
    cut: usize,
    input: Boundary,
    /// Its batch size and sequence length (which stays the same from cut to cut).
    sizes: BoundarySizes,
    arrived: Instant,
    /// When it first ran (its queue time ends there).
    started: Option<Instant>,
    compute: Duration,
    reply: oneshot::Sender<JobResult>,
    /// The request's span, and its queue span (open until it first runs).
    trace: tracing::Span,
    queued: tracing::Span,
}

enum Item {
    Request(Waiting),
    Task(DeviceTask),
    /// A profile that came while a training session held the device.
    Profile(ProfileJob),
    Turn(TurnRequest),
}

/// What the device is doing while the scheduler takes work in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Free,
    /// Between the stages of a profile, which refuses another.
    Profiling,
    /// A training session holds it: a profile waits in the queue.
    Lent,
}

/// What the scheduler waits for while a training session holds the device.
enum WhileLent {
    Back,
    Work(Work),
    /// Every handle is gone.
    Closed,
}

struct Worker {
    /// The device's name (`cpu`, `cuda:0`).
    device: String,
    models: Vec<DeviceModel>,
    config: SchedulerConfig,
    depth: usize,
    metrics: Metrics,
}

impl Worker {
    /// Serves until every handle is dropped; `Err` with the cause when the thread failed (a
    /// panic outside any request), after answering every request it held INTERNAL.
    fn run(&self, rx: &flume::Receiver<Work>) -> Result<(), DeviceFailure> {
        let mut queue = Queue::default();
        let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.serve(&mut queue, rx)));
        served.map_err(|panic| {
            let cause = DeviceFailure::Panicked(panic_message(panic.as_ref()));
            self.fail_waiting(&mut queue, &cause);
            cause
        })
    }

    fn serve(&self, queue: &mut Queue<Item>, rx: &flume::Receiver<Work>) {
        loop {
            self.intake(queue, rx, Phase::Free);
            self.drop_abandoned(queue);
            match queue.pick(Instant::now(), |m| self.models[m].batch_limit(), |_| true) {
                Pick::Run(entries) => {
                    if let Some(released) = self.execute(queue, rx, entries) {
                        let started = Instant::now();
                        let _turn = tracing::debug_span!("turn", device = %self.device).entered();
                        self.while_lent(queue, rx, &released);
                        self.metrics.device_worked(&self.device, "train", started.elapsed());
                    }
                }
                Pick::WaitUntil(at) if queue.len() < self.depth => match rx.recv_deadline(at) {
                    Ok(work) => self.accept(queue, rx, work, Phase::Free),
                    Err(flume::RecvTimeoutError::Timeout) => {}
                    Err(flume::RecvTimeoutError::Disconnected) => std::thread::sleep(at.saturating_duration_since(Instant::now())),
                },
                Pick::WaitUntil(at) => std::thread::sleep(at.saturating_duration_since(Instant::now())),
                Pick::Idle => match rx.recv() {
                    Ok(work) => self.accept(queue, rx, work, Phase::Free),
                    Err(_) => return,
                },
            }
        }
    }

    /// While a training session holds the device: takes what arrives, as long as the queue
    /// has room, and drops the requests whose streams went, until the session gives the device
    /// back (`released` disconnects when its [`Turn`] drops).
    fn while_lent(&self, queue: &mut Queue<Item>, rx: &flume::Receiver<Work>, released: &flume::Receiver<()>) {
        loop {
            self.intake(queue, rx, Phase::Lent);
            self.drop_abandoned(queue);
            let next = if queue.len() < self.depth {
                flume::Selector::new().recv(released, |_| WhileLent::Back).recv(rx, |work| work.map_or(WhileLent::Closed, WhileLent::Work)).wait()
            } else {
                let _ = released.recv();
                WhileLent::Back
            };
            match next {
                WhileLent::Back => return,
                WhileLent::Work(work) => self.accept(queue, rx, work, Phase::Lent),
                WhileLent::Closed => {
                    let _ = released.recv();
                    return;
                }
            }
        }
    }

    /// Answers every request the queue holds INTERNAL, naming the device and `cause`; the
    /// training sessions waiting for a turn see their request dropped.
    fn fail_waiting(&self, queue: &mut Queue<Item>, cause: &DeviceFailure) {
        for entry in queue.take_where(|_| true) {
            match entry.item {
                Item::Request(w) => {
                    if w.started.is_none() {
                        self.metrics.queued(&self.models[w.model].label, -1);
                    }
                    answer(w, Err(Internal::DeviceFailed { device: self.device.clone(), cause: cause.clone() }.into()));
                }
                // Dropped unrun: its caller sees its answer gone.
                Item::Task(task) => self.metrics.queued(&self.models[task.model].label, -1),
                Item::Profile(job) => {
                    let _ = job.reply.send(Err(Internal::DeviceFailed { device: self.device.clone(), cause: cause.clone() }.into()));
                }
                Item::Turn(_) => {}
            }
        }
    }

    /// Takes what has arrived, while the queue has room.
    fn intake(&self, queue: &mut Queue<Item>, rx: &flume::Receiver<Work>, phase: Phase) {
        while queue.len() < self.depth {
            match rx.try_recv() {
                Ok(work) => self.accept(queue, rx, work, phase),
                Err(_) => return,
            }
        }
    }

    fn accept(&self, queue: &mut Queue<Item>, rx: &flume::Receiver<Work>, work: Work, phase: Phase) {
        match work {
            Work::Infer(job, arrived) => {
                self.metrics.queued(&self.models[job.model].label, 1);
                let waiting = Waiting {
                    model: job.model,
                    cut: job.split,
                    input: job.input,
                    sizes: job.sizes,
                    arrived,
                    started: None,
                    compute: Duration::ZERO,
                    reply: job.reply,
                    queued: tracing::debug_span!(parent: &job.trace, "queue"),
                    trace: job.trace,
                };
                queue.push(self.entry(waiting, arrived + self.models[job.model].batching.max_wait));
            }
            Work::Task(task, arrived) => {
                let model = &self.models[task.model];
                self.metrics.queued(&model.label, 1);
                let key = request_key(&self.config, arrived, model.generate.slo, model.generate.priority);
                queue.push(Entry { group: None, samples: task.rows as i64, key, ready_at: arrived, item: Item::Task(task) });
            }
            Work::Turn(turn, arrived) => {
                let key = turn_key(&self.config, arrived, self.models[turn.model].train);
                queue.push(Entry { group: None, samples: 0, key, ready_at: arrived, item: Item::Turn(turn) });
            }
            Work::Profile(other) if phase == Phase::Profiling => {
                let busy = RequestError::from(Busy::ProfileOnDevice);
                let _ = other.reply.send(Err(busy));
            }
            Work::Profile(job) if phase == Phase::Lent => {
                let now = Instant::now();
                queue.push(Entry { group: None, samples: 0, key: now, ready_at: now, item: Item::Profile(job) });
            }
            Work::Profile(job) => self.profile(queue, rx, job),
            #[cfg(feature = "fault-injection")]
            Work::Crash(message) => panic!("{message}"),
        }
    }

    /// Takes out of the queue every request whose stream is gone (its answer's receiver
    /// dropped): it never starts, or runs no further, and its memory is freed now.
    fn drop_abandoned(&self, queue: &mut Queue<Item>) {
        for entry in queue.take_where(|e| matches!(&e.item, Item::Request(w) if w.reply.is_closed())) {
            if let Item::Request(w) = entry.item {
                self.abandoned(&w);
            }
        }
    }

    /// Counts a request whose stream went before it was answered.
    fn abandoned(&self, w: &Waiting) {
        let label = &self.models[w.model].label;
        if w.started.is_none() {
            self.metrics.queued(label, -1);
        }
        self.metrics.abandoned(label, if w.started.is_none() { "queued" } else { "running" });
    }

    /// A request's place: its key by the policy, its group when its cut merges.
    fn entry(&self, w: Waiting, ready_at: Instant) -> Entry<Item> {
        let model = &self.models[w.model];
        let key = request_key(&self.config, w.arrived, model.slo, model.priority);
        let merges = model.batch_limit() > 1 && model.batchable[w.cut];
        let group = merges.then_some(Group { model: w.model, cut: w.cut, seq: w.sizes.seq });
        Entry { group, samples: w.sizes.batch, key, ready_at, item: Item::Request(w) }
    }

    /// Runs what `pick` took; a training turn granted lends the device: the receiver that says
    /// when it is back.
    fn execute(&self, queue: &mut Queue<Item>, rx: &flume::Receiver<Work>, entries: Vec<Entry<Item>>) -> Option<flume::Receiver<()>> {
        let mut requests = Vec::with_capacity(entries.len());
        let mut lent = None;
        for entry in entries {
            match entry.item {
                Item::Request(w) => requests.push(w),
                Item::Task(task) => self.run_task(task),
                Item::Profile(job) => self.profile(queue, rx, job),
                Item::Turn(turn) => lent = grant(turn),
            }
        }
        self.run_requests(queue, requests);
        lent
    }

    /// Runs requests of one group as one batch, as far as the next cut where others of their
    /// group wait (or to the last).
    fn run_requests(&self, queue: &mut Queue<Item>, mut requests: Vec<Waiting>) {
        for w in requests.extract_if(.., |w| w.reply.is_closed()) {
            self.abandoned(&w);
        }
        if requests.is_empty() {
            return;
        }
        let group = Group { model: requests[0].model, cut: requests[0].cut, seq: requests[0].sizes.seq };
        let model = &self.models[group.model];
        let last = model.stages.bundle().stage_count();
        let to = if model.batching.merge_cuts && model.batch_limit() > 1 { queue.next_cut_waiting(group).unwrap_or(last) } else { last };
        let started = Instant::now();
        for w in &mut requests {
            if w.started.is_none() {
                w.started = Some(started);
                w.queued = tracing::Span::none();
                self.metrics.queued(&model.label, -1);
            }
        }
        let sizes: Vec<i64> = requests.iter().map(|w| w.sizes.batch).collect();
        let (batch, _computing) = batch_spans(&model.label, &requests, &sizes, (group.cut, to));
        let _in_batch = batch.enter();
        self.metrics.batch(&model.label, sizes.iter().sum());
        let range = StageRange::new(group.cut, to);
        let outputs = catch_panic(&format!("running stages {range}"), || run_batch(model, &requests, range, &sizes));
        let took = started.elapsed();
        self.metrics.device_worked(&self.device, "infer", took);
        let ran = Ran { to, at_last_cut: to == last, started, took };
        self.deliver(queue, requests, outputs, &ran);
    }

    /// Hands each request its part of the batch's output: its answer at the last cut, or
    /// back into the queue at the cut the batch ran to; a failed merged batch is run again
    /// request by request.
    fn deliver(&self, queue: &mut Queue<Item>, mut requests: Vec<Waiting>, outputs: Result<Option<Vec<Boundary>>, RequestError>, ran: &Ran) {
        let Some(first) = requests.first() else { return };
        let label = &self.models[first.model].label;
        match outputs {
            Ok(None) => {
                for w in &requests {
                    self.abandoned(w);
                }
            }
            Ok(Some(parts)) => {
                if !ran.at_last_cut {
                    self.metrics.cut_merges(label, parts.len());
                }
                for (mut w, part) in requests.into_iter().zip(parts) {
                    w.compute += ran.took;
                    if ran.at_last_cut {
                        answer(w, Ok(part));
                    } else {
                        w.cut = ran.to;
                        w.input = part;
                        queue.push(self.entry(w, ran.started));
                    }
                }
            }
            Err(e) if requests.len() > 1 => {
                tracing::warn!(error = %e, requests = requests.len(), "a merged batch failed: running its requests one by one");
                for mut w in requests {
                    w.compute += ran.took;
                    self.run_alone(w);
                }
            }
            Err(e) => {
                if let Some(mut w) = requests.pop() {
                    w.compute += ran.took;
                    answer(w, Err(e));
                }
            }
        }
    }

    /// Runs a task; a panic inside it (a bug) is caught, and its caller sees its answer gone.
    fn run_task(&self, task: DeviceTask) {
        let label = &self.models[task.model].label;
        self.metrics.queued(label, -1);
        let _running = tracing::debug_span!("task", kind = task.kind, model = %label, rows = task.rows).entered();
        let started = Instant::now();
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(task.run));
        self.metrics.device_worked(&self.device, task.kind, started.elapsed());
        match ran {
            Ok(answer) => answer(),
            Err(panic) => tracing::error!(kind = task.kind, panic = %panic_message(panic.as_ref()), "a device task panicked"),
        }
    }

    /// Runs one request to the last cut by itself.
    fn run_alone(&self, mut w: Waiting) {
        let model = &self.models[w.model];
        let _computing = tracing::debug_span!(parent: &w.trace, "compute", from = w.cut, alone = true).entered();
        let started = Instant::now();
        let range = StageRange::suffix(model.stages.bundle(), w.cut);
        let output = catch_panic(&format!("running stages {range}"), || {
            let output = model.stages.run(range, &w.input);
            model.stages.synchronize();
            Ok(output?)
        });
        w.compute += started.elapsed();
        self.metrics.device_worked(&self.device, "infer", started.elapsed());
        answer(w, output);
    }

    /// Times a model's stages, running the requests that are ready before each stage (so
    /// that they wait at most one stage behind a profile); training turns wait for its end.
    fn profile(&self, queue: &mut Queue<Item>, rx: &flume::Receiver<Work>, job: ProfileJob) {
        let started = Instant::now();
        let stages = &self.models[job.model].stages;
        let answer = catch_panic("profiling the stages", || {
            let input = cleave_common::value::synthetic_inputs(&stages.bundle().manifest().inputs, stages.bundle().sizes_at(job.batch))?;
            let between_stages = || {
                self.intake(queue, rx, Phase::Profiling);
                while let Pick::Run(entries) = queue.pick(Instant::now(), |m| self.models[m].batch_limit(), |e| matches!(e.item, Item::Request(_))) {
                    let requests = entries.into_iter().filter_map(|e| if let Item::Request(w) = e.item { Some(w) } else { None }).collect();
                    self.run_requests(queue, requests);
                }
                !job.reply.is_closed()
            };
            stages.profile_between(&input, job.repeats, |_, _| {}, between_stages).map_err(RequestError::Profile)
        });
        if let Ok(None) = answer {
            tracing::info!("a profile stopped: its caller went away");
        }
        self.metrics.device_worked(&self.device, "profile", started.elapsed());
        let _ = job.reply.send(answer);
    }
}

/// A batch's span, linked to the span of each request it carries, and each request's compute
/// span (open while the batch runs). Nothing to link or allocate when spans are not recorded.
fn batch_spans(model: &str, requests: &[Waiting], sizes: &[i64], (from, to): (usize, usize)) -> (tracing::Span, Vec<tracing::Span>) {
    let samples: i64 = sizes.iter().sum();
    let batch = tracing::debug_span!("batch", model, requests = requests.len(), samples, from, to);
    if batch.is_disabled() {
        return (batch, Vec::new());
    }
    let computing = requests
        .iter()
        .map(|w| {
            cleave_common::telemetry::link(&batch, &w.trace);
            tracing::debug_span!(parent: &w.trace, "compute", from, to, batch_requests = requests.len())
        })
        .collect();
    (batch, computing)
}

/// When a request would like to run by (the shared rule, with this scheduler's policy).
fn request_key(config: &SchedulerConfig, arrived: Instant, slo: Option<Duration>, priority: f64) -> Instant {
    cleave_common::scheduling::request_key(config.policy, config.max_age, arrived, slo, priority)
}

/// A training turn's place: with a target (`kinds.train`), a request's under the policy;
/// without, its arrival plus `max_age` under either policy (it yields to what comes after it,
/// for that long at most).
fn turn_key(config: &SchedulerConfig, arrived: Instant, target: WorkTarget) -> Instant {
    match target.slo {
        Some(_) => request_key(config, arrived, target.slo, target.priority),
        None => arrived + config.max_age,
    }
}

fn answer(w: Waiting, output: Result<Boundary, RequestError>) {
    let queue = w.started.map_or(Duration::ZERO, |s| s.duration_since(w.arrived));
    // The receiver may be gone (its stream ended); the result is then dropped.
    let _ = w.reply.send(JobResult { output, queue, compute: w.compute });
}

/// Lends the device to a training session until it drops its [`Turn`]: the receiver that
/// disconnects then (the turn holds its only sender); `None` when the session is gone.
fn grant(turn: TurnRequest) -> Option<flume::Receiver<()>> {
    let (release, released) = flume::bounded::<()>(1);
    turn.grant.send(release).ok().map(|()| released)
}

/// What a batch ran: up to cut `to` (the last cut or not), from `started`, for `took`.
struct Ran {
    to: usize,
    at_last_cut: bool,
    started: Instant,
    took: Duration,
}

/// Runs `requests` (of `model`, at `range.start`) through `range` as one batch, merged on the
/// device when there are several, and splits the output back into each request's part; none
/// when every request was abandoned on the way (the batch stops at the next stage boundary).
fn run_batch(model: &DeviceModel, requests: &[Waiting], range: StageRange, sizes: &[i64]) -> Result<Option<Vec<Boundary>>, RequestError> {
    let wanted = || requests.iter().any(|w| !w.reply.is_closed());
    let outputs = (|| {
        if let [alone] = requests {
            return Ok(model.stages.run_while(range, &alone.input, wanted)?.map(|out| vec![out]));
        }
        // Merged on the device: each input goes there from the pinned memory it was received
        // into (an asynchronous copy). Merged on the host, the batch would be copied once more
        // into pageable memory, and copied from there synchronously (16 resnet18 inputs after
        // layer2 on an H100: 2.6 to 2.9 ms a batch, against 1.3 merged on the device).
        let device = model.stages.device();
        let inputs: Vec<Boundary> = requests.iter().map(|w| w.input.to_device(device)).collect();
        let merged = Boundary::cat_batches(&inputs).map_err(RequestError::Batching)?;
        let Some(out) = model.stages.run_while(range, &merged, wanted)? else { return Ok(None) };
        // Answers leave from the host: the batch's output comes back in one copy, not one per
        // request on the encoders' threads.
        let last = model.stages.bundle().stage_count();
        let out = if range.end == last { out.to_device(tch::Device::Cpu) } else { out };
        out.split_batches(sizes).map(Some).map_err(RequestError::Batching)
    })();
    // Compute time includes the work queued on the device, not only its launch.
    model.stages.synchronize();
    outputs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Policy;

    #[test]
    fn keys_follow_the_policy_and_training_yields_for_at_most_max_age() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let fifo = SchedulerConfig { policy: Policy::Fifo, max_age: ms(2000), ..SchedulerConfig::default() };
        let edf = SchedulerConfig { policy: Policy::Edf, ..fifo };
        assert_eq!(request_key(&fifo, t0, Some(ms(50)), 4.0), t0);
        assert_eq!(request_key(&edf, t0, Some(ms(50)), 1.0), t0 + ms(50));
        assert_eq!(request_key(&edf, t0, Some(ms(50)), 2.0), t0 + ms(25));
        assert_eq!(request_key(&edf, t0, None, 1.0), t0 + ms(2000));

        // A training turn queued at t0 has key t0 + max_age: requests keep arriving every
        // 10 ms (edf, 50 ms target) and run first only while their deadlines come before it.
        let mut queue = Queue::default();
        queue.push(Entry { group: None, samples: 0, key: t0 + edf.max_age, ready_at: t0, item: "turn" });
        let mut ran_before_turn = 0;
        for i in 0..1000u64 {
            let arrived = t0 + ms(10 * i);
            queue.push(Entry { group: None, samples: 1, key: request_key(&edf, arrived, Some(ms(50)), 1.0), ready_at: arrived, item: "request" });
            let Pick::Run(entries) = queue.pick(arrived, |_| 1, |_| true) else { panic!("something is always ready") };
            if entries[0].item == "turn" {
                break;
            }
            ran_before_turn += 1;
        }
        // Requests arriving before t0 + 1950 ms have deadlines before the turn's key (0, 10
        // ... 1940 ms: 195 of them); the one at 1950 ms ties and the turn, queued first, runs.
        assert_eq!(ran_before_turn, 195);
    }

    #[test]
    fn a_training_turn_is_keyed_by_its_model_s_train_target_when_it_has_one() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let fifo = SchedulerConfig { policy: Policy::Fifo, max_age: ms(2000), ..SchedulerConfig::default() };
        let edf = SchedulerConfig { policy: Policy::Edf, ..fifo };
        // Without a target it yields for max_age under either policy, whatever its priority.
        for config in [&fifo, &edf] {
            assert_eq!(turn_key(config, t0, WorkTarget { slo: None, priority: 8.0 }), t0 + ms(2000));
        }
        // With one, it is a request of that target and priority.
        let target = WorkTarget { slo: Some(ms(300)), priority: 3.0 };
        assert_eq!(turn_key(&edf, t0, target), t0 + ms(100));
        assert_eq!(turn_key(&fifo, t0, target), t0);
    }
}
