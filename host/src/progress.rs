//! What a long command tells its user while it works: the cut a run starts at, each epoch of
//! training, a resumed run, and how far it is (a bar's start, each step, its end). The
//! library hands these events to the caller's [`Progress`]; the binary prints them (and
//! draws the bars), a test or a program that embeds the host keeps or drops them. What a
//! command found is its return value, printed by the binary too.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::records::{EpochRecord, Planned};

/// One thing worth telling while a command runs. `Display` gives the line the binary prints.
#[derive(Debug, Clone)]
pub enum Event {
    /// A run has fewer inputs than its requests need; they are used again (the note says how).
    InputsReused(String),
    /// An inference run continues the earlier run in `output`.
    Resuming {
        /// The output directory.
        output: PathBuf,
        /// Requests that have their outcome there.
        resumed: u64,
        /// Requests of the run in all.
        requests: u64,
    },
    /// `split: auto` chose the cut (and, with `codec: auto`, the codec) to start at.
    AutoSplitPlanned(Box<Planned>),
    /// An inference run starts sending.
    InferenceStarts(InferenceStart),
    /// A load run starts sending.
    LoadStarts(LoadStart),
    /// A load run had no answer, so it has no latency plot (named).
    NothingAnswered {
        /// The plot's file name.
        plot: &'static str,
    },
    /// A training run starts.
    TrainingStarts(TrainingStart),
    /// An epoch of training ended and was evaluated.
    EpochDone(EpochRecord),
    /// Work counted in steps starts: an inference run's requests, a training epoch's steps.
    BarStarts {
        /// What is counted.
        bar: Bar,
        /// Steps in all.
        total: u64,
    },
    /// One step of the current bar is done.
    Advanced {
        /// A training step's loss.
        loss: Option<f64>,
    },
    /// The current bar's work ended (all of it, or stopped early).
    BarEnds,
    /// The trained weights were written as a bundle.
    TrainedBundleWritten {
        /// The bundle's directory.
        dir: PathBuf,
        /// The start of its id.
        short_id: String,
    },
}

/// What a bar counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bar {
    /// An inference run's requests (those not answered by an earlier run it resumes).
    Requests,
    /// The steps of one training epoch.
    Epoch {
        /// The epoch, from 1.
        epoch: usize,
        /// Epochs in all.
        epochs: usize,
    },
}

/// Where an inference run's stages run.
#[derive(Debug, Clone)]
pub struct InferenceStart {
    /// The bundle's model source.
    pub model: String,
    /// The cut: the edge runs stages `[0, split)`.
    pub split: usize,
    /// The cut's name (the layer it follows).
    pub cut_name: String,
    /// The share of the FLOPs the edge runs, when the bundle records it.
    pub edge_flops_share: Option<f64>,
    /// The edge's device.
    pub edge_device: String,
    /// The server's URL.
    pub server: String,
    /// The bundle's stage count: the server runs `[split, stages)`.
    pub stages: usize,
    /// The server's device.
    pub server_device: String,
}

/// What a load run sends, and to which servers.
#[derive(Debug, Clone)]
pub struct LoadStart {
    /// Edges in all.
    pub edges: usize,
    /// "closed loop", or the open loop's rate and limits.
    pub mode: String,
    /// How long requests are sent.
    pub duration: Duration,
    /// Each model and its edges.
    pub models: Vec<LoadedModel>,
}

/// One model of a load run: its edges and where they send.
#[derive(Debug, Clone)]
pub struct LoadedModel {
    /// The model's name in the tables (source and short bundle id).
    pub name: String,
    /// Edges sending it.
    pub edges: usize,
    /// The cuts they split at, round-robin.
    pub cuts: Vec<usize>,
    /// Samples per request.
    pub batch_size: i64,
    /// The boundaries' codec.
    pub codec: String,
    /// The server's URL.
    pub server: String,
    /// The server's device for this model.
    pub server_device: String,
    /// The model's latency target on the server, if it has one.
    pub slo_ms: Option<u32>,
}

/// Who trains what in a training run.
#[derive(Debug, Clone)]
pub enum TrainingStart {
    /// Split or U-shaped: the server holds a session.
    Split {
        /// `split` or `u-shaped`.
        mode: &'static str,
        /// The bundle's model source.
        model: String,
        /// The edge's part, in words (`[0, 3)`, `nothing (it sends its inputs)`).
        edge_part: String,
        /// The edge's device.
        edge_device: String,
        /// The server's URL.
        server: String,
        /// The server's stages `[from, to)`.
        server_stages: (usize, usize),
        /// The server's device.
        server_device: String,
        /// The server's training session.
        session_id: String,
        /// Parameters the server trains.
        server_parameters: u64,
    },
    /// Every stage on the edge.
    Monolithic {
        /// The bundle's model source.
        model: String,
        /// The edge's device.
        device: String,
    },
}

/// What receives a command's events, called on whichever thread raises them.
type Sink = Arc<dyn Fn(&Event) + Send + Sync>;

/// Where a command's events go: nowhere by default.
#[derive(Clone, Default)]
pub struct Progress(Option<Sink>);

impl Progress {
    /// Events go to `tell`, on whichever thread the command raises them.
    pub fn new(tell: impl Fn(&Event) + Send + Sync + 'static) -> Self {
        Self(Some(Arc::new(tell)))
    }

    pub(crate) fn tell(&self, event: Event) {
        if let Some(tell) = &self.0 {
            tell(&event);
        }
    }
}

impl fmt::Debug for Progress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() { "Progress(told)" } else { "Progress(silent)" })
    }
}

impl fmt::Display for LoadStart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "host load: {} edges, {}, for {:?}", self.edges, self.mode, self.duration)?;
        for m in &self.models {
            let cuts: Vec<String> = m.cuts.iter().map(usize::to_string).collect();
            write!(
                f,
                "\n  {}: {} edges at cut {}, batch {}, codec {}, to {} (device {}, SLO {})",
                m.name,
                m.edges,
                cuts.join(","),
                m.batch_size,
                m.codec,
                m.server,
                m.server_device,
                m.slo_ms.map_or("none".to_string(), |ms| format!("{ms} ms"))
            )?;
        }
        Ok(())
    }
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::InputsReused(note) => f.write_str(note),
            Self::Resuming { output, resumed, requests } => {
                write!(f, "resuming {}: {resumed} of {requests} requests have their outcome", output.display())
            }
            Self::AutoSplitPlanned(plan) => {
                let took = &plan.profiling;
                write!(
                    f,
                    "split: auto ({}): the planner picks cut {}{}, predicted {:.2} ms, from the profiles measured in {:.1} s (edge {:.1} s, server {:.1} s, link {:.1} s: {:.1} Mbit/s, round trip {:.2} ms)",
                    plan.objective,
                    plan.cut,
                    plan.codec.as_ref().map_or(String::new(), |c| format!(" with {c}")),
                    plan.predicted_ms,
                    took.edge_s + took.server_s + took.link_s,
                    took.edge_s,
                    took.server_s,
                    took.link_s,
                    plan.link_mbit_per_s,
                    plan.rtt_ms
                )
            }
            Self::InferenceStarts(s) => {
                let share = s.edge_flops_share.map_or(String::new(), |share| format!(", {:.1}% of the FLOPs", 100.0 * share));
                write!(
                    f,
                    "{} split at cut {} ({}{share}): edge runs stages [0, {}) on {}, server {} runs [{}, {}) on {}",
                    s.model, s.split, s.cut_name, s.split, s.edge_device, s.server, s.split, s.stages, s.server_device
                )
            }
            Self::LoadStarts(s) => s.fmt(f),
            Self::NothingAnswered { plot } => write!(f, "no request was answered: no {plot}"),
            Self::TrainingStarts(TrainingStart::Split {
                mode,
                model,
                edge_part,
                edge_device,
                server,
                server_stages: (from, to),
                server_device,
                session_id,
                server_parameters,
            }) => write!(
                f,
                "{mode} training {model} : edge trains {edge_part} on {edge_device}, server {server} trains [{from}, {to}) on {server_device} (session {session_id}, {server_parameters} parameters there)"
            ),
            Self::TrainingStarts(TrainingStart::Monolithic { model, device }) => write!(f, "monolithic training {model}: every stage on {device}"),
            Self::EpochDone(e) => write!(
                f,
                "epoch {:>3}: train loss {:.4}, test loss {:.4}, test accuracy {:.2}% ({} steps, {:.2} s + eval {:.2} s)",
                e.epoch,
                e.train_loss,
                e.test_loss,
                e.test_accuracy * 100.0,
                e.steps,
                e.epoch_seconds,
                e.eval_seconds
            ),
            Self::TrainedBundleWritten { dir, short_id } => write!(f, "trained bundle written to {} (id {short_id})", dir.display()),
            Self::BarStarts { bar: Bar::Requests, total } => write!(f, "{total} requests to answer"),
            Self::BarStarts { bar: Bar::Epoch { epoch, epochs }, total } => write!(f, "epoch {epoch}/{epochs}: {total} steps"),
            Self::Advanced { loss: None } => f.write_str("one more done"),
            Self::Advanced { loss: Some(loss) } => write!(f, "one more done, loss {loss:.4}"),
            Self::BarEnds => f.write_str("done"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_silent_progress_drops_events_and_a_told_one_gets_each_once() {
        Progress::default().tell(Event::NothingAnswered { plot: "latency.svg" });
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = Arc::clone(&seen);
        let progress = Progress::new(move |e| sink.lock().unwrap().push(e.to_string()));
        progress.tell(Event::NothingAnswered { plot: "latency.svg" });
        progress.tell(Event::Resuming { output: "out".into(), resumed: 3, requests: 8 });
        assert_eq!(*seen.lock().unwrap(), ["no request was answered: no latency.svg", "resuming out: 3 of 8 requests have their outcome"]);
    }
}
