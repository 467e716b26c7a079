//! `host load`: a load generator. N edges in one process, each with its own connection and
//! `Infer` stream, send requests to the servers named in one or more edge configs (a task mix
//! of models, shared out by `--ratio`), closed loop or open loop (Poisson arrivals), for a
//! fixed duration; then a table per model, `load.json`, `latency.csv` and `latency.svg`.
//!
//! It measures the server, not the edge: each model's prefix runs once per cut at start (on
//! synthetic inputs, on the config's device), and every request re-encodes that boundary with
//! its edge's own payload sender (plain or sealed, the config's codec) under a fresh request
//! id, on the blocking pool. Results are reassembled and decoded, as a host does, so a
//! result that does not decode is an error.
//!
//! Latency runs from a request's scheduled time in an open loop (a request the generator
//! sends late still counts its wait: no coordinated omission) and from its send in a closed
//! one, to its whole answer. An open-loop edge holds at most `in_flight_cap` requests; one
//! due beyond that is dropped and counted (`dropped_in_flight_cap`). Requests unanswered
//! `grace` after the end count as `unanswered`. Each edge reaches its server through its own
//! link ([`cleave_client::server_link`]), as a host does: a request sent on a stream that breaks,
//! or due while the link reconnects, counts as `stream_lost` (it is not sent again: a load run
//! reports what the server did), and once the link gives up (`retry.max_attempts` failed
//! attempts in a row) the edge stops and what would have followed counts so too.
//!
//! - [`arrivals`]: when each edge sends (closed loop, seeded Poisson arrivals).
//! - [`mix`]: which model and cut each edge streams (`--ratio`, `--splits`).
//! - [`report`]: records, statistics, `load.json`, `latency.csv`, the table and the last line.

pub mod arrivals;
pub mod mix;
pub mod report;

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use cleave_client::server_link::{Delivered, Dispatch, LinkSetup, ServerLink};
use cleave_client::{connect, AnswerError, InferAnswer, InferSetup};
use cleave_common::bundle::SplitSpec;
use cleave_common::pb::InferFrame;
use cleave_common::protocol::ServedModel;
use cleave_common::telemetry::traceparent;
use cleave_common::value::synthetic_inputs;
use cleave_common::wire::{payload_frames, Codec, Direction, EncodedPayload, PayloadMeta, PayloadSender, WireError};
use cleave_common::{Boundary, Bundle, LoadedStages, StageRange};
use futures_util::stream::FuturesUnordered;
use tokio::task::{JoinError, JoinHandle};
use tokio_stream::StreamExt;
use tower::Service;

pub use self::arrivals::LoadMode;
pub use self::mix::Ratio;

use self::arrivals::Arrivals;
use self::mix::{apportion, assign_edges, EdgeSlot};
use self::report::{write_json, write_latency_csv, LoadReport, LoadStats, ModelReport, RequestRecord, SplitReport, LOAD_FILES};
use crate::config::EdgeConfig;
use crate::error::{HostError, LoadSetupError, Result};
use crate::files::{claim_output, open_config_bundle, EarlierRun, OutputMode};
use crate::plots::load::{plot_latency_over_time, TimedLatencies, LATENCY_OVER_TIME};
use crate::progress::{Event, LoadStart, LoadedModel, Progress};

/// Requests an open-loop edge may have unanswered at once, by default.
pub const DEFAULT_IN_FLIGHT_CAP: usize = 64;

/// How long requests still unanswered at the end are waited for, by default.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(5);

/// What `host load` is asked to do (the configs come separately).
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Edges in all, each with its own connection and stream.
    pub edges: usize,
    /// Closed or open loop.
    pub mode: LoadMode,
    /// How long requests are sent.
    pub duration: Duration,
    /// The share of the edges each config gets (none: equal shares).
    pub ratio: Option<Ratio>,
    /// Cuts each model's edges split at, round-robin (empty: the config's `split`).
    pub splits: Vec<usize>,
    /// Where `load.json`, `latency.csv` and `latency.svg` go.
    pub output: PathBuf,
    /// Seeds the open loop's arrivals.
    pub seed: u64,
    /// Replace an earlier load run's files in `output`.
    pub force: bool,
    /// Requests an open-loop edge may have unanswered at once.
    pub in_flight_cap: usize,
    /// How long requests still unanswered at the end are waited for.
    pub grace: Duration,
    /// Where the run's events go (what it sends, to which servers).
    pub progress: Progress,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            edges: 1,
            mode: LoadMode::Closed,
            duration: Duration::from_secs(10),
            ratio: None,
            splits: Vec::new(),
            output: PathBuf::from("results/load"),
            seed: 0,
            force: false,
            in_flight_cap: DEFAULT_IN_FLIGHT_CAP,
            grace: DEFAULT_GRACE,
            progress: Progress::default(),
        }
    }
}

/// One config of the run, its bundle open.
struct Model {
    config: EdgeConfig,
    bundle: Bundle,
    /// The cuts its edges split at.
    cuts: Vec<usize>,
}

/// Runs the load and writes its files; returns the report (the binary prints its table and,
/// last, the line benches parse: [`LoadReport::summary_line`]). Errors in the requests are
/// results, not errors of the run.
pub async fn run(configs: Vec<EdgeConfig>, opts: LoadOptions) -> Result<LoadReport> {
    check_options(&configs, &opts)?;
    let mode = if opts.force { OutputMode::Force } else { OutputMode::Fresh };
    claim_output(&opts.output, &EarlierRun { kind: "load run", files: &LOAD_FILES, continue_with: None }, mode)?;
    let mut models = Vec::with_capacity(configs.len());
    for config in configs {
        let bundle = open_config_bundle(&config).await?;
        let cuts = cuts_of(&config, &bundle, &opts.splits)?;
        models.push(Model { config, bundle, cuts });
    }
    let weights = opts.ratio.as_ref().map_or_else(|| vec![1; models.len()], |r| r.0.clone());
    let counts = apportion(&weights, opts.edges);
    if let Some(m) = counts.iter().position(|&c| c == 0) {
        let shared = opts.ratio.as_ref().map_or("equally".to_string(), |r| format!("by --ratio {r}"));
        return Err(LoadSetupError::ConfigWithoutEdge { edges: opts.edges, shared, config: m + 1, bundle: models[m].config.bundle.clone() }.into());
    }
    let slots = assign_edges(&counts, &models.iter().map(|m| m.cuts.clone()).collect::<Vec<_>>());
    let (edges, served) = open_edges(&models, &slots, &opts).await?;
    opts.progress.tell(Event::LoadStarts(load_start(&models, &counts, &served, &opts)));

    let clock = Clock { start: Instant::now(), duration: opts.duration, grace: opts.grace };
    let tasks: Vec<JoinHandle<Vec<RequestRecord>>> = edges.into_iter().map(|edge| tokio::spawn(edge.run(clock))).collect();
    let mut records = Vec::new();
    for task in tasks {
        records.extend(task.await.map_err(|error| HostError::Task { what: "an edge's task failed", error })?);
    }
    // Requests were due over the whole duration: a last answer that came early does not
    // shorten the denominator of the throughputs.
    let wall_s = clock.start.elapsed().max(opts.duration).as_secs_f64();
    records.sort_by(|a, b| a.t_s.total_cmp(&b.t_s).then(a.edge.cmp(&b.edge)));

    let fleet = Fleet { models: &models, served: &served, counts: &counts, slots: &slots };
    let report = LoadReport {
        mode: opts.mode.name(),
        rate: opts.mode.rate(),
        duration_s: opts.duration.as_secs_f64(),
        wall_s,
        edges: slots.len(),
        seed: opts.seed,
        in_flight_cap: opts.in_flight_cap,
        overall: LoadStats::of(&records, wall_s, |m| fleet.slo_ms(m)),
        models: (0..models.len()).map(|i| fleet.model_report(i, &records, wall_s)).collect(),
    };
    write_files(&report, &records, &opts)?;
    Ok(report)
}

/// Opens every edge (each model's prefix run once per cut, on the blocking pool); returns
/// them and, per model, what its server said of it.
async fn open_edges(models: &[Model], slots: &[EdgeSlot], opts: &LoadOptions) -> Result<(Vec<Edge>, Vec<Option<ServedModel>>)> {
    let mut prefixes = Vec::with_capacity(models.len());
    for model in models {
        prefixes.push(edge_prefixes(model).await?);
    }
    let mut served: Vec<Option<ServedModel>> = vec![None; models.len()];
    let mut edges = Vec::with_capacity(slots.len());
    for slot in slots {
        let model = &models[slot.model];
        let boundary = prefixes[slot.model].iter().find(|(cut, _)| *cut == slot.split).map(|(_, b)| b.shallow_clone()).expect("a prefix per cut");
        let (edge, info) =
            Edge::open(*slot, model, boundary, opts).await.map_err(|e| e.during(format!("edge {} ({})", slot.edge, model.config.server)))?;
        served[slot.model].get_or_insert(info);
        edges.push(edge);
    }
    Ok((edges, served))
}

/// The models of a load run, what their servers said of them, and how their edges were
/// shared out.
struct Fleet<'a> {
    models: &'a [Model],
    served: &'a [Option<ServedModel>],
    counts: &'a [usize],
    slots: &'a [EdgeSlot],
}

impl Fleet<'_> {
    /// Model `m`'s latency target on its server, if it has one.
    fn slo_ms(&self, m: usize) -> Option<u32> {
        self.served.get(m).and_then(|s| s.as_ref()).and_then(|s| s.slo_ms)
    }

    /// Model `i`'s figures from `records`, per cut too where its edges split at several.
    fn model_report(&self, i: usize, records: &[RequestRecord], wall_s: f64) -> ModelReport {
        let (model, info) = (&self.models[i], self.served[i].as_ref().expect("every model has an edge"));
        let slo_of = |m: usize| self.slo_ms(m);
        let of_model = || records.iter().filter(move |r| r.model == i);
        let mut cuts = model.cuts.clone();
        cuts.sort_unstable();
        cuts.dedup();
        let split_report = |cut: usize| SplitReport {
            split: cut,
            edges: self.slots.iter().filter(|s| s.model == i && s.split == cut).count(),
            stats: LoadStats::of(of_model().filter(|r| r.split == cut), wall_s, slo_of),
        };
        let by_split = if cuts.len() > 1 { cuts.iter().map(|&cut| split_report(cut)).collect() } else { Vec::new() };
        ModelReport {
            name: model_name(&info.model_source, &info.bundle_id),
            bundle_id: info.bundle_id.clone(),
            model_source: info.model_source.clone(),
            server: model.config.server.clone(),
            edges: self.counts[i],
            splits: cuts,
            batch_size: model.config.batch_size,
            codec: model.config.codec.to_string(),
            stats: LoadStats::of(of_model(), wall_s, slo_of),
            by_split,
        }
    }
}

/// `latency.csv`, the latency-over-time plot (when anything was answered), and last
/// `load.json`: its presence means the run finished and its other files are whole.
fn write_files(report: &LoadReport, records: &[RequestRecord], opts: &LoadOptions) -> Result<()> {
    write_latency_csv(&opts.output.join("latency.csv"), records, &report.models)?;
    let series: Vec<(String, TimedLatencies)> = report
        .models
        .iter()
        .enumerate()
        .map(|(i, m)| (m.name.clone(), records.iter().filter(|r| r.model == i && r.ok()).filter_map(|r| Some((r.t_s, r.latency_ms?))).collect()))
        .collect();
    if report.overall.answered > 0 {
        plot_latency_over_time(&opts.output.join(LATENCY_OVER_TIME), "latency over time (p50, p99 per second)", &series)?;
    } else {
        opts.progress.tell(Event::NothingAnswered { plot: LATENCY_OVER_TIME });
    }
    write_json(&opts.output.join("load.json"), report)
}

/// Refuses options and configs a load run cannot work with, before anything is opened.
fn check_options(configs: &[EdgeConfig], opts: &LoadOptions) -> Result<()> {
    if configs.is_empty() {
        return Err(LoadSetupError::NoConfig.into());
    }
    if let Some(c) = configs.iter().find(|c| c.train().is_some()) {
        return Err(LoadSetupError::TrainingConfig { bundle: c.bundle.clone() }.into());
    }
    let zero = |option, must_be| Err(LoadSetupError::Zero { option, must_be }.into());
    if opts.edges == 0 {
        return zero("--edges", "at least 1");
    }
    if opts.duration.is_zero() {
        return zero("--duration", "positive");
    }
    if opts.in_flight_cap == 0 {
        return zero("the in-flight cap", "at least 1");
    }
    if let LoadMode::Open { rate } = opts.mode {
        arrivals::PoissonArrivals::new(rate, 0).map_err(LoadSetupError::Rate)?;
    }
    if let Some(ratio) = &opts.ratio {
        if ratio.0.len() != configs.len() {
            return Err(LoadSetupError::RatioWeights { ratio: ratio.to_string(), weights: ratio.0.len(), configs: configs.len() }.into());
        }
    }
    Ok(())
}

/// The cuts a model's edges split at: `--splits`, or the config's fixed `split`. Each must
/// leave the server a stage to run.
fn cuts_of(config: &EdgeConfig, bundle: &Bundle, splits: &[usize]) -> Result<Vec<usize>> {
    let source = &bundle.manifest().model.source;
    let cuts = if splits.is_empty() {
        if config.split == SplitSpec::Auto {
            return Err(LoadSetupError::AutoSplit { model: source.clone() }.into());
        }
        vec![bundle.resolve_split(&config.split)?]
    } else {
        splits.to_vec()
    };
    let n = bundle.stage_count();
    if let Some(cut) = cuts.iter().find(|&&cut| cut >= n) {
        return Err(LoadSetupError::CutPastTheEnd { model: source.clone(), stages: n, cut: *cut }.into());
    }
    Ok(cuts)
}

/// How tables and `latency.csv` name a model: its source and the start of its bundle id.
fn model_name(source: &str, bundle_id: &str) -> String {
    format!("{source} ({})", cleave_common::bundle::short_id(bundle_id))
}

/// The boundary at each of a model's cuts, computed once on the config's device from
/// synthetic inputs of the config's batch size, and kept on the CPU.
async fn edge_prefixes(model: &Model) -> Result<Vec<(usize, Boundary)>> {
    let (bundle, cuts, device, batch) = (model.bundle.clone(), model.cuts.clone(), model.config.device, model.config.batch_size);
    tokio::task::spawn_blocking(move || -> Result<Vec<(usize, Boundary)>> {
        let deepest = cuts.iter().copied().max().unwrap_or(0);
        let stages = LoadedStages::load(&bundle, StageRange::prefix(deepest), device)?;
        let inputs = synthetic_inputs(&bundle.manifest().inputs, bundle.sizes_at(batch))?;
        let mut out = Vec::with_capacity(cuts.len());
        for cut in cuts {
            if out.iter().all(|(c, _)| *c != cut) {
                out.push((cut, stages.run(StageRange::prefix(cut), &inputs)?.to_device(tch::Device::Cpu)));
            }
        }
        Ok(out)
    })
    .await
    .map_err(|error| HostError::Task { what: "running the prefixes", error })?
}

fn load_start(models: &[Model], counts: &[usize], served: &[Option<ServedModel>], opts: &LoadOptions) -> LoadStart {
    let mode = match opts.mode {
        LoadMode::Closed => "closed loop".to_string(),
        LoadMode::Open { rate } => {
            format!("open loop at {rate} req/s (Poisson, seed {}, at most {} in flight per edge)", opts.seed, opts.in_flight_cap)
        }
    };
    let models = models
        .iter()
        .zip(counts)
        .zip(served)
        .map(|((model, &edges), info)| {
            let info = info.as_ref().expect("every model has an edge");
            LoadedModel {
                name: model_name(&info.model_source, &info.bundle_id),
                edges,
                cuts: model.cuts.clone(),
                batch_size: model.config.batch_size,
                codec: model.config.codec.to_string(),
                server: model.config.server.clone(),
                server_device: info.device.clone(),
                slo_ms: info.slo_ms,
            }
        })
        .collect();
    LoadStart { edges: opts.edges, mode, duration: opts.duration, models }
}

/// The run's clock: when it started, how long requests are sent, how long answers are
/// waited for after that.
#[derive(Debug, Clone, Copy)]
struct Clock {
    start: Instant,
    duration: Duration,
    grace: Duration,
}

/// What encodes an edge's requests: its payload sender (one per stream, so sealed nonces
/// only grow) and its copy of the boundary. Handed to the blocking pool and back for each
/// request, so one request is encoded at a time, in order.
struct Encoder {
    sender: PayloadSender,
    boundary: Boundary,
}

/// A request being encoded on the blocking pool.
type Encoding = JoinHandle<(Encoder, Result<EncodedPayload, WireError>)>;

/// A request due and not yet sent: its id and its scheduled time since the start.
#[derive(Debug, Clone, Copy)]
struct Due {
    id: u64,
    at: Duration,
}

/// Where a sent request's latency starts: since the run's start, and as an instant; and its
/// span, open until its answer (the server's spans of it join its trace).
#[derive(Debug)]
struct Origin {
    since_start: Duration,
    at: Instant,
    span: tracing::Span,
}

/// Generator-side error codes (see [`RequestRecord::error`]).
const DROPPED: &str = "dropped_in_flight_cap";
const UNDECODABLE: &str = "undecodable";
const STREAM_LOST: &str = "stream_lost";
const UNANSWERED: &str = "unanswered";
const ENCODE_FAILED: &str = "encode_failed";

/// What became of a request handed to an edge's link.
type Delivery = Pin<Box<dyn Future<Output = (u64, std::result::Result<Delivered, tower::BoxError>)> + Send>>;

/// One edge: its link to the server, its encoder and its schedule.
struct Edge {
    slot: EdgeSlot,
    /// Its link, until the edge runs (the run then holds it, and drops it once it gave up or
    /// the encoder panicked: the edge sends no more).
    link: Option<ServerLink>,
    /// None while a request is being encoded (or after the encoder panicked).
    encoder: Option<Encoder>,
    /// The model's bundle id, for its requests' spans.
    bundle_id: String,
    codec: Codec,
    chunk_bytes: usize,
    arrivals: Arrivals,
    closed: bool,
    cap: usize,
    records: Vec<RequestRecord>,
}

impl Edge {
    /// Connects (its own connection, `Info` checked), checks that the server accepts the
    /// config's codec and key, opens the edge's `Infer` stream and waits until its link takes
    /// requests (the model SERVING).
    async fn open(slot: EdgeSlot, model: &Model, boundary: Boundary, opts: &LoadOptions) -> Result<(Self, ServedModel)> {
        let config = &model.config;
        let session = connect(&config.server, &model.bundle, &config.link()).await?;
        // A session id of its own: the server's window of recent results is keyed by it, and
        // edges number their requests alike.
        let setup = InferSetup::new(vec![config.codec], config.security.key.clone(), config.resilience.connect_timeout);
        let sender = setup.sender()?;
        let stream = setup.open(&session).await?;
        let arrivals = Arrivals::for_edge(opts.mode, opts.edges, slot.edge, opts.seed).map_err(LoadSetupError::Rate)?;
        let cap = if opts.mode == LoadMode::Closed { 1 } else { opts.in_flight_cap };
        let (chunk_bytes, served) = (session.chunk_bytes(), session.model.clone());
        let link_setup = LinkSetup {
            bundle: model.bundle.clone(),
            link: config.link(),
            stream: setup,
            retry: config.resilience.retry,
            gives_up: true,
            health_changed: Arc::default(),
            request_timeout: config.resilience.request_timeout,
            in_flight: cap,
        };
        let (mut link, _) = ServerLink::on_stream(session, stream, Arc::new(link_setup));
        let waited = config.resilience.connect_timeout;
        match tokio::time::timeout(waited, std::future::poll_fn(|cx| link.poll_ready(cx))).await {
            Ok(Ok(())) => {}
            _ => return Err(LoadSetupError::NotServing { waited }.into()),
        }
        let edge = Self {
            slot,
            link: Some(link),
            encoder: Some(Encoder { sender, boundary }),
            bundle_id: model.bundle.id().to_string(),
            codec: config.codec,
            chunk_bytes,
            closed: opts.mode == LoadMode::Closed,
            arrivals,
            cap,
            records: Vec::new(),
        };
        Ok((edge, served))
    }

    /// Sends on schedule until the clock's end, waits for the answers up to its grace, and
    /// returns a record per request.
    async fn run(mut self, clock: Clock) -> Vec<RequestRecord> {
        let mut link = self.link.take();
        let before_end = |t: Duration| (t < clock.duration).then_some(t);
        let mut next_at = before_end(self.arrivals.first());
        let mut due: VecDeque<Due> = VecDeque::new();
        let mut encoding: Option<(Due, Encoding)> = None;
        let mut in_flight: HashMap<u64, Origin> = HashMap::new();
        let mut deliveries = FuturesUnordered::<Delivery>::new();
        let mut next_id = 0u64;
        let give_up_at = clock.start + clock.duration + clock.grace;
        loop {
            let now = Instant::now();
            // Every arrival due by now, late ones included (a timer fires late at high rates).
            while let Some(at) = next_at.filter(|at| clock.start + *at <= now) {
                next_at = self.arrivals.after_arrival(at).and_then(before_end);
                let d = Due { id: next_id, at };
                next_id += 1;
                if link.is_none() {
                    self.record(d.at, None, Some(STREAM_LOST));
                } else if in_flight.len() + due.len() + usize::from(encoding.is_some()) >= self.cap {
                    self.record(d.at, None, Some(DROPPED));
                } else {
                    due.push_back(d);
                }
            }
            // While the link reconnects, what is due waits (its latency counted from its time);
            // once it gave up, what is due is lost.
            let takes = self.link_takes_requests(&mut link);
            if link.is_none() {
                for d in due.drain(..).collect::<Vec<_>>() {
                    self.record(d.at, None, Some(STREAM_LOST));
                }
            }
            if encoding.is_none() && takes && self.encoder.is_some() {
                if let Some(d) = due.pop_front() {
                    let encoder = self.encoder.take().expect("checked");
                    encoding = Some((d, self.encode(encoder, d.id)));
                }
            }
            if next_at.is_none() && due.is_empty() && encoding.is_none() && in_flight.is_empty() {
                break;
            }
            if now >= give_up_at {
                let left = due.iter().map(|d| d.at).chain(encoding.iter().map(|(d, _)| d.at)).chain(in_flight.values().map(|o| o.since_start));
                for at in left.collect::<Vec<_>>() {
                    self.record(at, None, Some(UNANSWERED));
                }
                break;
            }
            let next_arrival = next_at.map(|at| clock.start + at);
            let waits_for_link = !takes && !due.is_empty() && encoding.is_none();
            tokio::select! {
                Some((id, delivered)) = deliveries.next() => {
                    let settled = Instant::now();
                    if self.delivered(id, delivered, settled, &mut in_flight) && self.closed {
                        next_at = self.arrivals.after_answer(settled - clock.start).and_then(before_end);
                    }
                }
                encoded = finished(&mut encoding) => {
                    let (d, _) = encoding.take().expect("a request was being encoded");
                    match self.encoded(d, encoded, clock, &mut link, &mut in_flight) {
                        Some(delivery) => deliveries.push(delivery),
                        // Its outcome came without it going out: a closed loop goes on.
                        None if self.closed => next_at = self.arrivals.after_answer(Instant::now() - clock.start).and_then(before_end),
                        None => {}
                    }
                }
                () = link_ready(&mut link), if waits_for_link => {}
                () = sleep_until(next_arrival) => {}
                () = tokio::time::sleep_until(give_up_at.into()) => {}
            }
        }
        self.records
    }

    /// Encodes request `id` on the blocking pool.
    fn encode(&self, mut encoder: Encoder, id: u64) -> Encoding {
        let (codec, split) = (self.codec, self.slot.split as u32);
        tokio::task::spawn_blocking(move || {
            let meta = PayloadMeta { request_id: id, split, direction: Direction::Request };
            let encoded = encoder.sender.encode(meta, &codec, &encoder.boundary);
            (encoder, encoded)
        })
    }

    /// A request's payload is ready: its frames go to the link, when it takes requests now.
    fn encoded(
        &mut self,
        d: Due,
        encoded: std::result::Result<(Encoder, Result<EncodedPayload, WireError>), JoinError>,
        clock: Clock,
        link: &mut Option<ServerLink>,
        in_flight: &mut HashMap<u64, Origin>,
    ) -> Option<Delivery> {
        let payload = match encoded {
            Ok((encoder, payload)) => {
                self.encoder = Some(encoder);
                payload
            }
            Err(e) => {
                // The encoder went with the task: this edge can send no more.
                tracing::warn!(edge = self.slot.edge, error = %e, "encoding panicked: this edge stops");
                *link = None;
                self.record(d.at, None, Some(ENCODE_FAILED));
                return None;
            }
        };
        let payload = match payload {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(edge = self.slot.edge, error = %e, "a request cannot be encoded");
                self.record(d.at, None, Some(ENCODE_FAILED));
                return None;
            }
        };
        if !self.link_takes_requests(link) {
            self.record(d.at, None, Some(STREAM_LOST));
            return None;
        }
        let frames: Vec<InferFrame> = payload_frames(d.id, payload.envelope, &payload.data, self.chunk_bytes);
        let (edge, cut) = (self.slot.edge, self.slot.split);
        let span = tracing::debug_span!("request", request_id = d.id, model = %self.bundle_id, cut, codec = %self.codec, edge, error = tracing::field::Empty);
        let sent = Instant::now();
        let dispatch = Dispatch { id: d.id, frames, traceparent: traceparent(&span) };
        let delivered = link.as_mut().expect("it takes requests").call(dispatch);
        let origin = match self.closed {
            true => Origin { since_start: sent - clock.start, at: sent, span },
            false => Origin { since_start: d.at, at: clock.start + d.at, span },
        };
        in_flight.insert(d.id, origin);
        let id = d.id;
        Some(Box::pin(async move { (id, delivered.await) }))
    }

    /// Whether the link takes a request now: not while it reconnects; never again once it gave
    /// up (it is then dropped, and the edge stops).
    fn link_takes_requests(&self, link: &mut Option<ServerLink>) -> bool {
        let Some(l) = link else { return false };
        match l.poll_ready(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(Ok(())) => true,
            Poll::Pending => false,
            Poll::Ready(Err(e)) => {
                tracing::warn!(edge = self.slot.edge, error = %e, "the link to the server gave up: this edge stops");
                *link = None;
                false
            }
        }
    }

    /// What became of a request given to the link: its answer, or it was lost with its
    /// stream. False for an id this edge is not waiting for.
    fn delivered(
        &mut self,
        id: u64,
        delivered: std::result::Result<Delivered, tower::BoxError>,
        at: Instant,
        in_flight: &mut HashMap<u64, Origin>,
    ) -> bool {
        if let Ok(Delivered::Answer { answer, .. }) = delivered {
            return self.answered(answer, at, in_flight);
        }
        let Some(origin) = in_flight.remove(&id) else { return false };
        origin.span.record("error", STREAM_LOST);
        self.record(origin.since_start, None, Some(STREAM_LOST));
        true
    }

    /// A whole answer, recorded against its request: false for an id this edge is not
    /// waiting for.
    fn answered(&mut self, answer: InferAnswer, at: Instant, in_flight: &mut HashMap<u64, Origin>) -> bool {
        let Some(origin) = in_flight.remove(&answer.id) else {
            tracing::warn!(edge = self.slot.edge, request_id = answer.id, "an answer for a request not waiting: ignored");
            return false;
        };
        let error = match &answer.output {
            Ok(_) => None,
            Err(AnswerError::Refused { code, .. }) => Some(format!("{code:?}")),
            Err(_) => Some(UNDECODABLE.to_string()),
        };
        if let Some(error) = &error {
            origin.span.record("error", error.as_str());
        }
        let latency_ms = (at - origin.at).as_secs_f64() * 1e3;
        self.records.push(RequestRecord {
            t_s: origin.since_start.as_secs_f64(),
            model: self.slot.model,
            edge: self.slot.edge,
            split: self.slot.split,
            latency_ms: Some(latency_ms),
            error,
        });
        true
    }

    fn record(&mut self, since_start: Duration, latency_ms: Option<f64>, error: Option<&str>) {
        self.records.push(RequestRecord {
            t_s: since_start.as_secs_f64(),
            model: self.slot.model,
            edge: self.slot.edge,
            split: self.slot.split,
            latency_ms,
            error: error.map(String::from),
        });
    }
}

/// Once the link takes requests again, or gave up (never resolves without a link).
async fn link_ready(link: &mut Option<ServerLink>) {
    match link {
        Some(l) => {
            let _ = std::future::poll_fn(|cx| l.poll_ready(cx)).await;
        }
        None => std::future::pending().await,
    }
}

/// The request being encoded, once it is (never resolves when none is).
async fn finished(encoding: &mut Option<(Due, Encoding)>) -> std::result::Result<(Encoder, Result<EncodedPayload, WireError>), JoinError> {
    match encoding {
        Some((_, task)) => task.await,
        None => std::future::pending().await,
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_names_take_the_start_of_the_bundle_id() {
        assert_eq!(model_name("torchvision:resnet18", "0123456789abcdef0123"), "torchvision:resnet18 (0123456789abcdef)");
        assert_eq!(model_name("m", "abc"), "m (abc)");
    }
}
