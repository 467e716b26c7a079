//! Training on the edge: `host --config train.yaml [--loopback]` with a `train:` section.
//!
//! - `split`: the edge trains stages `[0, s)`, the server `[s, N)` and the loss. A step sends
//!   the boundary at `s` with the targets, gets back the loss and the gradient at `s`, and
//!   backpropagates it into the graph its own forward pass kept (never recomputed, so the
//!   dropout masks are the ones used).
//! - `u-shaped`: labels never leave the edge. The edge trains `[0, s)` and `[t, N)` with the
//!   loss; the server trains `[s, t)`, returns the boundary at `t`, and gets its gradient back.
//! - `monolithic`: the whole model in this process, with the same stages, optimizer and
//!   seeds: the reference split training must equal.
//!
//! After every epoch the held-out split is evaluated (split inference over the same session,
//! in eval mode) and a checkpoint is written on both sides (the host's names the server's
//! checkpoint namespace, so that a resume finds both halves); the output directory gets
//! `metrics.csv` and `summary.json` ([`report`]), `training.svg` (`plots::training`) and
//! `steps.csv` ([`write_report`] and the run).

mod data;
pub mod export;
pub mod report;

use std::path::{Path, PathBuf};
use std::time::Instant;

use cleave_client::{connect, connect_first, Breach, ServerSession};
use cleave_common::device::device_name;
use cleave_common::pb;
use cleave_common::stats::median;
use cleave_common::training::checkpoint::{self, CheckpointMeta};
use cleave_common::training::loss::{correct, LossKind};
use cleave_common::training::microbatch::{accumulate, Microbatch};
use cleave_common::training::optim::Optimizer;
use cleave_common::training::schedule::{clip_coefficient, scale, tensor_norms};
use cleave_common::training::step::{backward, backward_from_boundary, output_tensor, step_loss, Grads};
use cleave_common::training::{float_leaves, track_gradients, TrainError, TrainableStages, TARGETS_VALUE};
use cleave_common::{Boundary, Bundle, DeviceSpec, StageRange, Value};
use tch::Tensor;

use crate::config::{ClientMode, EdgeConfig, TrainConfig, TrainMode};
use crate::error::{HostError, OutputError, Result, TrainingSetupError};
use crate::files::{claim_output, EarlierRun, OutputMode};
use crate::plots::training::plot_training;
use crate::progress::{Bar, Event, Progress, TrainingStart};
use crate::records::EpochRecord;
use crate::run_options::RunOptions;
use cleave_client::{SessionRequest, TrainLink, TrainReconnect};
use data::Dataset;
pub use report::{TrainingSummary, METRICS_CSV, SUMMARY_JSON, TRAINING_SVG};

/// The host's checkpoint file inside a checkpoint directory (`checkpoints/step-N/`).
pub const HOST_CHECKPOINT: &str = "host.safetensors";

/// The key in a host checkpoint's metadata (`extra`) naming the server's checkpoint namespace
/// that holds the server's side of the same step: a resume names `NAMESPACE/step-N`.
pub const SERVER_NAMESPACE_KEY: &str = "server_namespace";

/// The trained bundle's directory in the output directory (`train.write_bundle: true`).
pub const TRAINED_BUNDLE: &str = "bundle";

/// Every step of a run: `step,epoch,step_ms,loss`.
pub const STEPS_CSV: &str = "steps.csv";

/// Where a run is in its data: the next batch to train.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Position {
    epoch: usize,
    batch: usize,
}

/// `host --config` with `train:`: trains, evaluates, checkpoints, writes the report files.
pub async fn run(config: EdgeConfig, opts: RunOptions) -> Result<TrainingSummary> {
    let train = config.train().cloned().ok_or(HostError::NotThatKindOfConfig { key: "train", command: "training" })?;
    let bundle = crate::files::open_config_bundle(&config).await?;
    let output = opts.output.clone().unwrap_or_else(|| config.output.clone());
    let cuts = Cuts::of(&config, &train, &bundle, &opts)?;
    check_batches(&train, &bundle)?;
    let (train_set, test_set) = load_datasets(&train, &bundle).await?;

    claim_training_output(&output, train.resume.as_deref(), opts.output_mode)?;
    let checkpoints = output.join(CHECKPOINTS);
    let server_checkpoints = checkpoints.join("server");
    let loopback = if cuts.remote && opts.loopback { Some(crate::loopback::for_training(&config, &server_checkpoints).await?) } else { None };

    // The edge's stages load on a blocking thread: TorchScript loading takes a while.
    let edge = {
        let (bundle, device, train, checkpoints) = (bundle.clone(), config.device, train.clone(), checkpoints.clone());
        tokio::task::spawn_blocking(move || EdgeSide::load(&bundle, device, &train, &checkpoints, cuts))
            .await
            .map_err(|error| HostError::Task { what: "loading the edge's stages", error })??
    };
    let step = edge.resumed.unwrap_or(0);
    let (sides, server_namespace) = match edge.stages {
        EdgeStages::Split { prefix, tail } => {
            let session = match &loopback {
                Some(l) => connect(&l.url, &bundle, &config.link()).await?,
                None => training_server(&config, &bundle).await?,
            };
            let url = session.url.clone();
            let start = SessionStart { server_resume: edge.server_resume.clone(), step, samples: train_set.rows() as u64 };
            let (link, opened) = open_session(&config, &train, &bundle, cuts, session, start).await?;
            opts.progress.tell(Event::TrainingStarts(TrainingStart::Split {
                mode: train.mode.name(),
                model: bundle.manifest().model.source.clone(),
                edge_part: describe_edge(cuts.split, cuts.tail, cuts.stages),
                edge_device: device_name(config.device.resolve()?),
                server: url,
                server_stages: (cuts.split, cuts.tail),
                server_device: opened.device.clone(),
                session_id: opened.session_id.clone(),
                server_parameters: opened.parameters,
            }));
            (Sides::Split { prefix, tail, link: Box::new(link) }, opened.namespace)
        }
        EdgeStages::Whole(model) => {
            let (source, device) = (bundle.manifest().model.source.clone(), device_name(config.device.resolve()?));
            opts.progress.tell(Event::TrainingStarts(TrainingStart::Monolithic { model: source, device }));
            (Sides::Monolithic { model }, String::new())
        }
    };

    let trainer = Trainer {
        bundle: bundle.clone(),
        train: train.clone(),
        sides,
        optimizer: edge.optimizer,
        step,
        position: edge.position,
        checkpoints: checkpoints.clone(),
        server_namespace: server_namespace.clone(),
        split: cuts.split,
        tail_cut: cuts.tail,
        progress: opts.progress.clone(),
    };
    let outcome = tokio::task::spawn_blocking(move || trainer.run(&train_set, &test_set))
        .await
        .map_err(|error| HostError::Task { what: "the training thread failed", error })??;
    if let Some(server) = loopback {
        server.shutdown().await?;
    }

    let summary = summarize(&train, &bundle, cuts, &outcome, edge.resumed)?;
    write_report(&output, &summary)?;
    write_steps(&output.join(STEPS_CSV), &outcome.steps)?;
    if train.write_bundle {
        let server_checkpoint =
            cuts.remote.then(|| server_checkpoints.join(&server_namespace).join(format!("{}.safetensors", checkpoint_name(outcome.step))));
        let dir = output.join(TRAINED_BUNDLE);
        let short_id = write_bundle(&bundle, &outcome.last_checkpoint, server_checkpoint, &dir).await?;
        opts.progress.tell(Event::TrainedBundleWritten { dir, short_id });
    }
    Ok(summary)
}

/// Where a training run is cut: the edge trains `[0, split)` (and `[tail, stages)` when
/// U-shaped), the server `[split, tail)` when `remote`; monolithic, the edge trains every stage.
#[derive(Debug, Clone, Copy)]
struct Cuts {
    split: usize,
    tail: usize,
    stages: usize,
    remote: bool,
}

impl Cuts {
    /// Refused when the server would have no stage, or when the trained bundle cannot be
    /// written on this machine.
    fn of(config: &EdgeConfig, train: &TrainConfig, bundle: &Bundle, opts: &RunOptions) -> Result<Self> {
        let stages = bundle.stage_count();
        let split_spec = opts.split.as_ref().unwrap_or(&config.split);
        let (split, tail) = match &train.mode {
            TrainMode::Split => (bundle.resolve_split(split_spec)?, stages),
            TrainMode::UShaped { tail } => (bundle.resolve_split(split_spec)?, bundle.resolve_split(tail)?),
            TrainMode::Monolithic => (stages, stages),
        };
        let remote = train.mode != TrainMode::Monolithic;
        if remote && split >= tail {
            return Err(TrainingSetupError::NothingForTheServer { split, tail, before: if tail == stages { "output" } else { "tail" } }.into());
        }
        if train.write_bundle && remote && !opts.loopback {
            return Err(TrainingSetupError::WriteBundleNeedsLoopback.into());
        }
        if let Some(clients) = train.clients.as_ref().filter(|c| c.edges > 1 && opts.loopback) {
            return Err(TrainingSetupError::GroupOverLoopback { edges: clients.edges }.into());
        }
        if train.clients.as_ref().is_some_and(|c| c.mode == ClientMode::SplitFed) && split == 0 && tail == stages {
            return Err(TrainingSetupError::NothingToAverage.into());
        }
        Ok(Self { split, tail, stages, remote })
    }
}

/// Batch sizes the bundle takes.
fn check_batches(train: &TrainConfig, bundle: &Bundle) -> Result<()> {
    let max = bundle.manifest().batch.max;
    for (key, size) in [("batch_size", train.batch_size), ("eval_batch_size", train.eval_batch_size)] {
        if size > max {
            return Err(TrainingSetupError::BatchAboveTheBundle { key, size, max }.into());
        }
    }
    Ok(())
}

/// The training and test sets, read on the blocking pool; refused when either's last batch
/// would be below the bundle's smallest.
async fn load_datasets(train: &TrainConfig, bundle: &Bundle) -> Result<(Dataset, Dataset)> {
    let (train_set, test_set) = {
        let (bundle, train) = (bundle.clone(), train.clone());
        tokio::task::spawn_blocking(move || {
            Ok::<_, HostError>((
                Dataset::load(&train.train_data, &bundle, &train.targets)?,
                Dataset::load(&train.test_data, &bundle, &train.targets)?,
            ))
        })
        .await
        .map_err(|error| HostError::Task { what: "loading the datasets", error })??
    };
    let min = bundle.manifest().batch.min;
    for (set, rows, size) in [("training", train_set.rows(), train.batch_size), ("test", test_set.rows(), train.eval_batch_size)] {
        let last = rows % size;
        if last != 0 && last < min {
            return Err(TrainingSetupError::LastBatchTooSmall { set, rows: last, min }.into());
        }
    }
    Ok((train_set, test_set))
}

/// The edge's stages, optimizer and place in the data: fresh, or restored from the
/// checkpoint `train.resume` names (with the server checkpoint, `NAMESPACE/step-N`, that
/// holds the server's side of the same step).
struct EdgeSide {
    stages: EdgeStages,
    optimizer: Optimizer,
    position: Position,
    resumed: Option<u64>,
    server_resume: String,
}

impl EdgeSide {
    fn load(bundle: &Bundle, device: DeviceSpec, train: &TrainConfig, checkpoints: &Path, cuts: Cuts) -> Result<Self> {
        let Cuts { split, tail, stages, remote } = cuts;
        let load = |range| TrainableStages::load(bundle, range, device, train.seed);
        let stages = if remote {
            let prefix = (split > 0).then(|| load(StageRange::new(0, split))).transpose()?;
            let tail = (tail < stages).then(|| load(StageRange::new(tail, stages))).transpose()?;
            EdgeStages::Split { prefix, tail }
        } else {
            EdgeStages::Whole(load(StageRange::new(0, stages))?)
        };
        let mut edge = Self {
            stages,
            optimizer: Optimizer::new(train.optimizer.clone()),
            position: Position { epoch: 0, batch: 0 },
            resumed: None,
            server_resume: String::new(),
        };
        if let Some(name) = &train.resume {
            edge.restore(&checkpoints.join(name).join(HOST_CHECKPOINT), name, train.seed, remote)?;
        }
        Ok(edge)
    }

    fn restore(&mut self, path: &Path, name: &str, seed: u64, remote: bool) -> Result<()> {
        let meta = checkpoint::restore(path, &self.stages.parts(), &mut self.optimizer)?;
        let bad = |message: String| HostError::File { path: path.to_path_buf(), message };
        if meta.seed != seed {
            return Err(bad(format!("trained with seed {}, this run has seed {seed}; resume with the same seed", meta.seed)));
        }
        self.position = serde_json::from_value(meta.extra["position"].clone()).map_err(|e| bad(format!("no data position: {e}")))?;
        self.resumed = Some(meta.step);
        if remote {
            // The server's side of this step is in the namespace its session had.
            let namespace = meta.extra[SERVER_NAMESPACE_KEY]
                .as_str()
                .filter(|n| !n.is_empty())
                .ok_or_else(|| bad(format!("it names no server checkpoint namespace (`{SERVER_NAMESPACE_KEY}`): it is not of a split run")))?;
            self.server_resume = format!("{namespace}/{name}");
        }
        Ok(())
    }
}

/// Where the server's session starts: the server checkpoint it resumes (none: empty), the step
/// this host is at, and the samples this edge trains on each epoch (a `splitfed` edge's weight
/// in the average).
struct SessionStart {
    server_resume: String,
    step: u64,
    samples: u64,
}

/// The connection to the one server a training run uses from start to end (its session lives
/// there; a broken link reattaches there): the first of its servers (each address its names
/// resolve to with `resolve_every`) that answers.
async fn training_server(config: &EdgeConfig, bundle: &Bundle) -> Result<ServerSession> {
    let servers = crate::client::dns::servers_now(config).await;
    Ok(connect_first(&servers, bundle, &config.link(), &config.resilience.retry).await?)
}

/// Opens the server's session for `[split, tail)` on `session` (resuming `server_resume`
/// when set); refused when the server resumed at another step than this host.
async fn open_session(
    config: &EdgeConfig,
    train: &TrainConfig,
    bundle: &Bundle,
    cuts: Cuts,
    session: ServerSession,
    SessionStart { server_resume, step, samples }: SessionStart,
) -> Result<(TrainLink, pb::SessionOpened)> {
    session.check_accepts(&config.codec, config.security.key.as_ref().map(|(id, _)| *id))?;
    let open = pb::OpenSession {
        start: cuts.split as u32,
        end: cuts.tail as u32,
        optimizer: Some(pb::Optimizer::from(&train.optimizer)),
        schedule: Some(pb::Schedule::from(&train.schedule)),
        clip_grad_norm: train.clip_grad_norm.unwrap_or(0.0),
        // A split step's micro-batches are pipelined (U-shaped ones go one at a time).
        // (a batch of fewer samples than `microbatches` is cut into one a sample).
        pipeline_depth: if cuts.tail == cuts.stages { train.microbatches.min(train.batch_size.clamp(1, u32::MAX as i64) as u32) } else { 1 },
        loss: if cuts.tail == cuts.stages { train.loss.name().to_string() } else { String::new() },
        seed: train.seed,
        resume: server_resume,
        clients: train.clients.as_ref().map(|c| pb::ClientGroup {
            name: c.group.clone(),
            mode: c.mode.name().into(),
            edges: c.edges,
            edge: c.edge,
            samples,
        }),
        ..Default::default()
    };
    let request = SessionRequest { open, codec: config.codec, key: config.security.key.clone() };
    let reconnect = TrainReconnect { bundle: bundle.clone(), retry: config.resilience.retry };
    let (link, opened) = TrainLink::open(session, request, reconnect).await?;
    if opened.step != step {
        return Err(TrainingSetupError::ResumedApart { server: opened.step, host: step }.into());
    }
    Ok((link, opened))
}

fn summarize(train: &TrainConfig, bundle: &Bundle, cuts: Cuts, outcome: &Outcome, resumed: Option<u64>) -> Result<TrainingSummary> {
    Ok(TrainingSummary {
        mode: train.mode.name().to_string(),
        bundle_id: bundle.id().to_string(),
        model_source: bundle.manifest().model.source.clone(),
        split: cuts.remote.then_some(cuts.split),
        tail: matches!(train.mode, TrainMode::UShaped { .. }).then_some(cuts.tail),
        optimizer: serde_json::to_value(&train.optimizer).map_err(|error| HostError::Json { what: "the optimizer as JSON", error })?,
        loss: train.loss.name().to_string(),
        batch_size: train.batch_size as usize,
        seed: train.seed,
        final_test_accuracy: outcome.epochs.last().map_or(f64::NAN, |e| e.test_accuracy),
        final_train_loss: outcome.epochs.last().map_or(f64::NAN, |e| e.train_loss),
        // A run has at least one epoch and one step (else it stopped before); NaN otherwise.
        median_epoch_seconds: median(&outcome.epochs.iter().map(|e| e.epoch_seconds).collect::<Vec<_>>()).unwrap_or(f64::NAN),
        median_step_ms: median(&outcome.step_ms).unwrap_or(f64::NAN),
        total_steps: outcome.step,
        resumed_from_step: resumed,
        epochs: outcome.epochs.clone(),
    })
}

/// `steps.csv`: `step,epoch,step_ms,loss` for every step.
fn write_steps(path: &Path, steps: &[(u64, usize, f64, f64)]) -> Result<()> {
    let mut log = String::from("step,epoch,step_ms,loss\n");
    for (step, epoch, ms, loss) in steps {
        log.push_str(&format!("{step},{epoch},{ms},{loss}\n"));
    }
    std::fs::write(path, log).map_err(|e| HostError::write(path, e))
}

/// The trained weights (the host's last checkpoint, and the server's when it trained a part)
/// written as a bundle in `dir`, on the blocking pool (it loads the stages and hashes the
/// files); returns the start of its id.
async fn write_bundle(bundle: &Bundle, last_checkpoint: &Path, server_checkpoint: Option<PathBuf>, dir: &Path) -> Result<String> {
    let files: Vec<PathBuf> = std::iter::once(last_checkpoint.join(HOST_CHECKPOINT)).chain(server_checkpoint).collect();
    let (trained, target) = (bundle.clone(), dir.to_path_buf());
    let written = tokio::task::spawn_blocking(move || export::write_trained_bundle(&trained, &files, &target))
        .await
        .map_err(|error| HostError::Task { what: "writing the trained bundle", error })??;
    Ok(written.short_id().to_string())
}

/// The files and directories of a training run.
const TRAINING_FILES: [&str; 6] = [SUMMARY_JSON, METRICS_CSV, TRAINING_SVG, STEPS_CSV, TRAINED_BUNDLE, CHECKPOINTS];

/// Where a run's checkpoints go in its output directory (the server's under `server/` when the
/// host starts it).
pub const CHECKPOINTS: &str = "checkpoints";

/// The output rule of every command, for training: an earlier training run in `dir` is
/// refused unless `--force` replaces it (its checkpoints too) or `train.resume` continues it
/// from one of its checkpoints.
fn claim_training_output(dir: &Path, resume: Option<&str>, mode: OutputMode) -> Result<()> {
    let continue_with = Some("`train.resume: step-N` to continue it from a checkpoint");
    let earlier = EarlierRun { kind: "training run", files: &TRAINING_FILES, continue_with };
    match (resume, mode) {
        (None, OutputMode::Resume) => Err(OutputError::ResumeIsForInference.into()),
        (Some(_), OutputMode::Force) => Err(OutputError::ForceRemovesTheCheckpoint.into()),
        (Some(_), _) => claim_output(dir, &earlier, OutputMode::Resume),
        (None, mode) => claim_output(dir, &earlier, mode),
    }
}

/// Writes `metrics.csv`, `summary.json` and `training.svg` into `dir`, creating it when
/// needed. A summary without epochs is refused before anything is written.
pub fn write_report(dir: &Path, summary: &TrainingSummary) -> Result<()> {
    if summary.epochs.is_empty() {
        return Err(TrainingSetupError::NoEpochs { dir: dir.into() }.into());
    }
    std::fs::create_dir_all(dir).map_err(|error| HostError::Io { action: "cannot create", path: dir.into(), error })?;
    report::write_metrics_csv(&dir.join(METRICS_CSV), &summary.epochs)?;
    report::write_summary(&dir.join(SUMMARY_JSON), summary)?;
    let cut = match (summary.split, summary.tail) {
        (Some(split), Some(tail)) => format!(", cuts {split} and {tail}"),
        (Some(split), None) => format!(", cut {split}"),
        _ => String::new(),
    };
    let title = format!("{} training of {}{cut}", summary.mode, summary.model_source);
    Ok(plot_training(&dir.join(TRAINING_SVG), &title, &summary.epochs)?)
}

fn describe_edge(split: usize, tail: usize, n: usize) -> String {
    match (split, tail == n) {
        (0, true) => "nothing (it sends its inputs)".into(),
        (s, true) => format!("[0, {s})"),
        (0, false) => format!("[{tail}, {n}) and the loss"),
        (s, false) => format!("[0, {s}) and [{tail}, {n}) with the loss"),
    }
}

/// The name of the checkpoint taken after `step` steps, on both sides.
pub fn checkpoint_name(step: u64) -> String {
    format!("step-{step}")
}

/// What the loop hands back.
struct Outcome {
    epochs: Vec<EpochRecord>,
    step_ms: Vec<f64>,
    /// (step, epoch, ms, loss) of every step.
    steps: Vec<(u64, usize, f64, f64)>,
    step: u64,
    last_checkpoint: PathBuf,
}

/// What one micro-batch's passes leave on the edge.
struct MicrobatchPass {
    /// Its weighed loss.
    loss: f64,
    /// The gradients of the prefix's and the tail's parameters.
    prefix: Grads,
    tail: Grads,
    /// With clipping, after a step's last micro-batch: the norms of the server's gradients.
    server_norms: Vec<f32>,
}

/// The stages the edge trains, by mode (loaded before the server's session opens).
enum EdgeStages {
    /// Monolithic: every stage.
    Whole(TrainableStages),
    /// Split or U-shaped: `[0, split)` (none when the split is 0) and, U-shaped, `[tail, N)`.
    Split { prefix: Option<TrainableStages>, tail: Option<TrainableStages> },
}

impl EdgeStages {
    /// Its stages, in the model's order.
    fn parts(&self) -> Vec<&TrainableStages> {
        match self {
            Self::Whole(model) => vec![model],
            Self::Split { prefix, tail } => prefix.iter().chain(tail.iter()).collect(),
        }
    }
}

/// What a run trains, by mode: the whole model here, or the edge's stages and the link to the
/// server's session, which trains the rest.
enum Sides {
    Monolithic {
        model: TrainableStages,
    },
    /// The link is boxed: it is large, and the enum is moved while it is made.
    Split {
        prefix: Option<TrainableStages>,
        tail: Option<TrainableStages>,
        link: Box<TrainLink>,
    },
}

impl Sides {
    /// The edge's stages, in the model's order.
    fn parts(&self) -> Vec<&TrainableStages> {
        match self {
            Self::Monolithic { model } => vec![model],
            Self::Split { prefix, tail, .. } => prefix.iter().chain(tail.iter()).collect(),
        }
    }
}

/// The edge's side of a run, on a blocking thread.
struct Trainer {
    bundle: Bundle,
    train: TrainConfig,
    /// The stages it trains, and its link to the server's.
    sides: Sides,
    optimizer: Optimizer,
    step: u64,
    position: Position,
    checkpoints: PathBuf,
    /// The server's checkpoint namespace (empty when monolithic), kept in each host checkpoint.
    server_namespace: String,
    split: usize,
    tail_cut: usize,
    /// Where each epoch's record goes as it ends.
    progress: Progress,
}

impl Trainer {
    fn run(mut self, train_set: &Dataset, test_set: &Dataset) -> Result<Outcome> {
        let mut epochs = Vec::new();
        let mut step_ms = Vec::new();
        let mut steps_log = Vec::new();
        let mut last_checkpoint = PathBuf::new();
        let batch = self.train.batch_size as usize;
        let start = self.position;
        for epoch in start.epoch..self.train.epochs {
            let order = train_set.order(self.train.shuffle_seed, epoch);
            let batches: Vec<&[i64]> = order.chunks(batch).collect();
            let first = if epoch == start.epoch { start.batch } else { 0 };
            let bar = Bar::Epoch { epoch: epoch + 1, epochs: self.train.epochs };
            self.progress.tell(Event::BarStarts { bar, total: (batches.len() - first.min(batches.len())) as u64 });
            let (mut loss_sum, mut samples, mut steps) = (0.0f64, 0usize, 0u64);
            let mut stopped = false;
            let started = Instant::now();
            for (index, rows) in batches.iter().enumerate().skip(first) {
                if self.train.max_steps.is_some_and(|max| self.step >= max) {
                    stopped = true;
                    break;
                }
                // As torch.chunk cuts a batch: micro-batches of ceil(rows / M) rows.
                let microbatches = rows.chunks(rows.len().div_ceil(self.train.microbatches as usize)).map(|part| train_set.batch(part)).collect();
                let t0 = Instant::now();
                let step = tracing::debug_span!("train_step", step = self.step + 1, epoch = epoch + 1).entered();
                let loss = self.step(microbatches, rows.len()).map_err(|e| e.during(format!("training step {}", self.step + 1)))?;
                drop(step);
                let ms = t0.elapsed().as_secs_f64() * 1e3;
                step_ms.push(ms);
                steps_log.push((self.step, epoch + 1, ms, loss));
                loss_sum += loss * rows.len() as f64;
                samples += rows.len();
                steps += 1;
                self.position = Position { epoch, batch: index + 1 };
                self.progress.tell(Event::Advanced { loss: Some(loss) });
            }
            if steps > 0 {
                self.end_round().map_err(|e| e.during("ending the round"))?;
            }
            let epoch_seconds = started.elapsed().as_secs_f64();
            self.progress.tell(Event::BarEnds);
            if self.position.batch >= batches.len() {
                self.position = Position { epoch: epoch + 1, batch: 0 };
            }
            if steps > 0 {
                let eval_started = Instant::now();
                let (test_loss, test_accuracy) = self.evaluate(test_set).map_err(|e| e.during("evaluation"))?;
                let record = EpochRecord {
                    epoch: epoch + 1,
                    steps,
                    train_loss: loss_sum / samples as f64,
                    test_loss,
                    test_accuracy,
                    epoch_seconds,
                    eval_seconds: eval_started.elapsed().as_secs_f64(),
                };
                self.progress.tell(Event::EpochDone(record.clone()));
                epochs.push(record);
                last_checkpoint = self.save_checkpoint()?;
            }
            if stopped {
                break;
            }
        }
        if last_checkpoint.as_os_str().is_empty() {
            return Err(TrainingSetupError::NothingTrained { step: self.step }.into());
        }
        if let Sides::Split { link, .. } = self.sides {
            (*link).close();
        }
        Ok(Outcome { epochs, step_ms, steps: steps_log, step: self.step, last_checkpoint })
    }

    /// One optimizer step on both sides over a batch given as its micro-batches (one: the
    /// whole batch); returns the batch's loss.
    fn step(&mut self, microbatches: Vec<(Boundary, Tensor)>, rows: usize) -> Result<f64> {
        let count = microbatches.len() as u32;
        let mut parts = Vec::with_capacity(microbatches.len());
        for (index, (inputs, targets)) in (0..).zip(microbatches) {
            let weight = targets.size()[0] as f64 / rows as f64;
            parts.push((inputs, targets, Microbatch::new(index, count, weight)?));
        }
        // Split steps go through the pipeline (one micro-batch: sent, then answered).
        let passes = match &mut self.sides {
            Sides::Split { prefix, link, .. } if self.tail_cut == self.bundle.stage_count() => pipelined(self.step, prefix.as_mut(), link, parts)?,
            _ => parts.into_iter().map(|(inputs, targets, microbatch)| self.microbatch(inputs, targets, microbatch)).collect::<Result<Vec<_>>>()?,
        };
        let (mut loss, mut prefix_grads, mut tail_grads, mut server_norms) = (0.0, None, None, Vec::new());
        for pass in passes {
            loss += pass.loss;
            accumulate(&mut prefix_grads, pass.prefix);
            accumulate(&mut tail_grads, pass.tail);
            // The server's norms are those of its summed gradients, with the last answer.
            server_norms = pass.server_norms;
        }
        let (prefix_grads, tail_grads) = (prefix_grads.unwrap_or_default(), tail_grads.unwrap_or_default());
        if let Some(max_norm) = self.train.clip_grad_norm {
            // Every gradient's norm in the model's order: the prefix, the server's, the tail.
            let norms = [tensor_norms(&prefix_grads), server_norms, tensor_norms(&tail_grads)].concat();
            self.clip(max_norm, &norms, [&prefix_grads, &tail_grads])?;
        }
        let params: Vec<(String, Tensor)> = self.sides.parts().into_iter().flat_map(|p| named(p.parameters())).collect();
        let grads: Grads = prefix_grads.into_iter().chain(tail_grads).collect();
        let lr = self.train.schedule.lr(self.train.optimizer.lr(), self.step);
        self.optimizer.step(&params, &grads, lr);
        self.step += 1;
        Ok(loss)
    }

    /// The forward and backward passes of one micro-batch, monolithic or U-shaped: its
    /// weighed loss and this side's parameter gradients (the server sums its own).
    fn microbatch(&mut self, inputs: Boundary, targets: Tensor, microbatch: Microbatch) -> Result<MicrobatchPass> {
        let step = self.step;
        let (prefix, tail, link) = match &mut self.sides {
            Sides::Monolithic { model } => {
                let output = model.forward(step, microbatch, &inputs)?;
                let loss = microbatch.weigh(&step_loss(&self.bundle, self.train.loss, output, &targets)?);
                let grads = backward(Some(&loss), model.parameters(), &[])?.parameters;
                return Ok(MicrobatchPass { loss: loss.double_value(&[]), prefix: grads, tail: Grads::new(), server_norms: Vec::new() });
            }
            Sides::Split { prefix, tail, link } => (prefix, tail, link),
        };
        let at_split = match prefix.as_mut() {
            Some(prefix) => prefix.forward(step, microbatch, &inputs)?,
            None => inputs,
        };
        let prefix_outputs = float_leaves(&at_split);
        // U-shaped: the middle's output comes back, the tail and the loss run here.
        let middle = link.forward(&at_split.detached(), microbatch)?.boundary;
        let leaves = track_gradients(&middle);
        let output = match tail.as_mut() {
            Some(tail) => tail.forward(step, microbatch, &middle)?,
            None => middle,
        };
        let loss = microbatch.weigh(&step_loss(&self.bundle, self.train.loss, output, &targets)?);
        let tail_params = tail.as_ref().map(|t| named(t.parameters())).unwrap_or_default();
        let tail = backward(Some(&loss), &tail_params, &leaves)?;
        let back = link.backward(&tail.boundary)?;
        let prefix = backward_prefix(prefix.as_ref(), &prefix_outputs, &back.boundary)?;
        Ok(MicrobatchPass { loss: loss.double_value(&[]), prefix, tail: tail.parameters, server_norms: back.norms })
    }

    /// In a client group, after this edge's steps of an epoch: ends its round on the server
    /// (the group's next round starts once every edge has ended this one and evaluated: its
    /// first step of the next round tells the server so). `splitfed`: sends this edge's
    /// weights and takes the group's average in their place (FedAvg); the optimizer's state
    /// stays this edge's own.
    fn end_round(&mut self) -> Result<()> {
        // A client group trains a server part: `Cuts::of` refuses one that does not.
        let (Some(clients), Sides::Split { prefix, tail, link }) = (&self.train.clients, &mut self.sides) else { return Ok(()) };
        if clients.mode == ClientMode::Sequential {
            link.end_round()?;
            return Ok(());
        }
        let weights: Vec<(String, Tensor)> = prefix
            .iter()
            .chain(tail.iter())
            .flat_map(|p| p.parameters().iter().chain(p.buffers()))
            .filter(|(_, t)| t.is_floating_point())
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        let sent = Boundary { values: weights.iter().map(|(n, t)| (n.clone(), Value::Tensor(t.detach()))).collect() };
        let averaged = link.average(&sent)?;
        for (name, weight) in &weights {
            let average = averaged.values.iter().find(|(n, _)| n == name).and_then(|(_, v)| v.as_tensor());
            let average =
                average.filter(|a| a.size() == weight.size() && a.kind() == weight.kind()).ok_or_else(|| Breach::Average { name: name.clone() })?;
            tch::no_grad(|| weight.shallow_clone().copy_(average));
        }
        Ok(())
    }

    /// Clips the step's gradients as `clip_grad_norm_` would clip the whole model's, from
    /// the `norms` of all of them: this side computes the coefficient, and a server scales
    /// its own gradients by it and takes its step.
    fn clip(&mut self, max_norm: f64, norms: &[f32], grads: [&Grads; 2]) -> Result<()> {
        let coefficient = clip_coefficient(max_norm, norms).map_err(TrainError::NormNotFinite)?;
        if let Sides::Split { link, .. } = &mut self.sides {
            let server = link.clip_step(coefficient)?;
            if server != self.step + 1 {
                return Err(Breach::StepApart { server, host: self.step + 1 }.into());
            }
        }
        for g in grads {
            scale(g, coefficient);
        }
        Ok(())
    }

    /// Mean loss and accuracy on the held-out set, in eval mode (split inference over the session).
    fn evaluate(&mut self, test_set: &Dataset) -> Result<(f64, f64)> {
        let rows: Vec<i64> = (0..test_set.rows()).collect();
        let (mut loss_sum, mut right) = (0.0f64, 0i64);
        for chunk in rows.chunks(self.train.eval_batch_size as usize) {
            let (inputs, targets) = test_set.batch(chunk);
            let output = match &mut self.sides {
                Sides::Monolithic { model } => model.evaluate(&inputs)?,
                Sides::Split { prefix, tail, link } => {
                    let at_split = match prefix.as_mut() {
                        Some(prefix) => prefix.evaluate(&inputs)?,
                        None => inputs,
                    };
                    let returned = link.evaluate(&at_split)?.boundary;
                    match tail.as_mut() {
                        Some(tail) => tail.evaluate(&returned)?,
                        None => returned,
                    }
                }
            };
            let output = output_tensor(&self.bundle, output)?;
            let loss = tch::no_grad(|| self.train.loss.compute(&output, &targets))?;
            loss_sum += loss.double_value(&[]) * chunk.len() as f64;
            if self.train.loss == LossKind::CrossEntropy {
                right += correct(&output, &targets);
            }
        }
        let n = test_set.rows() as f64;
        Ok((loss_sum / n, right as f64 / n))
    }

    /// Both sides write checkpoint `step-N`; returns the host's checkpoint directory.
    fn save_checkpoint(&mut self) -> Result<PathBuf> {
        let name = checkpoint_name(self.step);
        let dir = self.checkpoints.join(&name);
        let parts = self.sides.parts();
        let meta = CheckpointMeta {
            bundle_id: self.bundle.id().to_string(),
            ranges: parts.iter().map(|p| [p.range().start, p.range().end]).collect(),
            step: self.step,
            optimizer: self.optimizer.config().clone(),
            seed: self.train.seed,
            extra: serde_json::json!({
                "position": self.position,
                "mode": self.train.mode.name(),
                "split": self.split,
                "tail": self.tail_cut,
                SERVER_NAMESPACE_KEY: self.server_namespace,
            }),
        };
        checkpoint::save(&dir.join(HOST_CHECKPOINT), &meta, &parts, &self.optimizer)?;
        if let Sides::Split { link, .. } = &mut self.sides {
            let server_step = link.save(&name)?;
            if server_step != self.step {
                return Err(Breach::CheckpointStep { server: server_step, host: self.step }.into());
            }
        }
        Ok(dir)
    }
}

/// A split step's micro-batches, pipelined: each one's prefix runs and is sent while the
/// server works on the ones before; then each answer's gradient is backpropagated into its
/// prefix while the server works on the ones after.
fn pipelined(
    step: u64,
    mut prefix: Option<&mut TrainableStages>,
    link: &mut TrainLink,
    parts: Vec<(Boundary, Tensor, Microbatch)>,
) -> Result<Vec<MicrobatchPass>> {
    let mut sent = Vec::with_capacity(parts.len());
    for (inputs, targets, microbatch) in parts {
        let at_split = match prefix.as_deref_mut() {
            Some(prefix) => prefix.forward(step, microbatch, &inputs)?,
            None => inputs,
        };
        sent.push(float_leaves(&at_split));
        let mut payload = at_split.detached();
        payload.values.push((TARGETS_VALUE.to_string(), Value::Tensor(targets)));
        link.send_forward(&payload, microbatch)?;
    }
    sent.into_iter()
        .map(|prefix_outputs| {
            let answer = link.forward_answer()?;
            let loss = answer.loss.ok_or(Breach::NoLoss)?;
            let prefix = backward_prefix(prefix.as_deref(), &prefix_outputs, &answer.boundary)?;
            Ok(MicrobatchPass { loss, prefix, tail: Grads::new(), server_norms: answer.norms })
        })
        .collect()
}

/// The prefix's parameter gradients, continuing the backward pass from the server's gradient
/// at the split (none without a prefix).
fn backward_prefix(prefix: Option<&TrainableStages>, outputs: &[(String, Tensor)], grads_at_split: &Boundary) -> Result<Grads> {
    let Some(prefix) = prefix else { return Ok(Grads::new()) };
    Ok(backward_from_boundary(outputs, grads_at_split, prefix.parameters(), &[])?.parameters)
}

fn named(params: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
    params.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect()
}

/// Reads the parameters and buffers of a checkpoint file (for comparisons and tools).
pub fn checkpoint_state(path: &Path) -> Result<std::collections::HashMap<String, Tensor>> {
    Ok(checkpoint::read(path)?.1)
}

#[cfg(test)]
mod tests {
    use super::report::fixtures::{epoch, summary};
    use super::report::read_summary;
    use super::*;
    use crate::plots::training::tests::assert_plot_looks_right;
    use std::fs;

    #[test]
    fn write_report_creates_the_directory_and_all_three_files() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("runs").join("split-3");
        let written = summary(vec![epoch(1, 0.5, 0.4, 0.8), epoch(2, 0.25, 0.3, 0.9)]);
        write_report(&out, &written).unwrap();
        assert_eq!(read_summary(&out.join(SUMMARY_JSON)).unwrap(), written);
        assert_eq!(fs::read_to_string(out.join(METRICS_CSV)).unwrap().lines().count(), 3);
        let svg = fs::read_to_string(out.join(TRAINING_SVG)).unwrap();
        assert_plot_looks_right(&svg);
        assert!(svg.contains("split training of tests.models:digits_cnn, cut 3"));
    }

    #[test]
    fn write_report_refuses_an_empty_run_before_writing() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("empty-run");
        let err = write_report(&out, &summary(Vec::new())).unwrap_err().to_string();
        assert!(err.contains("no epochs") && err.contains("empty-run"), "{err}");
        assert!(!out.exists());
    }
}
