//! The compute worker: one thread that owns the loaded stages and runs suffixes in order.
//!
//! libtorch modules are not `Sync` and autograd mode is per thread, so compute never runs on
//! the async runtime. Streams hand jobs over a bounded channel (backpressure) and get each
//! answer through a oneshot channel.

use std::time::{Duration, Instant};

use cleave_common::{Boundary, BundleError, LoadedStages, StageRange};
use tokio::sync::{mpsc, oneshot};

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
    pub(crate) output: Result<Boundary, BundleError>,
    /// Time spent waiting for the worker.
    pub(crate) queue: Duration,
    /// Time spent running the stages.
    pub(crate) compute: Duration,
}

/// Times every stage at a batch size (the planner's server profile).
pub(crate) struct ProfileJob {
    pub(crate) batch: i64,
    pub(crate) repeats: usize,
    pub(crate) reply: oneshot::Sender<Result<Vec<f64>, BundleError>>,
}

/// What the worker does.
pub(crate) enum Work {
    /// Run a suffix.
    Run(Job),
    /// Time the stages (between requests, so the times are not inflated by other work).
    Profile(ProfileJob),
}

/// Starts the worker thread; it ends when every sender is dropped.
pub(crate) fn spawn(stages: LoadedStages, depth: usize) -> mpsc::Sender<Work> {
    let (tx, mut rx) = mpsc::channel::<Work>(depth);
    std::thread::Builder::new()
        .name("cleave-compute".into())
        .spawn(move || {
            let n = stages.bundle().stage_count();
            while let Some(work) = rx.blocking_recv() {
                match work {
                    Work::Run(job) => {
                        let started = Instant::now();
                        let queue = started.duration_since(job.queued_at);
                        let output = stages.run(StageRange::new(job.split, n), &job.input);
                        // The receiver may be gone (its stream ended); the result is then dropped.
                        let _ = job.reply.send(JobResult { output, queue, compute: started.elapsed() });
                    }
                    Work::Profile(job) => {
                        let inputs = cleave_common::value::synthetic_inputs(&stages.bundle().manifest().inputs, job.batch);
                        let _ = job.reply.send(inputs.and_then(|input| stages.profile(&input, job.repeats, |_, _| {})));
                    }
                }
            }
        })
        .expect("spawn the compute thread");
    tx
}
