//! What a run leaves behind: `predictions.jsonl`, `metrics.csv`, `summary.json`, and the
//! table printed on stdout.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use cleave_common::stats::{median, Percentiles};
use cleave_common::{Bundle, Value};
use cleave_tables::human_bytes;
use serde::Serialize;

use crate::client::{RequestMetrics, RequestOutcome, ServedBy, ServerTimes, StreamCounts};
use crate::error::{HostError, MeasureError, OutputError, Result};
use crate::files::{claim_output, EarlierRun};
use crate::plots::run::{CutBreakdown, BREAKDOWN, LATENCY_CDF};
use crate::records::{CodecChoiceReport, Planned, Probes, SplitMove};

/// `summary.json`. Each part's percentiles are over the requests that succeeded (`null`
/// when none did).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Summary {
    /// Bundle directory.
    pub bundle: String,
    /// Bundle id.
    pub bundle_id: String,
    /// The server's URL.
    pub server: String,
    /// Where the prefix ran.
    pub edge_device: String,
    /// Where the suffix ran.
    pub server_device: String,
    /// The cut.
    pub split: usize,
    /// Its name.
    pub split_name: String,
    /// Samples per request.
    pub batch_size: i64,
    /// Requests sent.
    pub requests: u64,
    /// Requests answered with an error (or not at all).
    pub errors: u64,
    /// What became of the requests of this invocation: sent, answered, retried, failed,
    /// never sent, answered on the edge, reconnects, duplicate answers dropped.
    #[serde(flatten)]
    pub counts: StreamCounts,
    /// Outcomes kept from the run this one resumed (`--resume`).
    pub resumed: u64,
    /// End to end, per request.
    pub e2e_ms: Option<Percentiles>,
    /// Prefix, per request.
    pub prefix_ms: Option<Percentiles>,
    /// Encoding the boundary, per request.
    pub encode_ms: Option<Percentiles>,
    /// Round trip, per request.
    pub round_trip_ms: Option<Percentiles>,
    /// The server's own time (queue, decode, compute, encode), per request.
    pub server_ms: Option<Percentiles>,
    /// The network's share: the round trip less the server's time, per request.
    pub network_ms: Option<Percentiles>,
    /// Decoding the result, per request.
    pub decode_ms: Option<Percentiles>,
    /// Requests per second over the whole run.
    pub throughput_rps: f64,
    /// Tensor bytes sent.
    pub bytes_raw: u64,
    /// Bytes of the frames sent.
    pub bytes_wire: u64,
    /// Bytes of the boundaries copied as they were to send them (gRPC's copies not counted).
    pub copied_sent_bytes: u64,
    /// Bytes of the results copied as they were to receive them.
    pub copied_received_bytes: u64,
    /// Payload codec (`raw`, `shuffle+lz4`, ..., or `auto`).
    pub codec: String,
    /// Requests sent with each codec.
    pub codecs: BTreeMap<String, u64>,
    /// `codec: auto`: each codec's cost measured at each cut, and the rate estimated at the end.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub codec_choice: Option<CodecChoiceReport>,
    /// Payload encryption, when on (`aes-256-gcm (key id N)`); never the key.
    pub encryption: Option<String>,
    /// Whether the link used TLS.
    pub tls: bool,
    /// Whether calls carried a bearer token (never the token).
    pub bearer_token: bool,
    /// Seconds the run took.
    pub wall_s: f64,
    /// `split: auto`: what the planner chose at start-up.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub planned: Option<Planned>,
    /// `split: auto`: every move of the split while running.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub split_moves: Vec<SplitMove>,
    /// Each distinct error this invocation's requests failed with, most frequent first.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub failures: Vec<Failure>,
    /// Processor time of each request's prefix (below `prefix_ms` when it waited for the processor).
    pub prefix_cpu_ms: Option<Percentiles>,
    /// Where the edge's processor time went.
    pub edge_cpu: EdgeCpu,
    /// `split: auto`: the bandwidth probes sent while the split sat at the last cut.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub probes: Option<Probes>,
}

impl Summary {
    /// The figures a run's outcomes give (`(request id, metrics, answered)` each): counts,
    /// percentiles of the answered requests (none when nothing was answered: `null` in
    /// `summary.json`), bytes and codecs; `wall_s` for the throughput. The rest says how the
    /// run was set up and is left empty here.
    pub fn of_outcomes(outcomes: &[(u64, RequestMetrics, bool)], wall_s: f64) -> Self {
        let ok: Vec<&RequestMetrics> = outcomes.iter().filter(|(_, _, ok)| *ok).map(|(_, m, _)| m).collect();
        let pick = |f: fn(&RequestMetrics) -> f64| Percentiles::of(&ok.iter().map(|m| f(m)).collect::<Vec<_>>()).ok();
        let sum = |f: fn(&RequestMetrics) -> u64| outcomes.iter().map(|(_, m, _)| f(m)).sum();
        Self {
            requests: outcomes.len() as u64,
            errors: outcomes.iter().filter(|(_, _, ok)| !ok).count() as u64,
            e2e_ms: pick(|m| m.e2e_ms),
            prefix_ms: pick(|m| m.prefix_ms),
            prefix_cpu_ms: pick(|m| m.prefix_cpu_ms),
            encode_ms: pick(|m| m.encode_ms),
            round_trip_ms: pick(|m| m.round_trip_ms),
            server_ms: pick(|m| m.server.total_ms()),
            network_ms: pick(RequestMetrics::network_ms),
            decode_ms: pick(|m| m.decode_ms),
            throughput_rps: if wall_s > 0.0 { ok.len() as f64 / wall_s } else { 0.0 },
            bytes_raw: sum(|m| m.bytes_raw),
            bytes_wire: sum(|m| m.bytes_wire),
            copied_sent_bytes: sum(|m| m.copied_sent_bytes),
            copied_received_bytes: sum(|m| m.copied_received_bytes),
            codecs: outcomes.iter().filter_map(|(_, m, _)| m.codec).fold(Default::default(), |mut counts, codec| {
                *counts.entry(codec.to_string()).or_default() += 1;
                counts
            }),
            ..Self::default()
        }
    }
}

/// Where the edge's processor time went: on a weak or capped edge, every thread's work
/// besides the prefixes makes them wait.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct EdgeCpu {
    /// Wall time from the start of the run to its requests: the bundle, the inputs, the
    /// connection and, with `split: auto`, the profiles and the plan.
    pub startup_s: f64,
    /// Processor time of the start-up.
    pub startup_cpu_s: f64,
    /// Wall time from the start of the requests' stream to its first request: loading and
    /// warming the edge's stages (`split: auto` runs the ones its profile warmed).
    pub stages_ready_s: f64,
    /// Processor time per request, every thread, from the first answer to the last (so the
    /// loading and warming of the edge's stages before the first request are left out).
    pub per_request_ms: f64,
    /// Of that, the prefix's.
    pub prefix_per_request_ms: f64,
}

/// Measures [`EdgeCpu`]'s figures of the requests from the answers as they come.
#[derive(Debug)]
pub struct CpuMeter {
    /// When the stream started, and the earliest start of an answered request.
    stream_started: std::time::Instant,
    first_request: Option<std::time::Instant>,
    /// The process's processor time at the first answer and at the latest.
    first: Option<std::time::Duration>,
    latest: std::time::Duration,
    /// Answers after the first, and their prefixes' processor time.
    requests: u64,
    prefix_ms: f64,
}

impl Default for CpuMeter {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuMeter {
    /// Starts measuring as the stream of requests starts.
    pub fn new() -> Self {
        let stream_started = std::time::Instant::now();
        Self { stream_started, first_request: None, first: None, latest: std::time::Duration::ZERO, requests: 0, prefix_ms: 0.0 }
    }

    /// One more answer.
    pub fn answered(&mut self, m: &RequestMetrics) {
        let began = std::time::Instant::now().checked_sub(std::time::Duration::from_secs_f64(m.e2e_ms.max(0.0) / 1e3));
        self.first_request = self.first_request.into_iter().chain(began).min();
        self.latest = crate::cpu_time::process();
        if self.first.is_none() {
            self.first = Some(self.latest);
        } else {
            self.requests += 1;
            self.prefix_ms += m.prefix_cpu_ms;
        }
    }

    /// The figures, with the start-up's wall and processor time.
    pub fn finish(&self, startup: std::time::Duration, startup_cpu: std::time::Duration) -> EdgeCpu {
        let per_request = |ms: f64| if self.requests > 0 { ms / self.requests as f64 } else { 0.0 };
        let spent = self.latest.saturating_sub(self.first.unwrap_or(self.latest));
        EdgeCpu {
            startup_s: startup.as_secs_f64(),
            startup_cpu_s: startup_cpu.as_secs_f64(),
            stages_ready_s: self.first_request.map_or(0.0, |t| t.saturating_duration_since(self.stream_started).as_secs_f64()),
            per_request_ms: per_request(spent.as_secs_f64() * 1e3),
            prefix_per_request_ms: per_request(self.prefix_ms),
        }
    }
}

/// One error and how many requests failed with it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Failure {
    /// Requests that failed with it.
    pub requests: u64,
    /// The error, as `predictions.jsonl` records it.
    pub error: String,
}

/// The files and directories of a run.
const RUN_FILES: [&str; 4] = ["predictions.jsonl", "metrics.csv", "summary.json", "tensors"];

/// The columns of `metrics.csv`.
const METRICS_HEADER: &str = "request_id,split,ok,prefix_ms,encode_ms,bytes_raw,bytes_wire,round_trip_ms,server_queue_ms,server_decode_ms,\
server_compute_ms,server_encode_ms,server_ms,network_ms,decode_ms,e2e_ms,served_by,attempts,copied_sent_bytes,copied_received_bytes,codec";

/// Columns of the rows that an earlier version wrote (without the copied bytes and the
/// codec); `--resume` still reads them.
const EARLIER_COLUMNS: usize = 18;

pub use crate::files::OutputMode;

/// Whether `dir` holds an outcome of an earlier run: a line in `predictions.jsonl` or a
/// summary (a run that failed before any request leaves neither).
fn holds_outcomes(dir: &Path) -> bool {
    let predictions = std::fs::metadata(dir.join("predictions.jsonl")).map(|m| m.len() > 0).unwrap_or(false);
    predictions || dir.join("summary.json").exists()
}

/// Writes the per-request files as outcomes arrive, a line per request, flushed at once: a
/// run killed part-way leaves whole lines of what was answered.
pub struct ReportWriter {
    dir: PathBuf,
    predictions: BufWriter<File>,
    metrics: BufWriter<File>,
    top_k: usize,
    /// Outcomes seen (for the summary), those of the run resumed first.
    pub outcomes: Vec<(u64, RequestMetrics, bool)>,
    /// Outcomes kept from the run resumed.
    pub resumed: u64,
    /// Requests of this invocation by the error they failed with.
    failures: std::collections::HashMap<String, u64>,
}

impl ReportWriter {
    /// Creates the output directory and its files: refused when it holds an earlier run,
    /// unless `mode` replaces or resumes it.
    pub fn open(dir: &Path, top_k: usize, mode: OutputMode) -> Result<Self> {
        if RUN_FILES.iter().any(|f| dir.join(f).exists()) && !holds_outcomes(dir) {
            // A run that failed before its first request left its files empty: not a run to
            // keep, and no reason to refuse the corrected one.
            claim_output(dir, &EarlierRun { kind: "run", files: &RUN_FILES, continue_with: None }, OutputMode::Force)?;
        }
        let earlier = EarlierRun { kind: "run", files: &RUN_FILES, continue_with: Some("--resume to continue it") };
        claim_output(dir, &earlier, mode)?;
        let resuming = mode == OutputMode::Resume && dir.join("predictions.jsonl").exists();
        let outcomes = if resuming { keep_answered(dir)? } else { Vec::new() };
        let open = |name: &str| -> Result<BufWriter<File>> {
            let file = std::fs::OpenOptions::new().create(true).append(true).open(dir.join(name)).map_err(|e| HostError::write(dir.join(name), e))?;
            Ok(BufWriter::new(file))
        };
        let (predictions, mut metrics) = (open("predictions.jsonl")?, open("metrics.csv")?);
        if !resuming {
            writeln!(metrics, "{METRICS_HEADER}").and_then(|()| metrics.flush()).map_err(|e| HostError::write(dir.join("metrics.csv"), e))?;
        }
        let resumed = outcomes.len() as u64;
        Ok(Self { dir: dir.to_path_buf(), predictions, metrics, top_k, outcomes, resumed, failures: Default::default() })
    }

    /// Request ids that have their outcome already (from the run resumed).
    pub fn done(&self) -> std::collections::HashSet<u64> {
        self.outcomes.iter().map(|(id, _, _)| *id).collect()
    }

    /// Records one outcome, with the image file of each of its samples when there are.
    pub fn record(&mut self, bundle: &Bundle, outcome: RequestOutcome, files: Option<Vec<String>>) -> Result<()> {
        let m = &outcome.metrics;
        let mut line = match outcome.output {
            Ok(last) => {
                let output = bundle.assemble_output(last)?;
                match classification_scores(&output) {
                    Some(scores) => {
                        serde_json::json!({ "request_id": outcome.request_id, "served_by": m.served_by, "top_k": top_k(&scores, self.top_k) })
                    }
                    None => {
                        let rel = format!("tensors/request_{:06}.safetensors", outcome.request_id);
                        let tensors = self.dir.join("tensors");
                        std::fs::create_dir_all(&tensors).map_err(|error| HostError::Io { action: "cannot create", path: tensors, error })?;
                        let mut leaves = Vec::new();
                        output.tensor_leaves("output", &mut leaves);
                        let named: Vec<(String, tch::Tensor)> =
                            leaves.into_iter().map(|(n, t)| (n, t.to_device(tch::Device::Cpu).contiguous())).collect();
                        tch::Tensor::write_safetensors(&named, self.dir.join(&rel))?;
                        serde_json::json!({ "request_id": outcome.request_id, "served_by": m.served_by, "tensors": rel })
                    }
                }
            }
            Err(e) => {
                let error = e.to_string();
                *self.failures.entry(error.clone()).or_default() += 1;
                serde_json::json!({ "request_id": outcome.request_id, "error": error })
            }
        };
        if let Some(files) = files {
            line["inputs"] = files.into();
        }
        let ok = line.get("error").is_none();
        let predictions_error = |e| HostError::write(self.dir.join("predictions.jsonl"), e);
        writeln!(self.predictions, "{line}").and_then(|()| self.predictions.flush()).map_err(predictions_error)?;
        let s = &m.server;
        writeln!(
            self.metrics,
            "{},{},{},{:.3},{:.3},{},{},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{},{},{},{},{}",
            outcome.request_id,
            m.split,
            ok,
            m.prefix_ms,
            m.encode_ms,
            m.bytes_raw,
            m.bytes_wire,
            m.round_trip_ms,
            s.queue_ms,
            s.decode_ms,
            s.compute_ms,
            s.encode_ms,
            s.total_ms(),
            m.network_ms(),
            m.decode_ms,
            m.e2e_ms,
            m.served_by.name(),
            m.attempts,
            m.copied_sent_bytes,
            m.copied_received_bytes,
            m.codec.map_or(String::new(), |c| c.to_string())
        )
        .and_then(|()| self.metrics.flush()) // A line per request as it is answered: `tail -f metrics.csv` follows a run.
        .map_err(|e| HostError::write(self.dir.join("metrics.csv"), e))?;
        self.outcomes.push((outcome.request_id, outcome.metrics, ok));
        Ok(())
    }

    /// Each distinct error this invocation's requests failed with, most frequent first.
    pub fn failures(&self) -> Vec<Failure> {
        let mut failures: Vec<Failure> = self.failures.iter().map(|(error, n)| Failure { requests: *n, error: error.clone() }).collect();
        failures.sort_by(|a, b| b.requests.cmp(&a.requests).then_with(|| a.error.cmp(&b.error)));
        failures
    }

    /// Flushes the files.
    pub fn finish(mut self) -> Result<Vec<(u64, RequestMetrics, bool)>> {
        self.predictions.flush().map_err(|e| HostError::write(self.dir.join("predictions.jsonl"), e))?;
        self.metrics.flush().map_err(|e| HostError::write(self.dir.join("metrics.csv"), e))?;
        Ok(self.outcomes)
    }
}

/// Continues a run: keeps the requests answered with a result that both `predictions.jsonl`
/// and `metrics.csv` have a whole line for (a run killed part-way may have written one and
/// not the other, or half a line), rewrites both files with only those, and returns their
/// outcomes. A request that failed is sent again.
fn keep_answered(dir: &Path) -> Result<Vec<(u64, RequestMetrics, bool)>> {
    let read =
        |name: &str| std::fs::read_to_string(dir.join(name)).map_err(|error| HostError::Io { action: "cannot read", path: dir.join(name), error });
    let whole_lines = |text: &str| -> Vec<String> {
        let whole = text.rfind('\n').map_or("", |end| &text[..end]);
        whole.lines().filter(|l| !l.is_empty()).map(str::to_string).collect()
    };
    let cannot = |name: &str, why: String| HostError::from(OutputError::CannotResume { file: dir.join(name), why });
    let predictions = whole_lines(&read("predictions.jsonl")?);
    let metrics = whole_lines(&read("metrics.csv")?);
    let (header, rows) = metrics.split_first().ok_or_else(|| cannot("metrics.csv", "it has no header".into()))?;
    if header != METRICS_HEADER {
        return Err(cannot("metrics.csv", "its columns are not this version's".into()));
    }
    let mut lines: std::collections::BTreeMap<u64, String> = Default::default();
    for line in predictions {
        let id = serde_json::from_str::<serde_json::Value>(&line)
            .ok()
            .and_then(|v| v.get("request_id").and_then(serde_json::Value::as_u64))
            .ok_or_else(|| cannot("predictions.jsonl", format!("a line without a request id: {line}")))?;
        lines.insert(id, line);
    }
    // (prediction line, metrics row, outcome) of each request with both.
    let mut kept = Vec::new();
    for row in rows {
        let (id, metrics, ok) = parse_metrics_row(row).ok_or_else(|| cannot("metrics.csv", format!("a row that does not parse: {row}")))?;
        match lines.remove(&id) {
            Some(line) if ok => kept.push((line, row.clone(), (id, metrics, ok))),
            _ => {}
        }
    }
    let rewrite = |name: &str, lines: Vec<&str>| -> Result<()> {
        let tmp = dir.join(format!(".{name}.resume"));
        std::fs::write(&tmp, lines.iter().map(|l| format!("{l}\n")).collect::<String>()).map_err(|e| HostError::write(&tmp, e))?;
        std::fs::rename(&tmp, dir.join(name)).map_err(|e| HostError::write(dir.join(name), e))
    };
    rewrite("predictions.jsonl", kept.iter().map(|k| k.0.as_str()).collect())?;
    rewrite("metrics.csv", std::iter::once(METRICS_HEADER).chain(kept.iter().map(|k| k.1.as_str())).collect())?;
    Ok(kept.into_iter().map(|(_, _, outcome)| outcome).collect())
}

/// One row of `metrics.csv`: the request id, its measurements and whether it succeeded.
fn parse_metrics_row(row: &str) -> Option<(u64, RequestMetrics, bool)> {
    let cells: Vec<&str> = row.split(',').collect();
    let columns = METRICS_HEADER.split(',').count();
    if cells.len() != columns && cells.len() != EARLIER_COLUMNS {
        return None;
    }
    let f = |i: usize| cells[i].parse::<f64>().ok();
    let u = |i: usize| cells[i].parse::<u64>().ok();
    let metrics = RequestMetrics {
        split: cells[1].parse().ok()?,
        // Not a column of metrics.csv (its format stays as later readers know it).
        input_ms: 0.0,
        prefix_ms: f(3)?,
        prefix_cpu_ms: 0.0,
        encode_ms: f(4)?,
        bytes_raw: u(5)?,
        bytes_wire: u(6)?,
        round_trip_ms: f(7)?,
        server: ServerTimes { queue_ms: f(8)?, decode_ms: f(9)?, compute_ms: f(10)?, encode_ms: f(11)? },
        decode_ms: f(14)?,
        e2e_ms: f(15)?,
        served_by: match cells[16] {
            "server" => ServedBy::Server,
            "edge" => ServedBy::Edge,
            _ => return None,
        },
        suffix_on_edge_ms: 0.0,
        attempts: cells[17].parse().ok()?,
        server_url: None,
        copied_sent_bytes: if cells.len() == columns { u(18)? } else { 0 },
        copied_received_bytes: if cells.len() == columns { u(19)? } else { 0 },
        codec: match cells.get(20) {
            Some(text) if !text.is_empty() => Some(text.parse().ok()?),
            _ => None,
        },
    };
    Some((u(0)?, metrics, cells[2].parse().ok()?))
}

/// The codec, and with `codec: auto` how many requests each codec carried.
fn codecs_text(s: &Summary) -> String {
    if s.codec != "auto" {
        return s.codec.clone();
    }
    let counts: Vec<String> = s.codecs.iter().map(|(codec, n)| format!("{codec} {n}")).collect();
    format!("auto: {}", if counts.is_empty() { "none sent".to_string() } else { counts.join(", ") })
}

/// Where the time of `requests` (all split at `cut`, at least one) went: the median of each
/// part, ms.
pub fn median_breakdown(cut: usize, requests: &[&RequestMetrics]) -> Result<CutBreakdown> {
    let empty = |_| HostError::from(MeasureError::NothingAtCut { cut });
    let median = |f: fn(&RequestMetrics) -> f64| median(&requests.iter().map(|m| f(m)).collect::<Vec<_>>()).map_err(empty);
    Ok(CutBreakdown {
        cut,
        label: cut.to_string(),
        edge_ms: median(|m| m.prefix_ms)?,
        encode_ms: median(|m| m.encode_ms)?,
        network_ms: median(RequestMetrics::network_ms)?,
        server_ms: median(|m| m.server.total_ms())?,
        decode_ms: median(|m| m.decode_ms)?,
    })
}

/// The plots of a run: the CDF of end-to-end latency and the median breakdown, one series and
/// one bar per cut the requests were split at (one, unless `split: auto` moved it). Failed
/// requests are left out. Returns the files written (none when no request succeeded).
pub fn plot_run(model: &str, outcomes: &[(u64, RequestMetrics, bool)], dir: &Path) -> Result<Vec<PathBuf>> {
    let mut by_cut: std::collections::BTreeMap<usize, Vec<&RequestMetrics>> = Default::default();
    for (_, m, ok) in outcomes {
        if *ok {
            by_cut.entry(m.split).or_default().push(m);
        }
    }
    if by_cut.is_empty() {
        return Ok(Vec::new());
    }
    let series: Vec<(String, Vec<f64>)> =
        by_cut.iter().map(|(cut, all)| (format!("split at cut {cut}"), all.iter().map(|m| m.e2e_ms).collect())).collect();
    let cdf = dir.join(LATENCY_CDF);
    crate::plots::run::plot_latency_cdf(&cdf, &format!("{model}: end-to-end latency"), &series)?;
    let bars: Vec<CutBreakdown> = by_cut.iter().map(|(cut, all)| median_breakdown(*cut, all)).collect::<Result<_>>()?;
    let breakdown = dir.join(BREAKDOWN);
    crate::plots::run::plot_breakdown(&breakdown, &format!("{model}: where the time goes (medians)"), &bars)?;
    Ok(vec![cdf, breakdown])
}

/// Softmax scores when the output is one float tensor [batch, classes].
fn classification_scores(output: &Value) -> Option<Vec<Vec<f64>>> {
    let t = output.as_tensor()?;
    if t.dim() != 2 || !t.is_floating_point() {
        return None;
    }
    let probs = t.to_device(tch::Device::Cpu).to_kind(tch::Kind::Double).softmax(-1, tch::Kind::Double);
    Vec::<Vec<f64>>::try_from(probs).ok()
}

fn top_k(scores: &[Vec<f64>], k: usize) -> Vec<Vec<(usize, f64)>> {
    scores
        .iter()
        .map(|row| {
            let mut idx: Vec<(usize, f64)> = row.iter().copied().enumerate().collect();
            idx.sort_by(|a, b| b.1.total_cmp(&a.1));
            idx.truncate(k);
            idx
        })
        .collect()
}

/// The edge's processor time in a line: per request and of it the prefix, the probes, the start-up.
fn edge_cpu_text(cpu: &EdgeCpu, probes: Option<&Probes>) -> String {
    let probes = probes.map_or(String::new(), |p| format!("; {} bandwidth probes ({})", p.count, human_bytes(p.bytes)));
    format!(
        "{:.2} ms per request, {:.2} ms of it the prefix{probes}; start-up {:.2} s ({:.2} s of processor), then {:.2} s until the edge's stages were ready",
        cpu.per_request_ms, cpu.prefix_per_request_ms, cpu.startup_s, cpu.startup_cpu_s, cpu.stages_ready_s
    )
}

/// What is printed at the end of a run: the latency of each part (p50, p95, p99) when a
/// request succeeded, then the run's throughput, requests and bytes, then each distinct error
/// once with its count.
pub fn summary_text(s: &Summary) -> String {
    let mut latencies = comfy_table::Table::new();
    latencies.load_preset(comfy_table::presets::UTF8_FULL_CONDENSED).set_header(vec!["latency", "p50", "p95", "p99"]);
    let rows = [
        ("end to end ms", s.e2e_ms),
        ("edge prefix ms", s.prefix_ms),
        ("encode ms", s.encode_ms),
        ("round trip ms", s.round_trip_ms),
        ("  server ms", s.server_ms),
        ("  network ms", s.network_ms),
        ("decode ms", s.decode_ms),
    ];
    for (name, p) in rows {
        let cell = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
        latencies.add_row(vec![name.to_string(), cell(p.map(|p| p.p50)), cell(p.map(|p| p.p95)), cell(p.map(|p| p.p99))]);
    }
    let c = &s.counts;
    let mut run = comfy_table::Table::new();
    run.load_preset(comfy_table::presets::UTF8_FULL_CONDENSED);
    run.add_row(vec!["throughput".to_string(), format!("{:.1} req/s over {:.1} s", s.throughput_rps, s.wall_s)]);
    run.add_row(vec![
        "requests".to_string(),
        format!(
            "{} in all{}: {} answered ({} on the edge), {} failed, {} never sent; {} resent, {} reconnects",
            s.requests + c.never_sent,
            if s.resumed > 0 { format!(" ({} kept from the run resumed)", s.resumed) } else { String::new() },
            c.answered,
            c.served_by_edge,
            c.failed,
            c.never_sent,
            c.retried,
            c.reconnects
        ),
    ]);
    if !c.by_server.is_empty() {
        let each: Vec<String> = c.by_server.iter().map(|(url, n)| format!("{url} {n}")).collect();
        run.add_row(vec!["answered by".to_string(), each.join(", ")]);
    }
    let security = format!("{}{}", if s.encryption.is_some() { ", aes-256-gcm" } else { "" }, if s.tls { ", TLS" } else { "" });
    run.add_row(vec![
        "bytes sent".to_string(),
        format!("{} of tensors, {} on the wire ({}{security})", human_bytes(s.bytes_raw), human_bytes(s.bytes_wire), codecs_text(s)),
    ]);
    run.add_row(vec!["edge processor".to_string(), edge_cpu_text(&s.edge_cpu, s.probes.as_ref())]);
    let mut text = if s.e2e_ms.is_some() { format!("{latencies}\n{run}") } else { format!("no request succeeded: no latencies to show\n{run}") };
    if !s.failures.is_empty() {
        text.push_str("\nrequests failed with (each request's error is in predictions.jsonl):");
        for f in &s.failures {
            text.push_str(&format!("\n  {:>6} x {}", f.requests, f.error));
        }
    }
    if c.stopped_early {
        text.push_str(
            "\nthe run stopped early: its first requests all failed with one error that sending again cannot fix; fix it and rerun with --resume",
        );
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_left_by_a_run_that_answered_nothing_is_reused_one_with_an_outcome_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        // What a run that failed before its first request leaves: empty predictions, the header.
        drop(ReportWriter::open(dir, 1, OutputMode::Fresh).unwrap());
        assert_eq!(std::fs::read_to_string(dir.join("predictions.jsonl")).unwrap(), "");
        let rerun = ReportWriter::open(dir, 1, OutputMode::Fresh).expect("the corrected rerun is not refused");
        drop(rerun);
        assert_eq!(std::fs::read_to_string(dir.join("metrics.csv")).unwrap(), format!("{METRICS_HEADER}\n"), "one header, not two");
        // One outcome makes it an earlier run.
        std::fs::write(dir.join("predictions.jsonl"), "{\"request_id\":0,\"error\":\"x\"}\n").unwrap();
        let refused = ReportWriter::open(dir, 1, OutputMode::Fresh).err().expect("refused").to_string();
        assert!(refused.contains("holds an earlier run"), "{refused}");
    }

    #[test]
    fn top_k_orders_by_score() {
        assert_eq!(top_k(&[vec![0.1, 0.7, 0.2]], 2), vec![vec![(1, 0.7), (2, 0.2)]]);
    }
}
