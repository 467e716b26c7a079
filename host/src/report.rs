//! What a run leaves behind: `predictions.jsonl`, `metrics.csv`, `summary.json`, and the
//! table printed on stdout.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use cleave_common::stats::{median, Percentiles};
use cleave_common::tables::human_bytes;
use cleave_common::{Bundle, Value};
use serde::Serialize;

use crate::client::{RequestMetrics, RequestOutcome};
use crate::error::{HostError, Result};
use crate::planning::auto_split::{Planned, SplitMove};
use crate::plots::run::{CutBreakdown, BREAKDOWN, LATENCY_CDF};

/// `summary.json`. Each part's percentiles are over the requests that succeeded (`null`
/// when none did).
#[derive(Debug, Clone, Serialize)]
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
    /// Payload codec (`raw`, `shuffle+lz4`, ...).
    pub codec: String,
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
}

/// Writes the per-request files as outcomes arrive.
pub struct ReportWriter {
    dir: PathBuf,
    predictions: BufWriter<File>,
    metrics: BufWriter<File>,
    top_k: usize,
    /// Outcomes seen (for the summary).
    pub outcomes: Vec<(u64, RequestMetrics, bool)>,
}

impl ReportWriter {
    /// Creates the output directory and its files.
    pub fn create(dir: &Path, top_k: usize) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|error| HostError::Io { action: "cannot create output directory", path: dir.into(), error })?;
        let open = |name: &str| -> Result<BufWriter<File>> {
            Ok(BufWriter::new(File::create(dir.join(name)).map_err(|e| HostError::write(dir.join(name), e))?))
        };
        let mut metrics = open("metrics.csv")?;
        let metrics_path = dir.join("metrics.csv");
        writeln!(
            metrics,
            "request_id,split,ok,prefix_ms,encode_ms,bytes_raw,bytes_wire,round_trip_ms,server_queue_ms,server_decode_ms,server_compute_ms,server_encode_ms,server_ms,network_ms,decode_ms,e2e_ms"
        )
        .map_err(|e| HostError::write(&metrics_path, e))?;
        Ok(Self { dir: dir.to_path_buf(), predictions: open("predictions.jsonl")?, metrics, top_k, outcomes: Vec::new() })
    }

    /// Records one outcome.
    pub fn record(&mut self, bundle: &Bundle, outcome: RequestOutcome) -> Result<()> {
        let m = &outcome.metrics;
        let line = match outcome.output {
            Ok(last) => {
                let output = bundle.assemble_output(last)?;
                match classification_scores(&output) {
                    Some(scores) => serde_json::json!({ "request_id": outcome.request_id, "top_k": top_k(&scores, self.top_k) }),
                    None => {
                        let rel = format!("tensors/request_{:06}.safetensors", outcome.request_id);
                        let tensors = self.dir.join("tensors");
                        std::fs::create_dir_all(&tensors).map_err(|error| HostError::Io { action: "cannot create", path: tensors, error })?;
                        let mut leaves = Vec::new();
                        output.tensor_leaves("output", &mut leaves);
                        let named: Vec<(String, tch::Tensor)> =
                            leaves.into_iter().map(|(n, t)| (n, t.to_device(tch::Device::Cpu).contiguous())).collect();
                        tch::Tensor::write_safetensors(&named, self.dir.join(&rel))?;
                        serde_json::json!({ "request_id": outcome.request_id, "tensors": rel })
                    }
                }
            }
            Err(e) => serde_json::json!({ "request_id": outcome.request_id, "error": e }),
        };
        let ok = line.get("error").is_none();
        let predictions_error = |e| HostError::write(self.dir.join("predictions.jsonl"), e);
        writeln!(self.predictions, "{line}").map_err(predictions_error)?;
        let s = &m.server;
        writeln!(
            self.metrics,
            "{},{},{},{:.3},{:.3},{},{},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3}",
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
            network_ms(m),
            m.decode_ms,
            m.e2e_ms
        )
        .and_then(|()| self.metrics.flush()) // A line per request as it is answered: `tail -f metrics.csv` follows a run.
        .map_err(|e| HostError::write(self.dir.join("metrics.csv"), e))?;
        self.outcomes.push((outcome.request_id, outcome.metrics, ok));
        Ok(())
    }

    /// Flushes the files.
    pub fn finish(mut self) -> Result<Vec<(u64, RequestMetrics, bool)>> {
        self.predictions.flush().map_err(|e| HostError::write(self.dir.join("predictions.jsonl"), e))?;
        self.metrics.flush().map_err(|e| HostError::write(self.dir.join("metrics.csv"), e))?;
        Ok(self.outcomes)
    }
}

/// The network's share of a request: its round trip less the server's time (zero for a
/// request that never left the edge).
pub fn network_ms(m: &RequestMetrics) -> f64 {
    (m.round_trip_ms - m.server.total_ms()).max(0.0)
}

/// Where the time of `requests` (all split at `cut`, at least one) went: the median of each
/// part, ms.
pub fn median_breakdown(cut: usize, requests: &[&RequestMetrics]) -> Result<CutBreakdown> {
    let empty = |_| HostError::Invalid(format!("no request at cut {cut} to break down"));
    let median = |f: fn(&RequestMetrics) -> f64| median(&requests.iter().map(|m| f(m)).collect::<Vec<_>>()).map_err(empty);
    Ok(CutBreakdown {
        cut,
        label: cut.to_string(),
        edge_ms: median(|m| m.prefix_ms)?,
        encode_ms: median(|m| m.encode_ms)?,
        network_ms: median(network_ms)?,
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

/// The readable table printed at the end of a run.
pub fn summary_table(s: &Summary) -> comfy_table::Table {
    let mut table = comfy_table::Table::new();
    table.load_preset(comfy_table::presets::UTF8_FULL_CONDENSED).set_header(vec!["", "p50", "p95", "p99"]);
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
        table.add_row(vec![name.to_string(), cell(p.map(|p| p.p50)), cell(p.map(|p| p.p95)), cell(p.map(|p| p.p99))]);
    }
    table.add_row(vec![
        "throughput".to_string(),
        format!("{:.1} req/s", s.throughput_rps),
        format!("{} requests", s.requests),
        format!("{} errors", s.errors),
    ]);
    table.add_row(vec![
        "bytes sent".to_string(),
        human_bytes(s.bytes_raw),
        format!("{} on the wire", human_bytes(s.bytes_wire)),
        format!("{}{}{}", s.codec, if s.encryption.is_some() { " + aes-256-gcm" } else { "" }, if s.tls { ", TLS" } else { "" }),
    ]);
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_orders_by_score() {
        assert_eq!(top_k(&[vec![0.1, 0.7, 0.2]], 2), vec![vec![(1, 0.7), (2, 0.2)]]);
    }
}
