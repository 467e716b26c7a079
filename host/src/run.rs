//! `host --config edge.yaml [--loopback]`: an inference run. Each request's prefix runs on
//! the edge, its boundary streams to the server, and the answers are written as they come
//! (`predictions.jsonl`, `metrics.csv`), then `summary.json`, the summary table and the
//! plots. With `split: auto` the planner picks the cut and moves it while the run goes on.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cleave_common::bundle::SplitSpec;
use cleave_common::device::device_name;
use cleave_common::{Bundle, LoadedStages};

use crate::client::{stream_requests, ChoosesCodec, Codecs, Splits, StreamPlan};
use crate::config::EdgeConfig;
use crate::cpu_time;
use crate::error::{HostError, Result};
use crate::files::open_config_bundle;
use crate::inputs::Inputs;
use crate::planning::auto_split::{self, AutoSplit, Planned};
use crate::planning::codec_choice;
use crate::planning::planner::Profiles;
use crate::planning::profile::measure_profiles;
use crate::progress::{Event, InferenceStart, Progress};
use crate::report::{self, CpuMeter, OutputMode, ReportWriter, Summary};
use crate::session::{connect_retrying, EdgeSession, Link};

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
    let output = opts.output.clone().unwrap_or_else(|| config.output.clone());
    let inputs = read_inputs(&config, &bundle).await?;
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
    let mut session = connect_retrying(&url, &bundle, &Link::of(&config), &config.resilience.retry).await?;
    let auto = if auto { Some(start_auto_split(&config, &mut session, &bundle, &opts.progress).await?) } else { None };
    let split = auto.as_ref().map_or(split, |a| a.planned.cut);
    // `codec: auto`: each request's codec from the rate `split: auto` estimates (probed here
    // when the split is fixed) and each codec's measured cost.
    let chooser = match config.codec_auto {
        true => Some(Arc::new(codec_choice::for_session(&session, auto.as_ref().map(|a| &a.profiles)).await?)),
        false => None,
    };
    opts.progress.tell(Event::InferenceStarts(inference_start(&config, &bundle, split, &url, &session.model.device)?));
    let (planned, planner, warm_stages) = match auto {
        Some(a) => (Some(a.planned), Some(a.planner), Some(a.warm_stages)),
        None => (None, None, None),
    };
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
    let resumed = writer.resumed;
    let failures = writer.failures();
    let outcomes = writer.finish()?;
    let summary = Summary {
        bundle: config.bundle.display().to_string(),
        bundle_id: bundle.id().to_string(),
        server: url.clone(),
        edge_device: device_name(config.device.resolve()?),
        server_device: session.model.device.clone(),
        split,
        split_name: bundle.cut(split).name.clone(),
        batch_size: config.batch_size,
        counts,
        resumed,
        wall_s,
        codec: if config.codec_auto { "auto".to_string() } else { config.codec.to_string() },
        codec_choice: chooser.map(|c| c.report()),
        encryption: config.security.key.as_ref().map(|(id, _)| format!("aes-256-gcm (key id {id})")),
        tls: url.starts_with("https://"),
        bearer_token: config.security.token.is_some(),
        planned,
        split_moves: planner.as_ref().map(|auto| auto.lock().expect("auto split").moves().to_vec()).unwrap_or_default(),
        failures,
        edge_cpu: cpu.finish(startup.0, startup.1),
        probes: planner.map(|auto| auto.lock().expect("auto split").probes()),
        ..Summary::of_outcomes(&outcomes, wall_s)
    };
    let json = serde_json::to_string_pretty(&summary).map_err(|error| HostError::Json { what: "the summary as JSON", error })?;
    std::fs::write(output.join("summary.json"), json + "\n").map_err(|e| HostError::write(output.join("summary.json"), e))?;
    report::plot_run(&bundle.manifest().model.source, &outcomes, &output)?;
    Ok(summary)
}

/// The run's inputs, read (and images decoded and resized) on the blocking pool.
async fn read_inputs(config: &EdgeConfig, bundle: &Bundle) -> Result<Inputs> {
    let Some(input) = &config.input else {
        return Err(HostError::NotThatKindOfConfig { key: "input", command: "inference" });
    };
    let (input, bundle, batch) = (input.clone(), bundle.clone(), config.batch_size);
    tokio::task::spawn_blocking(move || Inputs::new(&input, &bundle, batch))
        .await
        .map_err(|error| HostError::Task { what: "reading the inputs", error })?
}

/// Where `split: auto` starts: the plan from measured profiles, the planner that moves the
/// cut from the bandwidth measured on every transfer (the prefix thread reads the cut for
/// each request), and the edge's stages the profile loaded and warmed.
struct AutoStart {
    planned: Planned,
    planner: Arc<Mutex<AutoSplit>>,
    warm_stages: LoadedStages,
    profiles: Profiles,
}

async fn start_auto_split(config: &EdgeConfig, session: &mut EdgeSession, bundle: &Bundle, progress: &Progress) -> Result<AutoStart> {
    // With `codec: auto` too, every candidate is measured at every cut: the plan chooses the
    // cut and the codec together, and the chooser starts from the same costs.
    let codec_candidates = if config.codec_auto { codec_choice::candidates(session)? } else { Vec::new() };
    let measured = measure_profiles(config, session, bundle, 3, &codec_candidates).await?;
    let profiles = measured.profiles.clone();
    let (auto_split, planned) = AutoSplit::plan(measured.profiles, measured.took, config.objective)?;
    progress.tell(Event::AutoSplitPlanned(Box::new(planned.clone())));
    Ok(AutoStart { planned, planner: Arc::new(Mutex::new(auto_split)), warm_stages: measured.edge_stages, profiles })
}

fn inference_start(config: &EdgeConfig, bundle: &Bundle, split: usize, url: &str, server_device: &str) -> Result<InferenceStart> {
    Ok(InferenceStart {
        model: bundle.manifest().model.source.clone(),
        split,
        cut_name: bundle.cut(split).name.clone(),
        // The share of the FLOPs the edge runs: what `split: 40%` chose by.
        edge_flops_share: bundle.split_points().iter().find(|p| p.index == split).map(|p| p.edge_cost_share),
        edge_device: device_name(config.device.resolve()?),
        server: url.to_string(),
        stages: bundle.stage_count(),
        server_device: server_device.to_string(),
    })
}
