//! The edge side of cleave.
//!
//! - [`run`]: `host --config edge.yaml [--loopback]`: run the prefix of each request, stream
//!   the boundaries to the server, write predictions, metrics and a summary.
//! - `auto_split`: `split: auto` while running (moving bandwidth estimate, re-planning, probes).
//! - `client`: the streaming client (prefix thread, in-flight window, reassembly).
//! - `inputs`, `images`: synthetic tensors, tensor files (.safetensors, .npz, .npy) or images.
//! - `pictures`: plots of a run (latency breakdown per cut, latency CDF, predicted against measured).
//! - [`planning`]: `host plan`: edge, server and link profiles, the predicted latency of every cut.
//! - `report`: `predictions.jsonl`, `metrics.csv`, `summary.json` and the printed table.
//! - [`training`]: `host --config train.yaml [--loopback]` (a `train:` section): split,
//!   U-shaped or monolithic training, evaluation, checkpoints, report files.
//! - [`print_splits`], [`verify`]: `host splits` and `host verify`.

pub mod auto_split;
pub mod client;
pub mod images;
pub mod inputs;
pub mod pictures;
pub mod planning;
pub mod report;
pub mod training;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cleave_common::config::{EdgeConfig, SplitSpec};
use cleave_common::security::ServerSecurity;
use cleave_common::device::device_name;
use tokio::net::TcpListener;

use crate::auto_split::AutoSplit;
use crate::client::{connect, stream_requests, Link, Splits, StreamPlan};
use crate::inputs::Inputs;
use crate::report::{summary_table, Percentiles, ReportWriter, Summary};

use cleave_common::tables::{split_table, verify_table};
use cleave_common::verify::verify_splits;
use cleave_common::{Bundle, DeviceSpec};

/// What `host verify` checks.
#[derive(Debug, Clone)]
pub struct VerifyOptions {
    /// The bundle directory.
    pub bundle: PathBuf,
    /// Where to run the stages.
    pub device: DeviceSpec,
    /// Batch sizes to check (every reference batch when empty).
    pub batches: Vec<i64>,
}

/// Prints the split-point table of a bundle.
pub fn print_splits(bundle_dir: &PathBuf) -> anyhow::Result<()> {
    let bundle = Bundle::open(bundle_dir)?;
    let m = bundle.manifest();
    println!(
        "bundle {} ({}, {} parameters), id {}",
        bundle_dir.display(),
        m.model.source,
        cleave_common::tables::thousands(m.model.parameters),
        &bundle.id()[..16]
    );
    println!(
        "{} stages at granularity {:?}; split at cut s: the edge runs stages [0, s), the server [s, {}); batch {}..={}",
        bundle.stage_count(),
        m.exporter.granularity,
        bundle.stage_count(),
        m.batch.min,
        m.batch.max
    );
    println!("{}", split_table(&bundle));
    Ok(())
}

/// Runs every split point against the references; returns whether all passed.
pub fn verify(opts: &VerifyOptions) -> anyhow::Result<bool> {
    let bundle = Bundle::open(&opts.bundle)?;
    let batches = if opts.batches.is_empty() { bundle.reference_batches() } else { opts.batches.clone() };
    let mut all_passed = true;
    for batch in batches {
        let report = verify_splits(&bundle, opts.device, batch)?;
        println!(
            "{}: split at every cut on {} at batch {} (stages loaded in {:.0} ms)",
            bundle.manifest().model.source,
            report.device,
            batch,
            report.load_ms
        );
        println!("{}", verify_table(&report));
        let passed = report.passed();
        println!(
            "{}",
            if passed {
                "every split matches the reference and all splits agree bit for bit".to_string()
            } else {
                "MISMATCH: some split differs from the reference or from the others".to_string()
            }
        );
        all_passed &= passed;
    }
    Ok(all_passed)
}

/// Command-line overrides of `edge.yaml`.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Start the server in this process on 127.0.0.1 (an ephemeral port) and use it.
    pub loopback: bool,
    /// Overrides `split`.
    pub split: Option<SplitSpec>,
    /// Overrides `output`.
    pub output: Option<PathBuf>,
}

/// A server started in this process for `--loopback`; stops when dropped.
pub struct LoopbackServer {
    /// Its URL.
    pub url: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl LoopbackServer {
    /// Loads the bundle and serves it on 127.0.0.1 with the same code as `server`, in
    /// plaintext, accepting every codec.
    pub async fn start(bundle: &std::path::Path, device: cleave_common::DeviceSpec, limits: cleave_common::config::Limits) -> anyhow::Result<Self> {
        Self::start_secured(bundle, device, limits, ServerSecurity::default()).await
    }

    /// Like [`LoopbackServer::start`], enforcing `security` (TLS, token, keys, codecs).
    pub async fn start_secured(
        bundle: &std::path::Path,
        device: cleave_common::DeviceSpec,
        limits: cleave_common::config::Limits,
        security: ServerSecurity,
    ) -> anyhow::Result<Self> {
        Self::start_configured(bundle, device, limits, security, cleave_server::TrainingOptions::default()).await
    }

    /// Like [`LoopbackServer::start_secured`], with training sessions configured.
    pub async fn start_configured(
        bundle: &std::path::Path,
        device: cleave_common::DeviceSpec,
        limits: cleave_common::config::Limits,
        security: ServerSecurity,
        training: cleave_server::TrainingOptions,
    ) -> anyhow::Result<Self> {
        let bundle = bundle.to_path_buf();
        let scheme = if security.tls.is_some() { "https" } else { "http" };
        let prepared = tokio::task::spawn_blocking(move || {
            cleave_server::PreparedServer::prepare(&bundle, device, limits, security).map(|p| p.with_training(training))
        })
        .await??;
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("{scheme}://{}", listener.local_addr()?);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(prepared.serve(listener, async {
            let _ = stopped.await;
        }));
        Ok(Self { url, stop: Some(stop), task: Some(task) })
    }

    /// Stops it after the requests in flight are answered.
    pub async fn shutdown(mut self) -> anyhow::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.task.take() {
            Some(task) => task.await?,
            None => Ok(()),
        }
    }
}

/// `host --config edge.yaml`: the whole run. Returns the summary (also written to disk).
pub async fn run(config: EdgeConfig, opts: RunOptions) -> anyhow::Result<Summary> {
    let bundle = Bundle::open(&config.bundle)?;
    let split_spec = opts.split.clone().unwrap_or_else(|| config.split.clone());
    let auto = split_spec == SplitSpec::Auto;
    let split = if auto { bundle.stage_count() } else { bundle.resolve_split(&split_spec)? };
    let output = opts.output.unwrap_or_else(|| config.output.clone());
    let Some(input) = &config.input else {
        anyhow::bail!("the config has no `input`: inference needs one (training configs go to `training::run`)");
    };
    let inputs = Inputs::new(input, &bundle, config.batch_size)?;
    let loopback = if opts.loopback {
        Some(LoopbackServer::start_secured(&config.bundle, config.loopback_device, config.loopback_limits, config.loopback_security()).await?)
    } else {
        None
    };
    let url = loopback.as_ref().map_or(config.server.clone(), |l| l.url.clone());
    let uses_tls = url.starts_with("https://");
    let max_message = config.loopback_limits.max_message_bytes as usize;
    let (mut client, info) = connect(&url, &bundle, &Link::secured(max_message, &config.security)).await?;
    // `split: auto`: plan from measured profiles, then re-plan from the bandwidth measured on
    // every transfer; the prefix thread reads the split for each request.
    let mut planned = None;
    let mut planner = None;
    if auto {
        let profiles = planning::measure_profiles(&config, &mut client, &bundle, 3).await?;
        let (auto_split, plan) = AutoSplit::plan(profiles, config.objective)?;
        println!(
            "split: auto ({:?}): the planner picks cut {}, predicted {:.2} ms, from the measured profiles (link {:.1} Mbit/s, round trip {:.2} ms)",
            plan.objective, plan.cut, plan.predicted_ms, plan.link_mbit_per_s, plan.rtt_ms
        );
        planner = Some(Arc::new(Mutex::new(auto_split)));
        planned = Some(plan);
    }
    let split = planned.as_ref().map_or(split, |p| p.cut);
    println!(
        "{} split at cut {split} ({}): edge runs stages [0, {split}) on {}, server {} runs [{split}, {}) on {}",
        bundle.manifest().model.source,
        bundle.cut(split).name,
        device_name(config.device.resolve()?),
        url,
        bundle.stage_count(),
        info.device
    );
    let mut writer = ReportWriter::create(&output, config.top_k)?;
    let progress = indicatif::ProgressBar::new(config.requests);
    progress.set_style(indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} requests {per_sec} eta {eta}").expect("template"));
    let plan = StreamPlan {
        bundle: bundle.clone(),
        split: match &planner {
            Some(auto) => Splits::Moving(auto.lock().expect("auto split").cut()),
            None => Splits::Fixed(split),
        },
        device: config.device,
        requests: config.requests,
        in_flight: config.in_flight,
        inputs,
        max_payload_bytes: config.loopback_limits.max_payload_bytes,
        codec: config.codec,
        key: config.security.key.clone(),
    };
    let prober = planner.as_ref().map(|auto| tokio::spawn(auto_split::probe_while_on_edge(Arc::clone(auto), client.clone(), max_message as u64)));
    let started = Instant::now();
    let mut record_error = None;
    let streamed = stream_requests(&mut client, &info, plan, |outcome| {
        progress.inc(1);
        if let Some(auto) = &planner {
            auto.lock().expect("auto split").observe(outcome.request_id, &outcome.metrics);
        }
        if let Err(e) = writer.record(&bundle, outcome) {
            record_error.get_or_insert(e);
        }
    })
    .await;
    if let Some(prober) = prober {
        prober.abort();
    }
    streamed?;
    let wall_s = started.elapsed().as_secs_f64();
    progress.finish_and_clear();
    if let Some(e) = record_error {
        return Err(e);
    }
    if let Some(server) = loopback {
        server.shutdown().await?;
    }
    let outcomes = writer.finish()?;
    let ok: Vec<&client::RequestMetrics> = outcomes.iter().filter(|(_, _, ok)| *ok).map(|(_, m, _)| m).collect();
    let pick = |f: fn(&client::RequestMetrics) -> f64| Percentiles::of(&ok.iter().map(|m| f(m)).collect::<Vec<_>>());
    let summary = Summary {
        bundle: config.bundle.display().to_string(),
        bundle_id: bundle.id().to_string(),
        server: url,
        edge_device: device_name(config.device.resolve()?),
        server_device: info.device.clone(),
        split,
        split_name: bundle.cut(split).name.clone(),
        batch_size: config.batch_size,
        requests: outcomes.len() as u64,
        errors: outcomes.iter().filter(|(_, _, ok)| !ok).count() as u64,
        e2e_ms: pick(|m| m.e2e_ms),
        prefix_ms: pick(|m| m.prefix_ms),
        encode_ms: pick(|m| m.encode_ms),
        round_trip_ms: pick(|m| m.round_trip_ms),
        server_ms: pick(|m| m.server.total_ms()),
        network_ms: pick(report::network_ms),
        decode_ms: pick(|m| m.decode_ms),
        throughput_rps: if wall_s > 0.0 { ok.len() as f64 / wall_s } else { 0.0 },
        bytes_raw: outcomes.iter().map(|(_, m, _)| m.bytes_raw).sum(),
        bytes_wire: outcomes.iter().map(|(_, m, _)| m.bytes_wire).sum(),
        codec: config.codec.to_string(),
        encryption: config.security.key.as_ref().map(|(id, _)| format!("aes-256-gcm (key id {id})")),
        tls: uses_tls,
        bearer_token: config.security.token.is_some(),
        wall_s,
        planned,
        split_moves: planner.map(|auto| auto.lock().expect("auto split").moves().to_vec()).unwrap_or_default(),
    };
    std::fs::write(output.join("summary.json"), serde_json::to_string_pretty(&summary)? + "\n")?;
    report::plot_run(&bundle.manifest().model.source, &outcomes, &output)?;
    println!("{}", summary_table(&summary));
    println!("results in {}", output.display());
    Ok(summary)
}
