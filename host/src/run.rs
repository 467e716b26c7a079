//! `host --config edge.yaml [--loopback]`: an inference run. Each request's prefix runs on
//! the edge, its boundary streams to the server, and the answers are written as they come
//! (`predictions.jsonl`, `metrics.csv`), then `summary.json`, the summary table and the
//! plots. With `split: auto` the planner picks the cut and moves it while the run goes on.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cleave_common::bundle::SplitSpec;
use cleave_common::device::device_name;
use cleave_common::stats::Percentiles;

use crate::client::{stream_requests, ChoosesCodec, Codecs, RequestMetrics, Splits, StreamPlan};
use crate::config::EdgeConfig;
use crate::cpu_time;
use crate::error::{HostError, Result};
use crate::files::open_config_bundle;
use crate::inputs::Inputs;
use crate::planning::auto_split::{self, AutoSplit};
use crate::planning::codec_choice;
use crate::planning::profile::measure_profiles;
use crate::progress::{Event, InferenceStart, Progress};
use crate::report::{self, CpuMeter, OutputMode, ReportWriter, Summary};
use crate::session::{connect_retrying, Link};

/// Command-line overrides of `edge.yaml`.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Start the server in this process on 127.0.0.1 (an ephemeral port) and use it.
    pub loopback: bool,
    /// Overrides `split`.
    pub split: Option<SplitSpec>,
    /// Overrides `output`.
    pub output: Option<PathBuf>,
    /// What to do when `output` holds an earlier run.
    pub output_mode: OutputMode,
    /// Where the run's events go (the cut it starts at, a resumed run, each epoch).
    pub progress: Progress,
}

/// `host --config edge.yaml`: the whole run. Returns the summary (also written to
/// `summary.json` in the output directory, beside the other files).
pub async fn run(config: EdgeConfig, opts: RunOptions) -> Result<Summary> {
    let (run_started, run_cpu) = (Instant::now(), cpu_time::process());
    let bundle = open_config_bundle(&config).await?;
    let split_spec = opts.split.clone().unwrap_or_else(|| config.split.clone());
    let auto = split_spec == SplitSpec::Auto;
    let split = if auto { bundle.stage_count() } else { bundle.resolve_split(&split_spec)? };
    let output = opts.output.unwrap_or_else(|| config.output.clone());
    let Some(input) = &config.input else {
        return Err(HostError::NotThatKindOfConfig { key: "input", command: "inference" });
    };
    // Image inputs are decoded and resized: on the blocking pool.
    let inputs = {
        let (input, bundle, batch) = (input.clone(), bundle.clone(), config.batch_size);
        tokio::task::spawn_blocking(move || Inputs::new(&input, &bundle, batch))
            .await
            .map_err(|error| HostError::Task { what: "reading the inputs", error })??
    };
    if let Some(note) = inputs.reuse_note(config.requests) {
        opts.progress.tell(Event::InputsReused(note));
    }
    let sample_files = inputs.sample_files();
    // An earlier run in `output` is refused, replaced or resumed before anything is sent.
    let mut writer = ReportWriter::open(&output, config.top_k, opts.output_mode)?;
    let done = writer.done();
    if writer.resumed > 0 {
        opts.progress.tell(Event::Resuming { output: output.clone(), resumed: writer.resumed, requests: config.requests });
    }
    let loopback = if opts.loopback { Some(crate::loopback::for_inference(&config).await?) } else { None };
    let url = loopback.as_ref().map_or(config.server.clone(), |l| l.url.clone());
    let uses_tls = url.starts_with("https://");
    let mut session = connect_retrying(&url, &bundle, &Link::of(&config), &config.resilience.retry).await?;
    // `split: auto`: plan from measured profiles, then re-plan from the bandwidth measured on
    // every transfer; the prefix thread reads the split for each request.
    let mut planned = None;
    let mut planner = None;
    let mut warm_stages = None;
    let mut planned_profiles = None;
    if auto {
        // With `codec: auto` too, every candidate is measured at every cut: the plan chooses
        // the cut and the codec together, and the chooser starts from the same costs.
        let codec_candidates = if config.codec_auto { codec_choice::candidates(&session)? } else { Vec::new() };
        let measured = measure_profiles(&config, &mut session, &bundle, 3, &codec_candidates).await?;
        planned_profiles = Some(measured.profiles.clone());
        let (auto_split, plan) = AutoSplit::plan(measured.profiles, measured.took, config.objective)?;
        opts.progress.tell(Event::AutoSplitPlanned(Box::new(plan.clone())));
        planner = Some(Arc::new(Mutex::new(auto_split)));
        planned = Some(plan);
        warm_stages = Some(measured.edge_stages);
    }
    let split = planned.as_ref().map_or(split, |p| p.cut);
    // `codec: auto`: each request's codec from the rate `split: auto` estimates (probed here
    // when the split is fixed) and each codec's measured cost.
    let chooser = if config.codec_auto { Some(Arc::new(codec_choice::for_session(&session, planned_profiles.as_ref()).await?)) } else { None };
    opts.progress.tell(Event::InferenceStarts(InferenceStart {
        model: bundle.manifest().model.source.clone(),
        split,
        cut_name: bundle.cut(split).name.clone(),
        // The share of the FLOPs the edge runs: what `split: 40%` chose by.
        edge_flops_share: bundle.split_points().iter().find(|p| p.index == split).map(|p| p.edge_cost_share),
        edge_device: device_name(config.device.resolve()?),
        server: url.clone(),
        stages: bundle.stage_count(),
        server_device: session.model.device.clone(),
    }));
    let ids: Vec<u64> = (0..config.requests).filter(|id| !done.contains(id)).collect();
    let progress = indicatif::ProgressBar::new(ids.len() as u64);
    progress.set_style(indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} requests {per_sec} eta {eta}").expect("template"));
    let plan = StreamPlan {
        bundle: bundle.clone(),
        split: match &planner {
            Some(auto) => Splits::Moving(auto.lock().expect("auto split").cut()),
            None => Splits::Fixed(split),
        },
        device: config.device,
        warm_stages,
        ids,
        resilience: config.resilience,
        in_flight: config.in_flight,
        inputs,
        codec: match &chooser {
            Some(chooser) => Codecs::Chosen(Arc::clone(chooser) as Arc<dyn ChoosesCodec>),
            None => Codecs::Fixed(config.codec),
        },
        key: config.security.key.clone(),
    };
    let prober = planner.as_ref().map(|auto| tokio::spawn(auto_split::probe_while_on_edge(Arc::clone(auto), session.clone())));
    let started = Instant::now();
    let startup = (run_started.elapsed(), cpu_time::process() - run_cpu);
    let mut cpu = CpuMeter::new();
    let mut record_error = None;
    let streamed = stream_requests(&mut session, plan, |outcome| {
        progress.inc(1);
        cpu.answered(&outcome.metrics);
        if let Some(auto) = &planner {
            auto.lock().expect("auto split").observe(outcome.request_id, &outcome.metrics);
        }
        if let Some(chooser) = &chooser {
            chooser.observe(&outcome.metrics);
        }
        let files = sample_files.as_ref().map(|f| f.of(outcome.request_id));
        if let Err(e) = writer.record(&bundle, outcome, files) {
            record_error.get_or_insert(e);
        }
    })
    .await;
    if let Some(prober) = prober {
        prober.abort();
    }
    let counts = streamed?;
    let wall_s = started.elapsed().as_secs_f64();
    progress.finish_and_clear();
    if let Some(e) = record_error {
        return Err(e);
    }
    if let Some(server) = loopback {
        server.shutdown().await?;
    }
    let writer_resumed = writer.resumed;
    let failures = writer.failures();
    let outcomes = writer.finish()?;
    let ok: Vec<&RequestMetrics> = outcomes.iter().filter(|(_, _, ok)| *ok).map(|(_, m, _)| m).collect();
    // No request succeeded: no percentiles (`null` in summary.json).
    let pick = |f: fn(&RequestMetrics) -> f64| Percentiles::of(&ok.iter().map(|m| f(m)).collect::<Vec<_>>()).ok();
    let summary = Summary {
        bundle: config.bundle.display().to_string(),
        bundle_id: bundle.id().to_string(),
        server: url,
        edge_device: device_name(config.device.resolve()?),
        server_device: session.model.device.clone(),
        split,
        split_name: bundle.cut(split).name.clone(),
        batch_size: config.batch_size,
        requests: outcomes.len() as u64,
        errors: outcomes.iter().filter(|(_, _, ok)| !ok).count() as u64,
        counts,
        resumed: writer_resumed,
        e2e_ms: pick(|m| m.e2e_ms),
        prefix_ms: pick(|m| m.prefix_ms),
        prefix_cpu_ms: pick(|m| m.prefix_cpu_ms),
        encode_ms: pick(|m| m.encode_ms),
        round_trip_ms: pick(|m| m.round_trip_ms),
        server_ms: pick(|m| m.server.total_ms()),
        network_ms: pick(RequestMetrics::network_ms),
        decode_ms: pick(|m| m.decode_ms),
        throughput_rps: if wall_s > 0.0 { ok.len() as f64 / wall_s } else { 0.0 },
        bytes_raw: outcomes.iter().map(|(_, m, _)| m.bytes_raw).sum(),
        bytes_wire: outcomes.iter().map(|(_, m, _)| m.bytes_wire).sum(),
        copied_sent_bytes: outcomes.iter().map(|(_, m, _)| m.copied_sent_bytes).sum(),
        copied_received_bytes: outcomes.iter().map(|(_, m, _)| m.copied_received_bytes).sum(),
        codec: if config.codec_auto { "auto".to_string() } else { config.codec.to_string() },
        codecs: outcomes.iter().filter_map(|(_, m, _)| m.codec).fold(Default::default(), |mut counts, codec| {
            *counts.entry(codec.to_string()).or_default() += 1;
            counts
        }),
        codec_choice: chooser.map(|c| c.report()),
        encryption: config.security.key.as_ref().map(|(id, _)| format!("aes-256-gcm (key id {id})")),
        tls: uses_tls,
        bearer_token: config.security.token.is_some(),
        wall_s,
        planned,
        split_moves: planner.as_ref().map(|auto| auto.lock().expect("auto split").moves().to_vec()).unwrap_or_default(),
        failures,
        edge_cpu: cpu.finish(startup.0, startup.1),
        probes: planner.map(|auto| auto.lock().expect("auto split").probes()),
    };
    let json = serde_json::to_string_pretty(&summary).map_err(|error| HostError::Json { what: "the summary as JSON", error })?;
    std::fs::write(output.join("summary.json"), json + "\n").map_err(|e| HostError::write(output.join("summary.json"), e))?;
    report::plot_run(&bundle.manifest().model.source, &outcomes, &output)?;
    Ok(summary)
}
