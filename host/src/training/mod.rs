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
//! in eval mode) and a checkpoint is written on both sides; the output directory gets
//! `metrics.csv`, `summary.json` and `training.svg` ([`report`]).

mod data;
mod link;
pub mod report;

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use cleave_common::config::{EdgeConfig, TrainConfig, TrainMode, TrainingOptions};
use cleave_common::device::device_name;
use cleave_common::pb;
use cleave_common::training::checkpoint::{self, CheckpointMeta};
use cleave_common::training::loss::correct;
use cleave_common::training::optim::{Optimizer, OptimizerConfig};
use cleave_common::training::{float_leaves, gradient_boundary, gradients, track_gradients, vjp_root, TrainableStages, TARGETS_VALUE};
use cleave_common::{Boundary, Bundle, StageRange, Value};
use tch::Tensor;

use crate::client::{check_server_accepts, connect, Link};
use crate::RunOptions;
use data::Dataset;
use link::{SessionRequest, TrainLink};
pub use report::{EpochRecord, TrainingSummary};

/// The host's checkpoint file inside a checkpoint directory (`checkpoints/step-N/`).
pub const HOST_CHECKPOINT: &str = "host.safetensors";

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
pub async fn run(config: EdgeConfig, opts: RunOptions) -> anyhow::Result<TrainingSummary> {
    let train = config.train.clone().context("the config has no `train` section")?;
    let bundle = Bundle::open(&config.bundle)?;
    let output = opts.output.clone().unwrap_or_else(|| config.output.clone());
    let n = bundle.stage_count();
    let (split, tail) = match &train.mode {
        TrainMode::Split => (bundle.resolve_split(opts.split.as_ref().unwrap_or(&config.split))?, n),
        TrainMode::UShaped { tail } => (bundle.resolve_split(opts.split.as_ref().unwrap_or(&config.split))?, bundle.resolve_split(tail)?),
        TrainMode::Monolithic => (n, n),
    };
    let remote = train.mode != TrainMode::Monolithic;
    if remote && split >= tail {
        anyhow::bail!("the server's stages [{split}, {tail}) are empty: the split must come before the {}", if tail == n { "output" } else { "tail" });
    }
    if train.write_bundle && remote && !opts.loopback {
        anyhow::bail!(
            "`train.write_bundle` needs the server's checkpoint on this machine: use --loopback, or copy it here and run `host export-trained`"
        );
    }
    let batch = bundle.manifest().batch;
    for (key, size) in [("batch_size", train.batch_size), ("eval_batch_size", train.eval_batch_size)] {
        if size > batch.max {
            anyhow::bail!("train.{key} {size} is above the bundle's largest batch {}", batch.max);
        }
    }
    let train_set = Dataset::load(&train.train_data, &bundle, &train.targets)?;
    let test_set = Dataset::load(&train.test_data, &bundle, &train.targets)?;
    for (what, rows, size) in [("training", train_set.rows(), train.batch_size), ("test", test_set.rows(), train.eval_batch_size)] {
        let last = rows % size;
        if last != 0 && last < batch.min {
            anyhow::bail!("the {what} set's last batch would have {last} rows, below the bundle's smallest batch {}", batch.min);
        }
    }

    let checkpoints = output.join("checkpoints");
    let server_checkpoints = checkpoints.join("server");
    let loopback = if remote && opts.loopback {
        let options = TrainingOptions { checkpoint_dir: Some(server_checkpoints.clone()), concurrent_sessions: false };
        Some(crate::LoopbackServer::start_configured(&config.bundle, config.loopback_device, config.loopback_limits, config.loopback_security(), options).await?)
    } else {
        None
    };

    // The edge's stages load on a blocking thread: TorchScript loading takes a while.
    let (prefix, tail_stages, optimizer, position, resumed) = {
        let (bundle, device, seed) = (bundle.clone(), config.device, train.seed);
        let train = train.clone();
        let checkpoints = checkpoints.clone();
        tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
            let prefix = (split > 0).then(|| TrainableStages::load(&bundle, StageRange::new(0, split), device, seed)).transpose()?;
            let tail_stages = (remote && tail < n).then(|| TrainableStages::load(&bundle, StageRange::new(tail, n), device, seed)).transpose()?;
            let mut optimizer = Optimizer::new(train.optimizer.clone());
            let mut position = Position { epoch: 0, batch: 0 };
            let mut resumed = None;
            if let Some(name) = &train.resume {
                let path = checkpoints.join(name).join(HOST_CHECKPOINT);
                let parts: Vec<&TrainableStages> = prefix.iter().chain(tail_stages.iter()).collect();
                let meta = checkpoint::restore(&path, &parts, &mut optimizer)?;
                if meta.seed != train.seed {
                    anyhow::bail!("{}: trained with seed {}, this run has seed {}; resume with the same seed", path.display(), meta.seed, train.seed);
                }
                position = serde_json::from_value(meta.extra["position"].clone()).with_context(|| format!("{}: no data position", path.display()))?;
                resumed = Some(meta.step);
            }
            Ok((prefix, tail_stages, optimizer, position, resumed))
        })
        .await??
    };
    let step = resumed.unwrap_or(0);

    let mut client = None;
    let link = if remote {
        let url = loopback.as_ref().map_or(config.server.clone(), |l| l.url.clone());
        let max_message = config.loopback_limits.max_message_bytes;
        let (mut c, info) = connect(&url, &bundle, &Link::secured(max_message as usize, &config.security)).await?;
        check_server_accepts(&info, &config.codec, config.security.key.as_ref().map(|(id, _)| *id))?;
        let open = pb::OpenSession {
            start: split as u32,
            end: tail as u32,
            optimizer: Some(optimizer_to_pb(&train.optimizer)),
            loss: if tail == n { train.loss.name().to_string() } else { String::new() },
            seed: train.seed,
            resume: train.resume.clone().unwrap_or_default(),
        };
        let request = SessionRequest {
            open,
            codec: config.codec,
            key: config.security.key.clone(),
            max_message_bytes: max_message,
            max_payload_bytes: config.loopback_limits.max_payload_bytes,
        };
        let (link, opened) = TrainLink::open(&mut c, &bundle, request).await?;
        if opened.step != step {
            anyhow::bail!("the server resumed at step {}, this host at step {step}: the checkpoints are of different moments", opened.step);
        }
        println!(
            "{} training {} : edge trains {} on {}, server {} trains [{split}, {tail}) on {} (session {}, {} parameters there)",
            train.mode.name(),
            bundle.manifest().model.source,
            describe_edge(split, tail, n),
            device_name(config.device.resolve()?),
            url,
            opened.device,
            opened.session_id,
            opened.parameters
        );
        client = Some(c);
        Some(link)
    } else {
        println!("monolithic training {}: every stage on {}", bundle.manifest().model.source, device_name(config.device.resolve()?));
        None
    };

    let trainer = Trainer {
        bundle: bundle.clone(),
        train: train.clone(),
        prefix,
        tail: tail_stages,
        optimizer,
        link,
        step,
        position,
        checkpoints: checkpoints.clone(),
        split,
        tail_cut: tail,
    };
    let outcome = tokio::task::spawn_blocking(move || trainer.run(&train_set, &test_set)).await??;
    drop(client);
    if let Some(server) = loopback {
        server.shutdown().await?;
    }

    let summary = TrainingSummary {
        mode: train.mode.name().to_string(),
        bundle_id: bundle.id().to_string(),
        model_source: bundle.manifest().model.source.clone(),
        split: remote.then_some(split),
        tail: matches!(train.mode, TrainMode::UShaped { .. }).then_some(tail),
        optimizer: serde_json::to_value(&train.optimizer)?,
        loss: train.loss.name().to_string(),
        batch_size: train.batch_size as usize,
        seed: train.seed,
        final_test_accuracy: outcome.epochs.last().map_or(f64::NAN, |e| e.test_accuracy),
        final_train_loss: outcome.epochs.last().map_or(f64::NAN, |e| e.train_loss),
        median_epoch_seconds: report::median(&outcome.epochs.iter().map(|e| e.epoch_seconds).collect::<Vec<_>>()),
        median_step_ms: report::median(&outcome.step_ms),
        total_steps: outcome.step,
        resumed_from_step: resumed,
        epochs: outcome.epochs.clone(),
    };
    report::write_all(&output, &summary)?;
    let mut log = String::from("step,epoch,step_ms,loss\n");
    for (step, epoch, ms, loss) in &outcome.steps {
        log.push_str(&format!("{step},{epoch},{ms},{loss}\n"));
    }
    std::fs::write(output.join(STEPS_CSV), log).with_context(|| format!("writing {}", output.join(STEPS_CSV).display()))?;
    if train.write_bundle {
        let dir = output.join(TRAINED_BUNDLE);
        let mut files = vec![outcome.last_checkpoint.join(HOST_CHECKPOINT)];
        if remote {
            files.push(server_checkpoints.join(format!("{}.safetensors", checkpoint_name(outcome.step))));
        }
        let written = cleave_common::training::export::write_trained_bundle(&bundle, &files, &dir)?;
        println!("trained bundle written to {} (id {})", dir.display(), written.id());
    }
    println!(
        "{} epochs, {} steps: final test accuracy {:.2}%, median epoch {:.2} s, median step {:.1} ms; results in {}",
        summary.epochs.len(),
        summary.total_steps,
        summary.final_test_accuracy * 100.0,
        summary.median_epoch_seconds,
        summary.median_step_ms,
        output.display()
    );
    Ok(summary)
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

fn optimizer_to_pb(o: &OptimizerConfig) -> pb::Optimizer {
    match *o {
        OptimizerConfig::Sgd { lr, momentum, dampening, weight_decay, nesterov } => {
            pb::Optimizer { kind: "sgd".into(), lr, momentum, dampening, weight_decay, nesterov, ..Default::default() }
        }
        OptimizerConfig::Adam { lr, betas, eps, weight_decay } | OptimizerConfig::Adamw { lr, betas, eps, weight_decay } => pb::Optimizer {
            kind: o.kind().into(),
            lr,
            weight_decay,
            beta1: betas[0],
            beta2: betas[1],
            eps,
            ..Default::default()
        },
    }
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

/// The edge's side of a run, on a blocking thread.
struct Trainer {
    bundle: Bundle,
    train: TrainConfig,
    /// Stages `[0, split)` (every stage when monolithic); none when the split is 0.
    prefix: Option<TrainableStages>,
    /// U-shaped: stages `[tail, N)`.
    tail: Option<TrainableStages>,
    optimizer: Optimizer,
    link: Option<TrainLink>,
    step: u64,
    position: Position,
    checkpoints: PathBuf,
    split: usize,
    tail_cut: usize,
}

impl Trainer {
    fn run(mut self, train_set: &Dataset, test_set: &Dataset) -> anyhow::Result<Outcome> {
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
            let progress = indicatif::ProgressBar::new((batches.len() - first.min(batches.len())) as u64);
            progress.set_style(
                indicatif::ProgressStyle::with_template("epoch {prefix} {bar:30} {pos}/{len} steps {per_sec} loss {msg}").expect("template"),
            );
            progress.set_prefix(format!("{}/{}", epoch + 1, self.train.epochs));
            let (mut loss_sum, mut samples, mut steps) = (0.0f64, 0usize, 0u64);
            let mut stopped = false;
            let started = Instant::now();
            for (index, rows) in batches.iter().enumerate().skip(first) {
                if self.train.max_steps.is_some_and(|max| self.step >= max) {
                    stopped = true;
                    break;
                }
                let (inputs, targets) = train_set.batch(rows);
                let t0 = Instant::now();
                let loss = self.step(inputs, targets).with_context(|| format!("training step {}", self.step + 1))?;
                let ms = t0.elapsed().as_secs_f64() * 1e3;
                step_ms.push(ms);
                steps_log.push((self.step, epoch + 1, ms, loss));
                loss_sum += loss * rows.len() as f64;
                samples += rows.len();
                steps += 1;
                self.position = Position { epoch, batch: index + 1 };
                progress.set_message(format!("{loss:.4}"));
                progress.inc(1);
            }
            let epoch_seconds = started.elapsed().as_secs_f64();
            progress.finish_and_clear();
            if self.position.batch >= batches.len() {
                self.position = Position { epoch: epoch + 1, batch: 0 };
            }
            if steps > 0 {
                let eval_started = Instant::now();
                let (test_loss, test_accuracy) = self.evaluate(test_set).context("evaluation")?;
                let record = EpochRecord {
                    epoch: epoch + 1,
                    steps,
                    train_loss: loss_sum / samples as f64,
                    test_loss,
                    test_accuracy,
                    epoch_seconds,
                    eval_seconds: eval_started.elapsed().as_secs_f64(),
                };
                println!(
                    "epoch {:>3}: train loss {:.4}, test loss {:.4}, test accuracy {:.2}% ({} steps, {:.2} s + eval {:.2} s)",
                    record.epoch,
                    record.train_loss,
                    record.test_loss,
                    record.test_accuracy * 100.0,
                    steps,
                    epoch_seconds,
                    record.eval_seconds
                );
                epochs.push(record);
                last_checkpoint = self.save_checkpoint()?;
            }
            if stopped {
                break;
            }
        }
        if last_checkpoint.as_os_str().is_empty() {
            anyhow::bail!("no step was trained: the run was already at step {} (max_steps) or past its last epoch", self.step);
        }
        Ok(Outcome { epochs, step_ms, steps: steps_log, step: self.step, last_checkpoint })
    }

    /// One optimizer step on both sides; returns the loss.
    fn step(&mut self, inputs: Boundary, targets: Tensor) -> anyhow::Result<f64> {
        let step = self.step;
        let at_split = match &mut self.prefix {
            Some(prefix) => prefix.forward(step, &inputs)?,
            None => inputs,
        };
        let prefix_outputs = float_leaves(&at_split);
        let mut params: Vec<(String, Tensor)> = Vec::new();
        let mut grads: Vec<Option<Tensor>> = Vec::new();
        let loss = match self.link.as_mut() {
            None => {
                // Monolithic: the prefix is the whole model.
                let loss = self.train.loss.compute(&output_tensor(&self.bundle, at_split)?, &targets)?;
                let prefix = self.prefix.as_ref().expect("a monolithic run holds every stage");
                params.extend(named(prefix.parameters()));
                grads.extend(gradients(&loss, &tensors(prefix.parameters()))?);
                self.optimizer.step(&params, &grads);
                self.step += 1;
                return Ok(loss.double_value(&[]));
            }
            Some(link) if self.tail_cut == self.bundle.stage_count() => {
                let mut payload = at_split.detached();
                payload.values.push((TARGETS_VALUE.to_string(), Value::Tensor(targets)));
                let answer = link.forward(&payload)?;
                let loss = answer.loss.context("the server sent no loss")?;
                self.backward_prefix(&prefix_outputs, &answer.boundary, &mut params, &mut grads)?;
                loss
            }
            Some(link) => {
                // U-shaped: the middle's output comes back, the tail and the loss run here.
                let middle = link.forward(&at_split.detached())?.boundary;
                let leaves = track_gradients(&middle);
                let output = match &mut self.tail {
                    Some(tail) => tail.forward(step, &middle)?,
                    None => middle,
                };
                let loss = self.train.loss.compute(&output_tensor(&self.bundle, output)?, &targets)?;
                let tail_params = self.tail.as_ref().map(|t| named(t.parameters())).unwrap_or_default();
                let mut inputs = tensors(&tail_params);
                inputs.extend(leaves.iter().map(|(_, t)| t.shallow_clone()));
                let mut all = gradients(&loss, &inputs)?;
                let leaf_grads = all.split_off(tail_params.len());
                params.extend(tail_params);
                grads.extend(all);
                let back = self.link.as_mut().expect("linked").backward(&gradient_boundary(&leaves, leaf_grads))?;
                self.backward_prefix(&prefix_outputs, &back.boundary, &mut params, &mut grads)?;
                loss.double_value(&[])
            }
        };
        self.optimizer.step(&params, &grads);
        self.step += 1;
        Ok(loss)
    }

    /// Continues the backward pass into the prefix from the server's gradient at the split.
    fn backward_prefix(&self, outputs: &[(String, Tensor)], grads_at_split: &Boundary, params: &mut Vec<(String, Tensor)>, grads: &mut Vec<Option<Tensor>>) -> anyhow::Result<()> {
        let Some(prefix) = &self.prefix else { return Ok(()) };
        let root = vjp_root(outputs, grads_at_split)?;
        params.extend(named(prefix.parameters()));
        match root {
            Some(root) => grads.extend(gradients(&root, &tensors(prefix.parameters()))?),
            None => grads.extend(prefix.parameters().iter().map(|_| None)),
        }
        Ok(())
    }

    /// Mean loss and accuracy on the held-out set, in eval mode (split inference over the session).
    fn evaluate(&mut self, test_set: &Dataset) -> anyhow::Result<(f64, f64)> {
        let rows: Vec<i64> = (0..test_set.rows()).collect();
        let (mut loss_sum, mut right) = (0.0f64, 0i64);
        for chunk in rows.chunks(self.train.eval_batch_size as usize) {
            let (inputs, targets) = test_set.batch(chunk);
            let at_split = match &mut self.prefix {
                Some(prefix) => prefix.evaluate(&inputs)?,
                None => inputs,
            };
            let output = match self.link.as_mut() {
                None => at_split,
                Some(link) => {
                    let returned = link.evaluate(&at_split)?.boundary;
                    match &mut self.tail {
                        Some(tail) => tail.evaluate(&returned)?,
                        None => returned,
                    }
                }
            };
            let output = output_tensor(&self.bundle, output)?;
            let loss = tch::no_grad(|| self.train.loss.compute(&output, &targets))?;
            loss_sum += loss.double_value(&[]) * chunk.len() as f64;
            if self.train.loss == cleave_common::training::loss::LossKind::CrossEntropy {
                right += correct(&output, &targets);
            }
        }
        let n = test_set.rows() as f64;
        Ok((loss_sum / n, right as f64 / n))
    }

    /// Both sides write checkpoint `step-N`; returns the host's checkpoint directory.
    fn save_checkpoint(&mut self) -> anyhow::Result<PathBuf> {
        let name = checkpoint_name(self.step);
        let dir = self.checkpoints.join(&name);
        let parts: Vec<&TrainableStages> = self.prefix.iter().chain(self.tail.iter()).collect();
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
            }),
        };
        checkpoint::save(&dir.join(HOST_CHECKPOINT), &meta, &parts, &self.optimizer)?;
        if let Some(link) = self.link.as_mut() {
            let server_step = link.save(&name)?;
            if server_step != self.step {
                anyhow::bail!("the server checkpointed step {server_step}, this host step {}", self.step);
            }
        }
        Ok(dir)
    }
}

fn named(params: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
    params.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect()
}

fn tensors(params: &[(String, Tensor)]) -> Vec<Tensor> {
    params.iter().map(|(_, t)| t.shallow_clone()).collect()
}

/// The model's output from the boundary at the last cut; training needs one tensor.
fn output_tensor(bundle: &Bundle, last: Boundary) -> anyhow::Result<Tensor> {
    match bundle.assemble_output(last)? {
        Value::Tensor(t) => Ok(t),
        other => anyhow::bail!("the model's output is {}; the loss needs one tensor", other.describe()),
    }
}

/// Reads the parameters and buffers of a checkpoint file (for comparisons and tools).
pub fn checkpoint_state(path: &Path) -> anyhow::Result<std::collections::HashMap<String, Tensor>> {
    Ok(checkpoint::read(path)?.1)
}
