//! What a run leaves behind: `predictions.jsonl`, `metrics.csv`, `summary.json`, and the
//! table printed on stdout.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use cleave_common::tables::human_bytes;
use cleave_common::{Bundle, Value};
use serde::Serialize;

use crate::client::{RequestMetrics, RequestOutcome};
use crate::pictures::{CutBreakdown, BREAKDOWN, LATENCY_CDF};

/// p50, p95 and p99 of a measurement.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 95th percentile.
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
}

impl Percentiles {
    /// Nearest-rank percentiles of `values` (zeros when empty).
    pub fn of(values: &[f64]) -> Self {
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        let at = |p: f64| if v.is_empty() { 0.0 } else { v[((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1] };
        Self { p50: at(0.50), p95: at(0.95), p99: at(0.99) }
    }
}

/// `summary.json`.
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
    pub e2e_ms: Percentiles,
    /// Prefix, per request.
    pub prefix_ms: Percentiles,
    /// Encoding the boundary, per request.
    pub encode_ms: Percentiles,
    /// Round trip, per request.
    pub round_trip_ms: Percentiles,
    /// The server's own time (queue, decode, compute, encode), per request.
    pub server_ms: Percentiles,
    /// The network's share: the round trip less the server's time, per request.
    pub network_ms: Percentiles,
    /// Decoding the result, per request.
    pub decode_ms: Percentiles,
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
    pub planned: Option<crate::auto_split::Planned>,
    /// `split: auto`: every move of the split while running.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub split_moves: Vec<crate::auto_split::SplitMove>,
}

/// Writes the per-request files as outcomes arrive.
pub struct ReportWriter {
    dir: PathBuf,
    predictions: BufWriter<File>,
    metrics: BufWriter<File>,
    top_k: usize,
    /// Outcomes seen (for the summary).
    pub outcomes: Vec<(u64, crate::client::RequestMetrics, bool)>,
}

impl ReportWriter {
    /// Creates the output directory and its files.
    pub fn create(dir: &Path, top_k: usize) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| anyhow::anyhow!("cannot create output directory {}: {e}", dir.display()))?;
        let open = |name: &str| -> anyhow::Result<BufWriter<File>> {
            Ok(BufWriter::new(File::create(dir.join(name)).map_err(|e| anyhow::anyhow!("cannot write {}: {e}", dir.join(name).display()))?))
        };
        let mut metrics = open("metrics.csv")?;
        writeln!(
            metrics,
            "request_id,split,ok,prefix_ms,encode_ms,bytes_raw,bytes_wire,round_trip_ms,server_queue_ms,server_decode_ms,server_compute_ms,server_encode_ms,server_ms,network_ms,decode_ms,e2e_ms"
        )?;
        Ok(Self { dir: dir.to_path_buf(), predictions: open("predictions.jsonl")?, metrics, top_k, outcomes: Vec::new() })
    }

    /// Records one outcome.
    pub fn record(&mut self, bundle: &Bundle, outcome: RequestOutcome) -> anyhow::Result<()> {
        let m = &outcome.metrics;
        let line = match outcome.output {
            Ok(last) => {
                let output = bundle.assemble_output(last)?;
                match classification_scores(&output) {
                    Some(scores) => serde_json::json!({ "request_id": outcome.request_id, "top_k": top_k(&scores, self.top_k) }),
                    None => {
                        let rel = format!("tensors/request_{:06}.safetensors", outcome.request_id);
                        std::fs::create_dir_all(self.dir.join("tensors"))?;
                        let mut leaves = Vec::new();
                        output.tensor_leaves("output", &mut leaves);
                        let named: Vec<(String, tch::Tensor)> = leaves.into_iter().map(|(n, t)| (n, t.to_device(tch::Device::Cpu).contiguous())).collect();
                        tch::Tensor::write_safetensors(&named, self.dir.join(&rel))?;
                        serde_json::json!({ "request_id": outcome.request_id, "tensors": rel })
                    }
                }
            }
            Err(e) => serde_json::json!({ "request_id": outcome.request_id, "error": e }),
        };
        let ok = line.get("error").is_none();
        writeln!(self.predictions, "{line}")?;
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
        )?;
        // A line per request as it is answered: `tail -f metrics.csv` follows a run.
        self.metrics.flush()?;
        self.outcomes.push((outcome.request_id, outcome.metrics, ok));
        Ok(())
    }

    /// Flushes the files.
    pub fn finish(mut self) -> anyhow::Result<Vec<(u64, RequestMetrics, bool)>> {
        self.predictions.flush()?;
        self.metrics.flush()?;
        Ok(self.outcomes)
    }
}

/// The network's share of a request: its round trip less the server's time (zero for a
/// request that never left the edge).
pub fn network_ms(m: &RequestMetrics) -> f64 {
    (m.round_trip_ms - m.server.total_ms()).max(0.0)
}

/// Where the time of `requests` (all split at `cut`) went: the median of each part, ms.
pub fn median_breakdown(cut: usize, requests: &[&RequestMetrics]) -> CutBreakdown {
    let median = |f: fn(&RequestMetrics) -> f64| Percentiles::of(&requests.iter().map(|m| f(m)).collect::<Vec<_>>()).p50;
    CutBreakdown {
        cut,
        label: cut.to_string(),
        edge_ms: median(|m| m.prefix_ms),
        encode_ms: median(|m| m.encode_ms),
        network_ms: median(network_ms),
        server_ms: median(|m| m.server.total_ms()),
        decode_ms: median(|m| m.decode_ms),
    }
}

/// The plots of a run: the CDF of end-to-end latency and the median breakdown, one series and
/// one bar per cut the requests were split at (one, unless `split: auto` moved it). Failed
/// requests are left out. Returns the files written (none when no request succeeded).
pub fn plot_run(model: &str, outcomes: &[(u64, RequestMetrics, bool)], dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
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
    crate::pictures::plot_latency_cdf(&cdf, &format!("{model}: end-to-end latency"), &series)?;
    let bars: Vec<CutBreakdown> = by_cut.iter().map(|(cut, all)| median_breakdown(*cut, all)).collect();
    let breakdown = dir.join(BREAKDOWN);
    crate::pictures::plot_breakdown(&breakdown, &format!("{model}: where the time goes (medians)"), &bars)?;
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
        table.add_row(vec![name.to_string(), format!("{:.2}", p.p50), format!("{:.2}", p.p95), format!("{:.2}", p.p99)]);
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
        format!(
            "{}{}{}",
            s.codec,
            if s.encryption.is_some() { " + aes-256-gcm" } else { "" },
            if s.tls { ", TLS" } else { "" }
        ),
    ]);
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        let p = Percentiles::of(&v);
        assert_eq!((p.p50, p.p95, p.p99), (50.0, 95.0, 99.0));
        let p = Percentiles::of(&[3.0]);
        assert_eq!((p.p50, p.p99), (3.0, 3.0));
        assert_eq!(Percentiles::of(&[]).p50, 0.0);
    }

    #[test]
    fn top_k_orders_by_score() {
        assert_eq!(top_k(&[vec![0.1, 0.7, 0.2]], 2), vec![vec![(1, 0.7), (2, 0.2)]]);
    }
}
