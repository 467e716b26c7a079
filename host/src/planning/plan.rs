//! `host plan`: measure the profiles the planner needs (`profile`), then predict every cut;
//! write `plan.json`, the stage graph, and with `--measure N` the plots of every usable cut
//! run for real (N requests, the measured median beside the prediction).

use std::path::PathBuf;

use cleave_client::{connect, ServerSession};
use cleave_common::stats::Percentiles;
use cleave_common::wire::Codec;
use cleave_common::Bundle;
use cleave_tables::human_bytes;
use serde::Serialize;

use super::codec_choice;
use super::fleet::profile::{Cut, EdgeProfile, Stage, StageProfile};
use super::graph::write_stage_graph;
use super::profile::measure_profiles;
use crate::client::{stream_requests, Codecs, RequestMetrics, Splits, StreamPlan};
use crate::config::{EdgeConfig, InputSource};
use crate::error::{HostError, MeasureError, Result};
use crate::files::open_config_bundle;
use crate::inputs::Inputs;
use crate::planner::{best, CutPrediction, Objective, Profiles};
use crate::plots::run::{plot_breakdown, plot_latency_cdf, plot_predicted_vs_measured, CutBreakdown, BREAKDOWN, LATENCY_CDF, PREDICTED_VS_MEASURED};
use crate::report::median_breakdown;

/// One cut as measured by `--measure`: medians of each part, milliseconds.
#[derive(Debug, Clone, Serialize)]
pub struct MeasuredCut {
    /// The cut.
    pub cut: usize,
    /// End to end (p50, p95, p99).
    pub e2e_ms: Percentiles,
    /// The edge's prefix.
    pub edge_ms: f64,
    /// Encoding the boundary.
    pub encode_ms: f64,
    /// The round trip less the server's time.
    pub network_ms: f64,
    /// The server's time (queue, decode, compute, encode).
    pub server_ms: f64,
    /// Decoding the result.
    pub decode_ms: f64,
    /// Every request's end-to-end latency (for the CDF; not in plan.json).
    #[serde(skip)]
    pub e2e_samples: Vec<f64>,
}

/// What `host plan` does.
#[derive(Debug, Clone)]
pub struct PlanOptions {
    /// Start the server in this process.
    pub loopback: bool,
    /// What to optimise.
    pub objective: Objective,
    /// Timed passes per profile.
    pub repeats: usize,
    /// Requests to run at every usable cut to compare with the prediction (0: none).
    pub measure: u64,
    /// Where `plan.json` goes (default: the config's output directory).
    pub output: Option<PathBuf>,
    /// Batch sizes to profile the server's stages at for `host plan --fleet`: with any,
    /// `stage-profile.json` and `edge-profile.json` are written beside `plan.json`.
    pub fleet_profile: Vec<u32>,
}

/// The result of `host plan`, also written to `plan.json`.
#[derive(Debug, Clone, Serialize)]
pub struct PlanReport {
    /// The measured profiles.
    pub profiles: Profiles,
    /// The prediction for every cut.
    pub predictions: Vec<CutPrediction>,
    /// Measured median end-to-end latency per cut (`--measure`), ms.
    pub measured_ms: Vec<Option<f64>>,
    /// Where the time went at each measured cut (`--measure`).
    pub measured: Vec<MeasuredCut>,
    /// The objective.
    pub objective: Objective,
    /// The cut the planner picks.
    pub best: Option<usize>,
}

/// `host plan`'s outcome: the report (in `plan.json`), its table of every cut, and the files
/// written. `Display` gives what the binary prints.
#[derive(Debug, Clone)]
pub struct PlanRun {
    /// What `plan.json` holds.
    pub report: PlanReport,
    /// A line naming the model, batch, codec, server device and link, then the table.
    pub table: String,
    /// `plan.json`.
    pub plan_json: PathBuf,
    /// The stage graph and plots beside it.
    pub written: Vec<PathBuf>,
}

impl std::fmt::Display for PlanRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let written: Vec<String> = self.written.iter().map(|p| p.display().to_string()).collect();
        write!(f, "{}\nplan written to {} (and {})", self.table, self.plan_json.display(), written.join(", "))
    }
}

/// Measures the profiles, predicts every cut and writes `plan.json`, the stage graph and (with
/// `--measure`) the measured plots.
pub async fn plan(config: EdgeConfig, opts: PlanOptions) -> Result<PlanRun> {
    let bundle = open_config_bundle(&config).await?;
    let batch = config.batch_size;
    let loopback = if opts.loopback { Some(crate::loopback::for_inference(&config).await?) } else { None };
    let url = loopback.as_ref().map_or(config.server.clone(), |l| l.url.clone());
    let mut session = connect(&url, &bundle, &config.link()).await?;
    session.check_accepts(&config.codec, config.security.key.as_ref().map(|(id, _)| *id))?;

    let codec_candidates = if config.codec_auto { codec_choice::candidates(&session)? } else { Vec::new() };
    let profiles = measure_profiles(&config, &mut session, &bundle, opts.repeats, &codec_candidates).await?.profiles;
    let fleet_profiles = match opts.fleet_profile.is_empty() {
        true => None,
        false => Some(fleet_profiles(&config, &mut session, &bundle, &profiles, &opts.fleet_profile, opts.repeats).await?),
    };
    let n = bundle.stage_count();
    let predictions = profiles.predict(opts.objective)?;
    let chosen = best(&predictions, opts.objective).map(|p| p.cut);

    let mut measured_ms = vec![None; n + 1];
    let mut measured = Vec::new();
    if opts.measure > 0 {
        let cuts: Vec<usize> = predictions.iter().filter(|p| p.usable).map(|p| p.cut).collect();
        // With `codec: auto`, each request's codec as the plan predicted it (from the same costs).
        let codec = match config.codec_auto {
            true => Codecs::Chosen(std::sync::Arc::new(codec_choice::for_session(&session, Some(&profiles)).await?)),
            false => config.codec.into(),
        };
        measured = measure_cuts(&config, &mut session, &bundle, &cuts, codec, opts.measure).await?;
        for m in &measured {
            measured_ms[m.cut] = Some(m.e2e_ms.p50);
        }
    }
    if let Some(server) = loopback {
        server.shutdown().await?;
    }
    let report = PlanReport { profiles, predictions, measured_ms, measured, objective: opts.objective, best: chosen };
    let table = plan_table(&bundle, &report, &session.model.device, batch, &config.codec);
    let output = opts.output.unwrap_or_else(|| config.output.clone());
    std::fs::create_dir_all(&output).map_err(|error| HostError::Io { action: "cannot create", path: output.clone(), error })?;
    write_json(&output.join("plan.json"), "the plan as JSON", &report)?;
    let (dot, svg) = write_stage_graph(&bundle, report.best, &output).map_err(HostError::Graph)?;
    let mut written = vec![dot];
    if let Some((mut stages, edge)) = fleet_profiles {
        stages.request_ms = request_ms(&report);
        written.push(write_json(&output.join("stage-profile.json"), "a profile as JSON", &stages)?);
        written.push(write_json(&output.join("edge-profile.json"), "a profile as JSON", &edge)?);
    }
    written.extend(svg);
    if !report.measured.is_empty() {
        written.extend(plot_measured(&bundle, &report, &output)?);
    }
    Ok(PlanRun { report, table, plan_json: output.join("plan.json"), written })
}

/// The profiles `host plan --fleet` reads: the server's stages at each of `batches` (the
/// `Profile` RPC), each stage's weights (its parameters, 4 bytes each) and activations (its
/// input and output cuts' bytes a sample), the wire bytes a sample at each cut, and the
/// edge's stages. A fleet's rates count requests of one sample: the config's batch must be 1.
async fn fleet_profiles(
    config: &EdgeConfig,
    session: &mut ServerSession,
    bundle: &Bundle,
    profiles: &Profiles,
    batches: &[u32],
    repeats: usize,
) -> Result<(StageProfile, EdgeProfile)> {
    if config.batch_size != 1 {
        let why = format!("the config's batch_size is {}: it must be 1 (a fleet's rates count requests of one sample)", config.batch_size);
        return Err(HostError::FleetProfile(why));
    }
    let mut batches = batches.to_vec();
    batches.sort_unstable();
    batches.dedup();
    let mut per_batch = Vec::new();
    for &batch_size in &batches {
        let request = session.model_request(cleave_common::pb::ProfileRequest { batch_size, repeats: repeats as u32 });
        let mut client = session.client.clone();
        let stage_ms = client.profile(request).await.map_err(|s| HostError::rpc("Profile", &s))?.into_inner().stage_ms;
        if stage_ms.len() != bundle.stage_count() || stage_ms.iter().any(|ms| !(ms.is_finite() && *ms >= 0.0)) {
            return Err(HostError::FleetProfile(format!(
                "the server's profile at batch {batch_size} is not one time for each of the {} stages",
                bundle.stage_count()
            )));
        }
        per_batch.push(stage_ms);
    }
    let manifest = bundle.manifest();
    let stages = (0..bundle.stage_count())
        .map(|i| Stage {
            ms: per_batch.iter().map(|ms| ms[i]).collect(),
            weight_bytes: manifest.stages[i].parameters as f64 * 4.0,
            activation_bytes: (bundle.cut(i).bytes_per_sample + bundle.cut(i + 1).bytes_per_sample) as f64,
        })
        .collect();
    let batchable = bundle.batchable_cuts();
    let cuts = (0..=bundle.stage_count())
        .map(|k| Cut { usable: profiles.cut_usable[k], batchable: batchable.contains(&k), wire_bytes: profiles.cut_wire_bytes[k] as f64 })
        .collect();
    let device = session.model.device.clone();
    let stages = StageProfile { format: StageProfile::FORMAT.into(), device, batches, stages, cuts, request_ms: 0.0 };
    let edge = EdgeProfile { format: EdgeProfile::FORMAT.into(), device: config.device.to_string(), stage_ms: profiles.edge_stage_ms.clone() };
    Ok((stages, edge))
}

/// The server's own time per request besides its stages, from `--measure`: at each cut
/// measured (the last, where nothing reaches the server, aside), its measured time less its
/// stages' profiled time; the median over the cuts, at least 0; 0 without `--measure`.
fn request_ms(report: &PlanReport) -> f64 {
    let n = report.profiles.stage_count();
    let own: Vec<f64> =
        report.measured.iter().filter(|m| m.cut < n).map(|m| m.server_ms - report.profiles.server_stage_ms[m.cut..].iter().sum::<f64>()).collect();
    cleave_common::stats::median(&own).map_or(0.0, |ms| ms.max(0.0))
}

/// Writes `value` as pretty JSON to `path` (`what` names it in an error).
fn write_json(path: &std::path::Path, what: &'static str, value: &impl Serialize) -> Result<PathBuf> {
    let json = serde_json::to_string_pretty(value).map_err(|error| HostError::Json { what, error })?;
    std::fs::write(path, json + "\n").map_err(|e| HostError::write(path.to_path_buf(), e))?;
    Ok(path.to_path_buf())
}

/// Runs `rounds` requests at every cut of `cuts` on one stream, the cuts interleaved request
/// by request so that a machine that slows down or speeds up treats them alike; one more
/// round first warms up and is left out.
async fn measure_cuts(
    config: &EdgeConfig,
    session: &mut ServerSession,
    bundle: &Bundle,
    cuts: &[usize],
    codec: Codecs,
    rounds: u64,
) -> Result<Vec<MeasuredCut>> {
    let plan = StreamPlan {
        bundle: bundle.clone(),
        split: Splits::RoundRobin(cuts.to_vec()),
        device: config.device,
        warm_stages: None,
        ids: (0..(rounds + 1) * cuts.len() as u64).collect(),
        resilience: config.resilience,
        in_flight: 1,
        inputs: Inputs::new(&InputSource::Synthetic { seed: 0 }, bundle, config.batch_size)?,
        codec,
        key: config.security.key.clone(),
    };
    let mut per_cut: std::collections::BTreeMap<usize, Vec<RequestMetrics>> = cuts.iter().map(|&c| (c, Vec::new())).collect();
    let mut failures = Vec::new();
    stream_requests(session, plan, |o| match o.output {
        Ok(_) if o.request_id >= cuts.len() as u64 => per_cut.entry(o.metrics.split).or_default().push(o.metrics),
        Ok(_) => {}
        Err(e) => failures.push(format!("request {} at cut {}: {e}", o.request_id, o.metrics.split)),
    })
    .await?;
    if let Some(first) = failures.first() {
        return Err(MeasureError::RequestsFailed { failed: failures.len(), first: first.clone() }.into());
    }
    per_cut
        .into_iter()
        .map(|(cut, all)| {
            let all: Vec<&RequestMetrics> = all.iter().collect();
            let b = median_breakdown(cut, &all)?;
            let e2e: Vec<f64> = all.iter().map(|m| m.e2e_ms).collect();
            let e2e_ms = Percentiles::of(&e2e).map_err(|_| MeasureError::NothingAtCut { cut })?;
            Ok(MeasuredCut {
                cut,
                e2e_ms,
                edge_ms: b.edge_ms,
                encode_ms: b.encode_ms,
                network_ms: b.network_ms,
                server_ms: b.server_ms,
                decode_ms: b.decode_ms,
                e2e_samples: e2e,
            })
        })
        .collect()
}

/// The plots of `--measure`: predicted against measured latency, the breakdown per cut, and
/// the latency CDF at the first and last cuts, the predicted best and the measured best.
fn plot_measured(bundle: &Bundle, report: &PlanReport, output: &std::path::Path) -> Result<Vec<PathBuf>> {
    let model = &bundle.manifest().model.source;
    let points: Vec<(usize, f64, f64)> = report.measured.iter().map(|m| (m.cut, report.predictions[m.cut].latency_ms, m.e2e_ms.p50)).collect();
    plot_predicted_vs_measured(&output.join(PREDICTED_VS_MEASURED), &format!("{model}: predicted and measured latency per cut"), &points)?;
    let bars: Vec<CutBreakdown> = report
        .measured
        .iter()
        .map(|m| CutBreakdown {
            cut: m.cut,
            label: m.cut.to_string(),
            edge_ms: m.edge_ms,
            encode_ms: m.encode_ms,
            network_ms: m.network_ms,
            server_ms: m.server_ms,
            decode_ms: m.decode_ms,
        })
        .collect();
    plot_breakdown(&output.join(BREAKDOWN), &format!("{model}: where the time goes at each cut (medians)"), &bars)?;
    let measured_best = report.measured.iter().min_by(|a, b| a.e2e_ms.p50.total_cmp(&b.e2e_ms.p50)).map(|m| m.cut);
    let mut shown: Vec<(usize, &str)> = Vec::new();
    let first = report.measured.first().map(|m| m.cut);
    let last = report.measured.last().map(|m| m.cut);
    for (cut, why) in [(report.best, "planned best"), (measured_best, "measured best"), (first, "first"), (last, "last")] {
        if let Some(cut) = cut.filter(|c| !shown.iter().any(|(s, _)| s == c)) {
            shown.push((cut, why));
        }
    }
    let series: Vec<(String, Vec<f64>)> = shown
        .iter()
        .filter_map(|(cut, why)| report.measured.iter().find(|m| m.cut == *cut).map(|m| (format!("cut {cut} ({why})"), m.e2e_samples.clone())))
        .collect();
    plot_latency_cdf(&output.join(LATENCY_CDF), &format!("{model}: end-to-end latency"), &series)?;
    Ok(vec![output.join(PREDICTED_VS_MEASURED), output.join(BREAKDOWN), output.join(LATENCY_CDF)])
}

fn plan_table(bundle: &Bundle, report: &PlanReport, server_device: &str, batch: i64, codec: &Codec) -> String {
    // Profiles run at the longest sequence; per token is what a shorter one scales by.
    let seq = bundle.sizes_at(batch).seq;
    let wire = |bytes: u64| match seq {
        Some(s) => format!("{} ({:.0} B/sample/token)", human_bytes(bytes), bytes as f64 / (batch * s) as f64),
        None => human_bytes(bytes),
    };
    // The measured column only when `--measure` measured.
    let measured = report.measured_ms.iter().any(Option::is_some);
    let mut table = comfy_table::Table::new();
    table.load_preset(comfy_table::presets::UTF8_FULL_CONDENSED);
    // The codec column only when `codec: auto` chose one per cut.
    let codecs = report.predictions.iter().any(|p| p.codec.is_some());
    let mut header = vec!["cut", "name", "edge ms"];
    header.extend(codecs.then_some("codec"));
    header.extend(["on the wire", "upload ms", "server ms", "predicted ms"]);
    header.extend(measured.then_some("measured ms"));
    header.extend(["req/s", ""]);
    table.set_header(header);
    for p in &report.predictions {
        let mark = match (Some(p.cut) == report.best, p.usable) {
            (true, _) => "<- best",
            (false, false) => "unusable",
            _ => "",
        };
        let mut row = vec![p.cut.to_string(), bundle.cut(p.cut).name.clone(), format!("{:.2}", p.edge_ms)];
        row.extend(codecs.then(|| p.codec.map_or("-".to_string(), |c| c.to_string())));
        row.extend([
            if p.cut == bundle.stage_count() { "-".into() } else { wire(p.upload_bytes) },
            format!("{:.2}", p.upload_ms),
            format!("{:.2}", p.server_ms),
            format!("{:.2}", p.latency_ms),
        ]);
        row.extend(measured.then(|| report.measured_ms[p.cut].map_or("-".to_string(), |m| format!("{m:.2}"))));
        row.extend([format!("{:.1}", p.throughput_rps), mark.into()]);
        table.add_row(row);
    }
    let link = &report.profiles.link;
    format!(
        "{} at batch {batch}{}, codec {codec}; server on {server_device}; link {:.1} Mbit/s, round trip {:.2} ms; objective {}\n{table}",
        bundle.manifest().model.source,
        seq.map_or(String::new(), |s| format!(", sequence length {s}")),
        link.bytes_per_s * 8.0 / 1e6,
        link.rtt_ms,
        report.objective
    )
}
