//! What a load run leaves behind: a record per request, statistics per model and overall
//! (percentiles from `cleave_common::stats`, SLO attainment), `load.json`, `latency.csv`,
//! the table printed for people and the one-line summary benches parse.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use cleave_common::stats::Percentiles;
use comfy_table::presets::UTF8_FULL_CONDENSED;
use comfy_table::{CellAlignment, Table};
use serde::Serialize;

use crate::error::{HostError, Result};

/// The files a load run writes into its output directory.
pub const LOAD_FILES: [&str; 3] = ["load.json", "latency.csv", "latency.svg"];

/// The columns of `latency.csv`.
pub const LATENCY_HEADER: &str = "t_s,model,edge,split,latency_ms,result";

/// What became of one request.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestRecord {
    /// When its latency starts, in seconds since the run's start: its scheduled time in an
    /// open loop, its send in a closed one.
    pub t_s: f64,
    /// The model (an index into the configs).
    pub model: usize,
    /// The edge that sent it.
    pub edge: usize,
    /// Its cut.
    pub split: usize,
    /// From `t_s` to its whole answer (a result or an error answer); none when no answer came.
    pub latency_ms: Option<f64>,
    /// `None` when answered with a result that decoded; else the error's code: a gRPC code's
    /// name (`ResourceExhausted`) for an error answer, or one of the generator's own
    /// (`dropped_in_flight_cap`, `undecodable`, `stream_lost`, `unanswered`, `encode_failed`).
    pub error: Option<String>,
}

impl RequestRecord {
    /// Answered with a result.
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }
}

/// The statistics of a set of requests (a model's, a cut's or all of them).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LoadStats {
    /// Requests due (sent, or dropped at the in-flight cap).
    pub requests: u64,
    /// Requests answered with a result that decoded.
    pub answered: u64,
    /// Requests that were not: `requests - answered`.
    pub errors: u64,
    /// The errors by code (see [`RequestRecord::error`]).
    pub errors_by_code: BTreeMap<String, u64>,
    /// Results per second over the run's wall time.
    pub throughput_rps: f64,
    /// Latency percentiles of the requests answered with a result, in milliseconds (`null`
    /// when none was).
    pub p50_ms: Option<f64>,
    /// See `p50_ms`.
    pub p95_ms: Option<f64>,
    /// See `p50_ms`.
    pub p99_ms: Option<f64>,
    /// The latency of the first request (the earliest `t_s`) when it was answered with a
    /// result: against `p50_ms`, whether the server (or a warm-up) left it cold.
    pub first_ms: Option<f64>,
    /// The model's latency target from the server's `Info` (none: no target; overall, the
    /// target when every model has the same one).
    pub slo_ms: Option<u32>,
    /// The share (0 to 1) of the requests with a target that were answered with a result
    /// within it; errors count as misses. `null` when no request has a target.
    pub slo_attainment: Option<f64>,
}

impl LoadStats {
    /// The statistics of `records` over `wall_s` seconds, each record's target given by
    /// `slo_of(model)`.
    pub fn of<'a>(records: impl IntoIterator<Item = &'a RequestRecord>, wall_s: f64, slo_of: impl Fn(usize) -> Option<u32>) -> Self {
        let mut requests = 0;
        let mut latencies = Vec::new();
        let mut first: Option<&RequestRecord> = None;
        let mut errors_by_code = BTreeMap::new();
        let (mut with_target, mut met) = (0u64, 0u64);
        let mut targets = std::collections::BTreeSet::new();
        for r in records {
            requests += 1;
            if first.is_none_or(|f| r.t_s < f.t_s) {
                first = Some(r);
            }
            let slo = slo_of(r.model);
            targets.insert(slo);
            match &r.error {
                None => latencies.push(r.latency_ms.unwrap_or(f64::NAN)),
                Some(code) => *errors_by_code.entry(code.clone()).or_insert(0) += 1,
            }
            if let Some(slo) = slo {
                with_target += 1;
                if r.ok() && r.latency_ms.is_some_and(|ms| ms <= f64::from(slo)) {
                    met += 1;
                }
            }
        }
        latencies.retain(|ms| ms.is_finite());
        let answered = latencies.len() as u64;
        let p = Percentiles::of(&latencies).ok();
        Self {
            requests,
            answered,
            errors: requests - answered,
            errors_by_code,
            throughput_rps: if wall_s > 0.0 { answered as f64 / wall_s } else { 0.0 },
            p50_ms: p.map(|p| p.p50),
            p95_ms: p.map(|p| p.p95),
            p99_ms: p.map(|p| p.p99),
            first_ms: first.filter(|r| r.ok()).and_then(|r| r.latency_ms),
            slo_ms: if targets.len() == 1 { targets.into_iter().next().flatten() } else { None },
            slo_attainment: (with_target > 0).then(|| met as f64 / with_target as f64),
        }
    }
}

/// One model of a load run (one config).
#[derive(Debug, Clone, Serialize)]
pub struct ModelReport {
    /// How tables and `latency.csv` name it: its source and the start of its bundle id.
    pub name: String,
    /// Its bundle id.
    pub bundle_id: String,
    /// Where its model came from.
    pub model_source: String,
    /// The server it was sent to.
    pub server: String,
    /// Edges streaming it.
    pub edges: usize,
    /// The cuts its edges split at.
    pub splits: Vec<usize>,
    /// Samples per request.
    pub batch_size: i64,
    /// Payload codec.
    pub codec: String,
    /// Its requests' statistics.
    #[serde(flatten)]
    pub stats: LoadStats,
    /// Per cut, when its edges split at more than one.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub by_split: Vec<SplitReport>,
}

/// One cut's share of a model's requests.
#[derive(Debug, Clone, Serialize)]
pub struct SplitReport {
    /// The cut.
    pub split: usize,
    /// Edges splitting there.
    pub edges: usize,
    /// Its requests' statistics.
    #[serde(flatten)]
    pub stats: LoadStats,
}

/// `load.json`.
#[derive(Debug, Clone, Serialize)]
pub struct LoadReport {
    /// `closed` or `open`.
    pub mode: &'static str,
    /// Requests per second asked of all edges together (open loop).
    pub rate: Option<f64>,
    /// How long requests were sent, in seconds (`--duration`).
    pub duration_s: f64,
    /// From the start to the last outcome or the end of `duration_s`, whichever is later, in
    /// seconds (the throughputs' denominator).
    pub wall_s: f64,
    /// Edges in all.
    pub edges: usize,
    /// The seed of the arrivals.
    pub seed: u64,
    /// Requests one edge may have unanswered at once (open loop).
    pub in_flight_cap: usize,
    /// Per model, in the order the configs were given.
    pub models: Vec<ModelReport>,
    /// Every request of every model.
    pub overall: LoadStats,
}

impl LoadReport {
    /// The first request against the median, for people: `first request: X ms, p50 Y ms,
    /// first/p50 Z`; none when the first request was not answered.
    pub fn first_request_line(&self) -> Option<String> {
        let (first, p50) = (self.overall.first_ms?, self.overall.p50_ms?);
        Some(format!("first request: {first:.2} ms, p50 {p50:.2} ms, first/p50 {:.2}", first / p50))
    }

    /// The line benches parse, always the last a load run prints:
    /// `load: R req/s, p50 X ms, p99 Y ms, errors E` (`NaN` percentiles when nothing was answered).
    pub fn summary_line(&self) -> String {
        let o = &self.overall;
        format!(
            "load: {:.1} req/s, p50 {:.2} ms, p99 {:.2} ms, errors {}",
            o.throughput_rps,
            o.p50_ms.unwrap_or(f64::NAN),
            o.p99_ms.unwrap_or(f64::NAN),
            o.errors
        )
    }

    /// The table printed for people: a row per model, then the overall row.
    pub fn table(&self) -> Table {
        let mut table = Table::new();
        table.load_preset(UTF8_FULL_CONDENSED);
        table.set_header(["model", "edges", "split(s)", "requests", "req/s", "p50 ms", "p95 ms", "p99 ms", "SLO met", "errors"]);
        let row = |name: &str, edges: usize, splits: &str, s: &LoadStats| {
            let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
            let slo = match (s.slo_attainment, s.slo_ms) {
                (Some(a), Some(slo)) => format!("{:.1}% of {slo} ms", a * 100.0),
                (Some(a), None) => format!("{:.1}%", a * 100.0),
                (None, _) => "-".into(),
            };
            let errors = if s.errors_by_code.is_empty() {
                "0".to_string()
            } else {
                let codes: Vec<String> = s.errors_by_code.iter().map(|(code, n)| format!("{code} {n}")).collect();
                format!("{} ({})", s.errors, codes.join(", "))
            };
            vec![
                name.to_string(),
                edges.to_string(),
                splits.to_string(),
                s.requests.to_string(),
                format!("{:.1}", s.throughput_rps),
                ms(s.p50_ms),
                ms(s.p95_ms),
                ms(s.p99_ms),
                slo,
                errors,
            ]
        };
        for m in &self.models {
            let splits: Vec<String> = m.splits.iter().map(usize::to_string).collect();
            table.add_row(row(&m.name, m.edges, &splits.join(","), &m.stats));
        }
        table.add_row(row("overall", self.edges, "", &self.overall));
        for column in 1..10 {
            if let Some(c) = table.column_mut(column) {
                c.set_cell_alignment(CellAlignment::Right);
            }
        }
        table
    }
}

/// Writes `latency.csv`: the header, then a line per request in `records`' order.
pub fn write_latency_csv(path: &Path, records: &[RequestRecord], models: &[ModelReport]) -> Result<()> {
    let file = std::fs::File::create(path).map_err(|e| HostError::write(path, e))?;
    let mut out = std::io::BufWriter::new(file);
    let mut write = || -> std::io::Result<()> {
        writeln!(out, "{LATENCY_HEADER}")?;
        for r in records {
            // Model names come from the bundle's source: a comma would shift the columns.
            let model = models.get(r.model).map_or_else(|| r.model.to_string(), |m| m.name.replace(',', ";"));
            let latency = r.latency_ms.map_or(String::new(), |ms| format!("{ms:.3}"));
            let result = r.error.as_deref().unwrap_or("ok");
            writeln!(out, "{:.6},{model},{},{},{latency},{result}", r.t_s, r.edge, r.split)?;
        }
        out.flush()
    };
    write().map_err(|e| HostError::write(path, e))
}

/// Writes `load.json`.
pub fn write_json(path: &Path, report: &LoadReport) -> Result<()> {
    let json = serde_json::to_string_pretty(report).map_err(|error| HostError::Json { what: "the load report as JSON", error })?;
    std::fs::write(path, json + "\n").map_err(|e| HostError::write(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(model: usize, latency_ms: Option<f64>, error: Option<&str>) -> RequestRecord {
        RequestRecord { t_s: 0.5, model, edge: 0, split: 3, latency_ms, error: error.map(String::from) }
    }

    #[test]
    fn the_first_request_is_the_earliest_sent_and_counts_only_when_answered() {
        let at = |t_s: f64, ms: f64, error: Option<&str>| RequestRecord { t_s, ..record(0, Some(ms), error) };
        let records = [at(0.2, 4.0, None), at(0.1, 9.0, None), at(0.3, 5.0, None)];
        let s = LoadStats::of(&records, 1.0, |_| None);
        assert_eq!((s.first_ms, s.p50_ms), (Some(9.0), Some(5.0)));
        let report = LoadReport {
            mode: "closed",
            rate: None,
            duration_s: 1.0,
            wall_s: 1.0,
            edges: 1,
            seed: 0,
            in_flight_cap: 64,
            models: Vec::new(),
            overall: s,
        };
        assert_eq!(report.first_request_line().unwrap(), "first request: 9.00 ms, p50 5.00 ms, first/p50 1.80");
        // An error answer first: no first request to compare.
        let s = LoadStats::of(&[at(0.1, 9.0, Some("Internal")), at(0.2, 4.0, None)], 1.0, |_| None);
        assert_eq!(s.first_ms, None);
    }

    #[test]
    fn stats_of_a_hand_made_sample() {
        // Ten answers of 1..=10 ms, one error answer after 3 ms, one dropped without an answer.
        let mut records: Vec<RequestRecord> = (1..=10).map(|ms| record(0, Some(f64::from(ms)), None)).collect();
        records.push(record(0, Some(3.0), Some("ResourceExhausted")));
        records.push(record(0, None, Some("dropped_in_flight_cap")));
        let s = LoadStats::of(&records, 2.0, |_| Some(5));
        assert_eq!((s.requests, s.answered, s.errors), (12, 10, 2));
        assert_eq!(s.errors_by_code.get("ResourceExhausted"), Some(&1));
        assert_eq!(s.errors_by_code.get("dropped_in_flight_cap"), Some(&1));
        assert_eq!(s.throughput_rps, 5.0);
        // Type 7 over 1..=10: the median 5.5, p95 at rank 8.55, p99 at rank 8.91.
        assert_eq!(s.p50_ms, Some(5.5));
        assert!((s.p95_ms.unwrap() - 9.55).abs() < 1e-9 && (s.p99_ms.unwrap() - 9.91).abs() < 1e-9, "{s:?}");
        // Within 5 ms: the answers of 1..=5 ms; the error answer (3 ms) and the dropped request miss.
        assert_eq!(s.slo_ms, Some(5));
        assert_eq!(s.slo_attainment, Some(5.0 / 12.0));
    }

    #[test]
    fn no_target_no_attainment_and_nothing_answered_no_percentiles() {
        let records = [record(0, Some(2.0), None), record(1, None, Some("unanswered"))];
        let s = LoadStats::of(&records, 1.0, |_| None);
        assert_eq!((s.slo_ms, s.slo_attainment), (None, None));
        // Only model 1 has a target: attainment over its requests alone.
        let s = LoadStats::of(&records, 1.0, |m| (m == 1).then_some(10));
        assert_eq!((s.slo_ms, s.slo_attainment), (None, Some(0.0)));
        let s = LoadStats::of(&records[1..], 1.0, |_| None);
        assert_eq!((s.answered, s.p50_ms, s.throughput_rps), (0, None, 0.0));
        let empty = LoadStats::of(&[], 0.0, |_| None);
        assert_eq!((empty.requests, empty.errors), (0, 0));
    }

    #[test]
    fn the_summary_line_keeps_its_format() {
        let records: Vec<RequestRecord> =
            (1..=4).map(|ms| record(0, Some(f64::from(ms)), None)).chain([record(0, None, Some("unanswered"))]).collect();
        let overall = LoadStats::of(&records, 2.0, |_| None);
        let report = LoadReport {
            mode: "closed",
            rate: None,
            duration_s: 2.0,
            wall_s: 2.0,
            edges: 1,
            seed: 0,
            in_flight_cap: 64,
            models: Vec::new(),
            overall,
        };
        assert_eq!(report.summary_line(), "load: 2.0 req/s, p50 2.50 ms, p99 3.97 ms, errors 1");
    }
}
