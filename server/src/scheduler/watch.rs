//! The watch on a device's scheduler thread. It runs the thread; when the thread dies (a
//! panic outside any request: a bug, or a device error raised where no request catches it)
//! it counts the failure and reports it ([`DeviceEvent`]: the server's health and exit follow
//! them), then either starts a new thread with the device's models reloaded
//! (`on_device_failure: restart`) or answers everything sent to the device INTERNAL until
//! the server has exited (`exit`). The thread itself answers the requests it held.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc as std_mpsc;

use cleave_common::error::Shared;
use cleave_common::BundleError;

use super::{DeviceModel, DeviceScheduler, Work, Worker};
use crate::config::{DeviceFailurePolicy, SchedulerConfig};
use crate::error::{panic_message, DeviceFailure, Internal, ServerError};
use crate::metrics::Metrics;

/// What every device's scheduler shares: its rules, its queue's depth, where it counts and
/// where it reports failures.
#[derive(Clone)]
pub(crate) struct SchedulerContext {
    pub(crate) config: SchedulerConfig,
    /// Requests that may wait in the queue (`limits.queue_depth`), as many more in the channel.
    pub(crate) depth: usize,
    pub(crate) metrics: Metrics,
    /// Where a device's failures and restarts go (the server's health and exit follow them).
    pub(crate) events: tokio::sync::mpsc::UnboundedSender<DeviceEvent>,
}

/// Loads a device's models afresh, for a restart (the new thread warms them).
pub(crate) type LoadModels = Box<dyn Fn() -> Result<Vec<DeviceModel>, ServerError> + Send>;

/// What happened to a device's scheduler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum DeviceEvent {
    /// Its thread died; its models are not served until it is restarted.
    Failed {
        /// The device (`cpu`, `cuda:0`).
        device: String,
        /// The bundle ids of its models.
        models: Vec<String>,
        /// Why its thread died.
        cause: DeviceFailure,
    },
    /// Its models were reloaded on a new thread and are served again.
    Restarted {
        /// The device.
        device: String,
        /// The bundle ids of its models.
        models: Vec<String>,
    },
    /// It will not come back: the server exits.
    Down {
        /// The device.
        device: String,
        /// Why it died, and why it was not restarted.
        cause: DeviceFailure,
    },
}

/// Why a scheduler thread ended before every handle was dropped.
enum Ended {
    /// It died serving (a panic outside any request): a new thread may serve again.
    Died(DeviceFailure),
    /// Its models failed their warm-up: they cannot run there, reloaded or not.
    NotWarmed(DeviceFailure),
}

struct DeviceWatch {
    device: String,
    /// The bundle ids of its models.
    labels: Vec<String>,
    reload: LoadModels,
    context: SchedulerContext,
}

/// Starts the scheduler thread of one device with its models, and the thread that watches it
/// (restarting it with `reload`'s models after a failure, when the policy says so); both end
/// when every handle is dropped and the queue is empty.
/// Returns once the scheduler thread has warmed its models (an error when that failed), so
/// that the server reports SERVING with every device warm.
pub(crate) fn spawn(device: &str, models: Vec<DeviceModel>, reload: LoadModels, context: SchedulerContext) -> Result<DeviceScheduler, ServerError> {
    let (work, rx) = flume::bounded(context.depth.max(1));
    let labels = models.iter().map(|m| m.label.clone()).collect();
    let watch = DeviceWatch { device: device.to_string(), labels, reload, context };
    let (warmed, warm) = std_mpsc::channel();
    std::thread::Builder::new()
        .name(format!("cleave-{device}-watch"))
        .spawn(move || watch.run(models, &rx, warmed))
        .expect("spawn a device's watch thread");
    // Nothing comes when the thread died warming up: its watch reports that like any failure.
    if let Ok(Err(e)) = warm.recv() {
        return Err(ServerError::NotWarmed { device: device.to_string(), cause: DeviceFailure::NotWarmed(e) });
    }
    Ok(DeviceScheduler { work })
}

impl DeviceWatch {
    /// Runs scheduler threads one after the other until one ends normally (every handle
    /// dropped) or the device is down for good.
    fn run(self, mut models: Vec<DeviceModel>, rx: &flume::Receiver<Work>, warmed: std_mpsc::Sender<Result<(), Shared<BundleError>>>) {
        let mut restarted = false;
        loop {
            let cause = match self.run_scheduler(models, rx, restarted, warmed.clone()) {
                Ok(()) => return,
                Err(Ended::NotWarmed(cause)) => {
                    tracing::error!(device = %self.device, %cause, "a device's models failed their warm-up");
                    self.report(DeviceEvent::Down { device: self.device.clone(), cause: cause.clone() });
                    return self.refuse_all(rx, cause);
                }
                Err(Ended::Died(cause)) => cause,
            };
            tracing::error!(device = %self.device, %cause, "a device's scheduler thread died; the requests it held were answered INTERNAL");
            self.context.metrics.device_failed(&self.device);
            self.report(DeviceEvent::Failed { device: self.device.clone(), models: self.labels.clone(), cause: cause.clone() });
            match self.reload_models(&cause) {
                Ok(reloaded) => (models, restarted) = (reloaded, true),
                Err(down) => {
                    self.report(DeviceEvent::Down { device: self.device.clone(), cause: down });
                    return self.refuse_all(rx, cause);
                }
            }
        }
    }

    /// One scheduler thread's life: `Err` with the cause when it died. A restarted one is
    /// reported once its thread has started.
    fn run_scheduler(
        &self,
        models: Vec<DeviceModel>,
        rx: &flume::Receiver<Work>,
        restarted: bool,
        warmed: std_mpsc::Sender<Result<(), Shared<BundleError>>>,
    ) -> Result<(), Ended> {
        let c = &self.context;
        let worker = Worker { device: self.device.clone(), models, config: c.config, depth: c.depth.max(1), metrics: c.metrics.clone() };
        let rx = rx.clone();
        let thread = std::thread::Builder::new()
            .name(format!("cleave-{}", self.device))
            .spawn(move || {
                // Warm on this thread before serving; `spawn` waits for the first thread's word.
                let warm = worker.models.iter().try_for_each(DeviceModel::warm_up).map_err(Shared::new);
                let _ = warmed.send(warm.clone());
                match warm {
                    Err(e) => Err(Ended::NotWarmed(DeviceFailure::NotWarmed(e))),
                    Ok(()) => worker.run(&rx).map_err(Ended::Died),
                }
            })
            .map_err(|e| Ended::Died(DeviceFailure::NoThread(Shared::new(e))))?;
        if restarted {
            self.context.metrics.device_restarted(&self.device);
            self.report(DeviceEvent::Restarted { device: self.device.clone(), models: self.labels.clone() });
            tracing::info!(device = %self.device, "the device's models are reloaded and served again");
        }
        // The worker catches its own panics; one that escapes it still ends here.
        thread.join().unwrap_or_else(|panic| Err(Ended::Died(DeviceFailure::Panicked(panic_message(panic.as_ref())))))
    }

    /// The device's models loaded afresh, when the policy restarts them; otherwise, or when
    /// they cannot be loaded, why the device stays down.
    fn reload_models(&self, cause: &DeviceFailure) -> Result<Vec<DeviceModel>, DeviceFailure> {
        let cause = Box::new(cause.clone());
        if self.context.config.on_device_failure == DeviceFailurePolicy::Exit {
            return Err(DeviceFailure::NotRestarted(cause));
        }
        tracing::warn!(device = %self.device, "reloading the device's models on a new thread (`on_device_failure: restart`)");
        match catch_unwind(AssertUnwindSafe(|| (self.reload)())) {
            Ok(Ok(models)) => Ok(models),
            Ok(Err(e)) => Err(DeviceFailure::NotReloaded { cause, error: Shared::new(e) }),
            Err(panic) => Err(DeviceFailure::ReloadPanicked { cause, message: panic_message(panic.as_ref()) }),
        }
    }

    /// Answers everything sent to the device INTERNAL, until every handle is dropped.
    fn refuse_all(&self, rx: &flume::Receiver<Work>, cause: DeviceFailure) {
        let failed = Internal::DeviceFailed { device: self.device.clone(), cause };
        for work in rx.iter() {
            work.refuse(&failed);
        }
    }

    fn report(&self, event: DeviceEvent) {
        // Nobody listens when the server was prepared and never served.
        let _ = self.context.events.send(event);
    }
}
