//! The compute worker: one thread that owns the loaded stages and runs suffixes in order.
//!
//! libtorch modules are not `Sync` and autograd mode is per thread, so compute never runs on
//! the async runtime. Streams hand jobs over a bounded channel (backpressure) and get each
//! answer through a oneshot channel. A panic in a job is caught: that job is answered
//! INTERNAL and the worker goes on. A profile runs the requests waiting before each of its
//! stages, so they wait at most one stage behind it, and stops when its caller is gone.

use std::time::{Duration, Instant};

use cleave_common::{Boundary, LoadedStages, StageRange};
use tokio::sync::{mpsc, oneshot};

use crate::error::{catch_panic, RequestError};

/// One suffix to run.
pub(crate) struct Job {
    /// The cut the boundary is at.
    pub(crate) split: usize,
    /// The boundary at that cut.
    pub(crate) input: Boundary,
    /// When it was queued.
    pub(crate) queued_at: Instant,
    /// Where the answer goes.
    pub(crate) reply: oneshot::Sender<JobResult>,
}

/// The answer to a job.
pub(crate) struct JobResult {
    /// The boundary at the last cut, or why not.
    pub(crate) output: Result<Boundary, RequestError>,
    /// Time spent waiting for the worker.
    pub(crate) queue: Duration,
    /// Time spent running the stages.
    pub(crate) compute: Duration,
}

/// Times every stage at a batch size (the planner's server profile).
pub(crate) struct ProfileJob {
    pub(crate) batch: i64,
    pub(crate) repeats: usize,
    /// Each stage's median ms; `None` when the caller went away and the profile stopped.
    pub(crate) reply: oneshot::Sender<Result<Option<Vec<f64>>, RequestError>>,
}

/// What the worker does.
pub(crate) enum Work {
    /// Run a suffix.
    Run(Job),
    /// Time the stages.
    Profile(ProfileJob),
}

/// Starts the worker thread; it ends when every sender is dropped.
pub(crate) fn spawn(stages: LoadedStages, depth: usize) -> mpsc::Sender<Work> {
    let (tx, mut rx) = mpsc::channel::<Work>(depth);
    std::thread::Builder::new()
        .name("cleave-compute".into())
        .spawn(move || {
            while let Some(work) = rx.blocking_recv() {
                match work {
                    Work::Run(job) => run(&stages, job),
                    Work::Profile(job) => profile(&stages, job, &mut rx),
                }
            }
        })
        .expect("spawn the compute thread");
    tx
}

fn run(stages: &LoadedStages, job: Job) {
    let started = Instant::now();
    let queue = started.duration_since(job.queued_at);
    let range = StageRange::new(job.split, stages.bundle().stage_count());
    let output = catch_panic(&format!("running stages {range}"), || Ok(stages.run(range, &job.input)?));
    // The receiver may be gone (its stream ended); the result is then dropped.
    let _ = job.reply.send(JobResult { output, queue, compute: started.elapsed() });
}

fn profile(stages: &LoadedStages, job: ProfileJob, queue: &mut mpsc::Receiver<Work>) {
    let answer = catch_panic("profiling the stages", || {
        let input = cleave_common::value::synthetic_inputs(&stages.bundle().manifest().inputs, job.batch)?;
        let between_stages = || {
            while let Ok(work) = queue.try_recv() {
                match work {
                    Work::Run(waiting) => run(stages, waiting),
                    Work::Profile(other) => {
                        let _ = other.reply.send(Err(RequestError::Busy("another profile is running: profiles run one at a time".into())));
                    }
                }
            }
            !job.reply.is_closed()
        };
        stages.profile_between(&input, job.repeats, |_, _| {}, between_stages).map_err(RequestError::Profile)
    });
    if let Ok(None) = answer {
        tracing::info!("a profile stopped: its caller went away");
    }
    let _ = job.reply.send(answer);
}
