//! `host --config edge.yaml [--loopback]`: an inference run. Each request's prefix runs on
//! the edge, its boundary streams to the server, and the answers are written as they come
//! (`predictions.jsonl`, `metrics.csv`), then `summary.json`, the summary table and the
//! plots. With `split: auto` the planner picks the cut and moves it while the run goes on.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use cleave_client::{connect_first, ServerSession};
use cleave_common::bundle::SplitSpec;
use cleave_common::device::device_name;
use cleave_common::{Bundle, LoadedStages};
use tokio::sync::watch;

use crate::client::{dns, stream_balanced, stream_requests, ChoosesCodec, Codecs, Splits, StreamPlan};
use crate::config::EdgeConfig;
use crate::cpu_time;
use crate::error::{HostError, Result};
use crate::files::open_config_bundle;
use crate::inputs::Inputs;
use crate::loopback::LoopbackServer;
use crate::planner::Profiles;
use crate::planning::auto_split::{AutoSplit, AutoSplitTask};
use crate::planning::codec_choice::{self, CodecChooser};
use crate::planning::profile::measure_profiles;
use crate::progress::{Bar, Event, InferenceStart, Progress};
use crate::records::Planned;
use crate::report::{self, CpuMeter, ReportWriter, Summary};
use crate::run_options::RunOptions;

/// `host --config edge.yaml`: the whole run. Returns the summary (also written to
/// `summary.json` in the output directory, beside the other files).
pub async fn run(config: EdgeConfig, opts: RunOptions) -> Result<Summary> {
    let (run_started, run_cpu) = (Instant::now(), cpu_time::process());
    let bundle = open_config_bundle(&config).await?;
    let output = opts.output.clone().unwrap_or_else(|| config.output.clone());
    let inputs = read_inputs(&config, &bundle).await?;
    if let Some(note) = inputs.reuse_note(config.requests) {
        opts.progress.tell(Event::InputsReused(note));
    }
    let sample_files = inputs.sample_files();
    let mut writer = open_output(&config, &output, &opts)?;
    let mut connected = connect(&config, &opts, &bundle).await?;
    let done = writer.done();
    let ids: Vec<u64> = (0..config.requests).filter(|id| !done.contains(id)).collect();
    opts.progress.tell(Event::BarStarts { bar: Bar::Requests, total: ids.len() as u64 });
    let plan = connected.stream_plan(&config, &bundle, ids, inputs);
    let mut planner = connected.auto.as_mut().and_then(|a| a.planner.take()).map(|p| AutoSplitTask::spawn(p, connected.session.clone()));
    let started = Instant::now();
    let startup = (run_started.elapsed(), cpu_time::process() - run_cpu);
    let mut cpu = CpuMeter::new();
    let mut record_error = None;
    let chooser = connected.chooser.clone();
    let servers = connected.servers.take();
    let streamed = stream_to_servers(&mut connected.session, servers, plan, |outcome| {
        opts.progress.tell(Event::Advanced { loss: None });
        cpu.answered(&outcome.metrics);
        if let Some(planner) = &mut planner {
            planner.observe(outcome.request_id, &outcome.metrics);
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
    if let (Some(planner), Some(auto)) = (planner, &mut connected.auto) {
        auto.planner = Some(planner.finish().await.map_err(|error| HostError::Task { what: "split: auto", error })?);
    }
    opts.progress.tell(Event::BarEnds);
    let counts = streamed?;
    let wall_s = started.elapsed().as_secs_f64();
    if let Some(e) = record_error {
        return Err(e);
    }
    if let Some(server) = connected.loopback.take() {
        server.shutdown().await?;
    }
    let (resumed, failures) = (writer.resumed, writer.failures());
    let outcomes = writer.finish()?;
    let summary = Summary {
        counts,
        resumed,
        wall_s,
        failures,
        edge_cpu: cpu.finish(startup.0, startup.1),
        ..connected.summary(&config, &bundle, Summary::of_outcomes(&outcomes, wall_s))?
    };
    write_summary(&summary, &output)?;
    report::plot_run(&bundle.manifest().model.source, &outcomes, &output)?;
    Ok(summary)
}

/// The run's output directory: an earlier run there is refused, replaced or resumed (said)
/// before anything is sent.
fn open_output(config: &EdgeConfig, output: &Path, opts: &RunOptions) -> Result<ReportWriter> {
    let writer = ReportWriter::open(output, config.top_k, opts.output_mode)?;
    if writer.resumed > 0 {
        opts.progress.tell(Event::Resuming { output: output.to_path_buf(), resumed: writer.resumed, requests: config.requests });
    }
    Ok(writer)
}

fn write_summary(summary: &Summary, output: &Path) -> Result<()> {
    let json = serde_json::to_string_pretty(summary).map_err(|error| HostError::Json { what: "the summary as JSON", error })?;
    std::fs::write(output.join("summary.json"), json + "\n").map_err(|e| HostError::write(output.join("summary.json"), e))
}

/// A run connected to its server (started here with `--loopback`), at the cut it starts
/// from, with what chooses its cut and codec as it goes.
struct Connected {
    url: String,
    /// The servers requests go to, as the list changes; none for one server (the loopback
    /// server with `--loopback`).
    servers: Option<watch::Receiver<Vec<String>>>,
    loopback: Option<LoopbackServer>,
    session: ServerSession,
    split: usize,
    auto: Option<AutoStart>,
    chooser: Option<Arc<CodecChooser>>,
}

/// Connects, plans the cut (`split: auto`) and the codec (`codec: auto`), and says where the
/// stages run.
async fn connect(config: &EdgeConfig, opts: &RunOptions, bundle: &Bundle) -> Result<Connected> {
    let split_spec = opts.split.clone().unwrap_or_else(|| config.split.clone());
    let fixed = if split_spec == SplitSpec::Auto { None } else { Some(bundle.resolve_split(&split_spec)?) };
    let loopback = if opts.loopback { Some(crate::loopback::for_inference(config).await?) } else { None };
    let (first, servers) = match (&loopback, config.resolve_every) {
        (Some(l), _) => (vec![l.url.clone()], None),
        (None, Some(every)) => {
            let now = dns::servers_now(config).await;
            (now.clone(), Some(dns::follow(config.servers.clone(), now, every)))
        }
        (None, None) if config.servers.len() > 1 => (config.servers.clone(), Some(watch::channel(config.servers.clone()).1)),
        (None, None) => (config.servers.clone(), None),
    };
    let mut session = connect_first(&first, bundle, &config.link(), &config.resilience.retry).await?;
    let url = session.url.clone();
    let auto = match fixed {
        None => Some(start_auto_split(config, &mut session, bundle, &opts.progress).await?),
        Some(_) => None,
    };
    let split = auto.as_ref().map_or_else(|| fixed.unwrap_or_default(), |a| a.planned.cut);
    // `codec: auto`: each request's codec from the rate `split: auto` estimates (probed here
    // when the split is fixed) and each codec's measured cost.
    let chooser = match config.codec_auto {
        true => Some(Arc::new(codec_choice::for_session(&session, auto.as_ref().map(|a| &a.profiles)).await?)),
        false => None,
    };
    opts.progress.tell(Event::InferenceStarts(inference_start(config, bundle, split, &url, &session.model.device)?));
    Ok(Connected { url, servers, loopback, session, split, auto, chooser })
}

/// Streams over the servers `servers` lists, or the one `session` is connected to.
async fn stream_to_servers(
    session: &mut ServerSession,
    servers: Option<watch::Receiver<Vec<String>>>,
    plan: StreamPlan,
    on_outcome: impl FnMut(crate::client::RequestOutcome),
) -> Result<crate::client::StreamCounts> {
    match servers {
        Some(servers) => stream_balanced(session, servers, plan, on_outcome).await,
        None => stream_requests(session, plan, on_outcome).await,
    }
}

impl Connected {
    /// What the run streams: requests `ids` from `inputs`, at the planner's moving cut or
    /// the fixed one, with the chosen codec or the configured one.
    fn stream_plan(&mut self, config: &EdgeConfig, bundle: &Bundle, ids: Vec<u64>, inputs: Inputs) -> StreamPlan {
        StreamPlan {
            bundle: bundle.clone(),
            split: match &self.auto {
                Some(auto) => Splits::Moving(auto.cut.clone()),
                None => Splits::Fixed(self.split),
            },
            device: config.device,
            warm_stages: self.auto.as_mut().and_then(|a| a.warm_stages.take()),
            ids,
            resilience: config.resilience,
            in_flight: config.in_flight,
            inputs,
            codec: match &self.chooser {
                Some(chooser) => Codecs::Chosen(Arc::clone(chooser) as Arc<dyn ChoosesCodec>),
                None => Codecs::Fixed(config.codec),
            },
            key: config.security.key.clone(),
        }
    }

    /// The run's summary from its outcomes' figures: where it ran, and how its cut and codec
    /// were chosen.
    fn summary(self, config: &EdgeConfig, bundle: &Bundle, figures: Summary) -> Result<Summary> {
        let planner = self.auto.as_ref().and_then(|a| a.planner.as_ref());
        Ok(Summary {
            bundle: config.bundle.display().to_string(),
            bundle_id: bundle.id().to_string(),
            edge_device: device_name(config.device.resolve()?),
            server_device: self.session.model.device.clone(),
            split: self.split,
            split_name: bundle.cut(self.split).name.clone(),
            batch_size: config.batch_size,
            codec: if config.codec_auto { "auto".to_string() } else { config.codec.to_string() },
            codec_choice: self.chooser.map(|c| c.report()),
            encryption: config.security.key.as_ref().map(|(id, _)| format!("aes-256-gcm (key id {id})")),
            tls: self.url.starts_with("https://"),
            bearer_token: config.security.token.is_some(),
            planned: self.auto.as_ref().map(|a| a.planned.clone()),
            split_moves: planner.as_ref().map(|p| p.moves().to_vec()).unwrap_or_default(),
            probes: planner.as_ref().map(|p| p.probes()),
            server: self.url,
            ..figures
        })
    }
}

/// The run's inputs, read (and images decoded and resized) on the blocking pool.
async fn read_inputs(config: &EdgeConfig, bundle: &Bundle) -> Result<Inputs> {
    let Some(input) = config.input() else {
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
    /// The planner: here before and after the run, its task's while the run goes.
    planner: Option<AutoSplit>,
    /// The cut it publishes.
    cut: watch::Receiver<usize>,
    /// Handed to the stream (taken once).
    warm_stages: Option<LoadedStages>,
    profiles: Profiles,
}

async fn start_auto_split(config: &EdgeConfig, session: &mut ServerSession, bundle: &Bundle, progress: &Progress) -> Result<AutoStart> {
    // With `codec: auto` too, every candidate is measured at every cut: the plan chooses the
    // cut and the codec together, and the chooser starts from the same costs.
    let codec_candidates = if config.codec_auto { codec_choice::candidates(session)? } else { Vec::new() };
    let measured = measure_profiles(config, session, bundle, 3, &codec_candidates).await?;
    let profiles = measured.profiles.clone();
    let (auto_split, planned) = AutoSplit::plan(measured.profiles, measured.took, config.objective)?;
    progress.tell(Event::AutoSplitPlanned(Box::new(planned.clone())));
    let cut = auto_split.cut();
    Ok(AutoStart { planned, planner: Some(auto_split), cut, warm_stages: Some(measured.edge_stages), profiles })
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
