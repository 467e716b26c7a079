//! `host plan`: measure the profiles the planner needs, then predict every cut.
//!
//! - the edge: every stage timed on the edge's device at the configured batch size, and the
//!   boundary at every cut encoded with the configured codec (bytes on the wire, and the
//!   codec's time per MiB);
//! - the server: its per-stage times through the `Profile` RPC;
//! - the link: round-trip time and bandwidth probed with the `Echo` RPC over several sizes.
//!
//! With `--measure N` every usable cut is also run for real (N requests) and the measured
//! median end-to-end latency is printed beside the prediction.

use std::path::PathBuf;
use std::time::Instant;

use cleave_common::config::EdgeConfig;
use cleave_common::planner::{best, CutPrediction, Link, Objective, Profiles};
use cleave_common::tables::human_bytes;
use cleave_common::wire::{Codec, CodecPolicy, Direction, KeyRing, PayloadMeta, PayloadReceiver, PayloadSender};
use cleave_common::{Bundle, LoadedStages, StageRange};
use serde::Serialize;

use crate::client::{check_server_accepts, connect, stream_requests, Client, Link as LinkConfig, RequestMetrics, Splits, StreamPlan};
use crate::pictures::CutBreakdown;
use crate::inputs::Inputs;
use crate::report::{median_breakdown, Percentiles};

pub use crate::pictures::{BREAKDOWN, LATENCY_CDF, PREDICTED_VS_MEASURED};

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

/// Measures the profiles and prints the table of every cut.
pub async fn plan(config: EdgeConfig, opts: PlanOptions) -> anyhow::Result<PlanReport> {
    let bundle = Bundle::open(&config.bundle)?;
    let batch = config.batch_size;
    let loopback = if opts.loopback {
        Some(crate::LoopbackServer::start_secured(&config.bundle, config.loopback_device, config.loopback_limits, config.loopback_security()).await?)
    } else {
        None
    };
    let url = loopback.as_ref().map_or(config.server.clone(), |l| l.url.clone());
    let max_message = config.loopback_limits.max_message_bytes;
    let (mut client, info) = connect(&url, &bundle, &LinkConfig::secured(max_message as usize, &config.security)).await?;
    check_server_accepts(&info, &config.codec, config.security.key.as_ref().map(|(id, _)| *id))?;

    let profiles = measure_profiles(&config, &mut client, &bundle, opts.repeats).await?;
    let n = bundle.stage_count();
    let predictions = profiles.predict()?;
    let chosen = best(&predictions, opts.objective).map(|p| p.cut);

    let mut measured_ms = vec![None; n + 1];
    let mut measured = Vec::new();
    if opts.measure > 0 {
        let cuts: Vec<usize> = predictions.iter().filter(|p| p.usable).map(|p| p.cut).collect();
        measured = measure_cuts(&config, &mut client, &info, &bundle, &cuts, opts.measure).await?;
        for m in &measured {
            measured_ms[m.cut] = Some(m.e2e_ms.p50);
        }
    }
    if let Some(server) = loopback {
        server.shutdown().await?;
    }
    let report = PlanReport { profiles, predictions, measured_ms, measured, objective: opts.objective, best: chosen };
    print_plan(&bundle, &report, &info.device, batch, &config.codec);
    let output = opts.output.unwrap_or_else(|| config.output.clone());
    std::fs::create_dir_all(&output)?;
    std::fs::write(output.join("plan.json"), serde_json::to_string_pretty(&report)? + "\n")?;
    let (dot, svg) = cleave_common::graph::write_stage_graph(&bundle, report.best, &output)?;
    let mut written = vec![dot];
    written.extend(svg);
    if !report.measured.is_empty() {
        written.extend(plot_measured(&bundle, &report, &output)?);
    }
    let written: Vec<String> = written.iter().map(|p| p.display().to_string()).collect();
    println!("plan written to {} (and {})", output.join("plan.json").display(), written.join(", "));
    Ok(report)
}

/// Runs `rounds` requests at every cut of `cuts` on one stream, the cuts interleaved request
/// by request so that a machine that slows down or speeds up treats them alike; one more
/// round first warms up and is left out.
async fn measure_cuts(
    config: &EdgeConfig,
    client: &mut Client,
    info: &cleave_common::pb::InfoReply,
    bundle: &Bundle,
    cuts: &[usize],
    rounds: u64,
) -> anyhow::Result<Vec<MeasuredCut>> {
    let plan = StreamPlan {
        bundle: bundle.clone(),
        split: Splits::RoundRobin(cuts.to_vec()),
        device: config.device,
        requests: (rounds + 1) * cuts.len() as u64,
        in_flight: 1,
        inputs: Inputs::new(&cleave_common::config::InputSource::Synthetic { seed: 0 }, bundle, config.batch_size)?,
        max_payload_bytes: config.loopback_limits.max_payload_bytes,
        codec: config.codec,
        key: config.security.key.clone(),
    };
    let mut per_cut: std::collections::BTreeMap<usize, Vec<RequestMetrics>> = cuts.iter().map(|&c| (c, Vec::new())).collect();
    let mut failures = Vec::new();
    stream_requests(client, info, plan, |o| match o.output {
        Ok(_) if o.request_id >= cuts.len() as u64 => per_cut.entry(o.metrics.split).or_default().push(o.metrics),
        Ok(_) => {}
        Err(e) => failures.push(format!("request {} at cut {}: {e}", o.request_id, o.metrics.split)),
    })
    .await?;
    if let Some(first) = failures.first() {
        anyhow::bail!("measuring the cuts: {} of the requests failed, the first: {first}", failures.len());
    }
    Ok(per_cut
        .into_iter()
        .map(|(cut, all)| {
            let all: Vec<&RequestMetrics> = all.iter().collect();
            let b = median_breakdown(cut, &all);
            MeasuredCut {
                cut,
                e2e_ms: Percentiles::of(&all.iter().map(|m| m.e2e_ms).collect::<Vec<_>>()),
                edge_ms: b.edge_ms,
                encode_ms: b.encode_ms,
                network_ms: b.network_ms,
                server_ms: b.server_ms,
                decode_ms: b.decode_ms,
                e2e_samples: all.iter().map(|m| m.e2e_ms).collect(),
            }
        })
        .collect())
}

/// The plots of `--measure`: predicted against measured latency, the breakdown per cut, and
/// the latency CDF at the first and last cuts, the predicted best and the measured best.
fn plot_measured(bundle: &Bundle, report: &PlanReport, output: &std::path::Path) -> anyhow::Result<Vec<PathBuf>> {
    let model = &bundle.manifest().model.source;
    let points: Vec<(usize, f64, f64)> =
        report.measured.iter().map(|m| (m.cut, report.predictions[m.cut].latency_ms, m.e2e_ms.p50)).collect();
    crate::pictures::plot_predicted_vs_measured(&output.join(PREDICTED_VS_MEASURED), &format!("{model}: predicted and measured latency per cut"), &points)?;
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
    crate::pictures::plot_breakdown(&output.join(BREAKDOWN), &format!("{model}: where the time goes at each cut (medians)"), &bars)?;
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
    crate::pictures::plot_latency_cdf(&output.join(LATENCY_CDF), &format!("{model}: end-to-end latency"), &series)?;
    Ok(vec![output.join(PREDICTED_VS_MEASURED), output.join(BREAKDOWN), output.join(LATENCY_CDF)])
}

/// Measures every profile the planner needs: the edge's stages and boundaries (on a
/// blocking thread), the server's stages, the link.
pub(crate) async fn measure_profiles(config: &EdgeConfig, client: &mut Client, bundle: &Bundle, repeats: usize) -> anyhow::Result<Profiles> {
    let batch = config.batch_size;
    let edge = {
        let (bundle, device, codec) = (bundle.clone(), config.device, config.codec);
        tokio::task::spawn_blocking(move || profile_edge(&bundle, device, batch, &codec, repeats)).await??
    };
    let server = client
        .profile(cleave_common::pb::ProfileRequest { batch_size: batch as u32, repeats: repeats as u32 })
        .await
        .map_err(|s| anyhow::anyhow!("Profile: {:?}: {}", s.code(), s.message()))?
        .into_inner();
    let link = probe_link(client, config.loopback_limits.max_message_bytes).await?;
    let n = bundle.stage_count();
    Ok(Profiles {
        edge_stage_ms: edge.stage_ms,
        server_stage_ms: server.stage_ms,
        cut_wire_bytes: edge.cut_wire_bytes[..=n].to_vec(),
        cut_usable: (0..=n).map(|k| bundle.cut(k).usable).collect(),
        result_wire_bytes: edge.cut_wire_bytes[n],
        codec_ms_per_mib: edge.codec_ms_per_mib,
        link,
    })
}

/// The edge's part of the profile.
struct EdgeProfile {
    stage_ms: Vec<f64>,
    /// Bytes on the wire at every cut `0..=N` with the codec.
    cut_wire_bytes: Vec<u64>,
    codec_ms_per_mib: f64,
}

fn profile_edge(bundle: &Bundle, device: cleave_common::DeviceSpec, batch: i64, codec: &Codec, repeats: usize) -> anyhow::Result<EdgeProfile> {
    let stages = LoadedStages::load(bundle, StageRange::all(bundle), device)?;
    let input = Inputs::new(&cleave_common::config::InputSource::Synthetic { seed: 0 }, bundle, batch)?.batch(0);
    let mut cut_wire_bytes = vec![0u64; bundle.stage_count() + 1];
    let (mut codec_ms, mut codec_bytes) = (0.0f64, 0u64);
    let mut failure = None;
    let stage_ms = stages.profile(&input, repeats, |cut, boundary| {
        let started = Instant::now();
        let encoded = PayloadSender::plain().encode(PayloadMeta { request_id: 0, split: cut as u32, direction: Direction::Request }, codec, boundary);
        match encoded {
            Ok(e) => {
                let mut receiver = PayloadReceiver::new(Direction::Request, u64::MAX, CodecPolicy::default(), &KeyRing::default());
                let decoded = receiver.start(0, &e.envelope).and_then(|mut a| {
                    a.push(0, &e.data)?;
                    receiver.finish(a)
                });
                if let Err(err) = decoded {
                    failure.get_or_insert(format!("cut {cut}: decoding: {err}"));
                }
                codec_ms += started.elapsed().as_secs_f64() * 1e3;
                codec_bytes += boundary.tensor_bytes() as u64;
                cut_wire_bytes[cut] = (e.envelope.len() + e.data.len()) as u64;
            }
            Err(err) => {
                failure.get_or_insert(format!("cut {cut}: encoding with {codec}: {err}"));
            }
        }
    })?;
    if let Some(f) = failure {
        anyhow::bail!("profiling the boundaries: {f}");
    }
    let mib = codec_bytes as f64 / (1u64 << 20) as f64;
    Ok(EdgeProfile { stage_ms, cut_wire_bytes, codec_ms_per_mib: if mib > 0.0 { codec_ms / mib } else { 0.0 } })
}

/// Round-trip time (median of empty echoes) and upload bandwidth: a first echo of 64 KiB
/// gives a rough figure, which sizes the probes so that the largest takes about a quarter
/// of a second whatever the link (at most the message limit, 4 MiB); echoes of a quarter,
/// half and all of that size, three each, then give the bandwidth as the inverse slope of
/// time against size (least squares over each size's median), which the round trip and
/// any fixed cost per call do not bias.
async fn probe_link(client: &mut Client, max_message: u64) -> anyhow::Result<Link> {
    let echo = |size: usize| {
        let mut client = client.clone();
        async move {
            let started = Instant::now();
            client
                .echo(cleave_common::pb::EchoRequest { payload: bytes::Bytes::from(vec![0u8; size]), reply_bytes: 0 })
                .await
                .map_err(|s| anyhow::anyhow!("Echo: {:?}: {}", s.code(), s.message()))?;
            anyhow::Ok(started.elapsed().as_secs_f64() * 1e3)
        }
    };
    let median = |v: Vec<f64>| Percentiles::of(&v).p50;
    let mut empty = Vec::new();
    for _ in 0..11 {
        empty.push(echo(0).await?);
    }
    let rtt_ms = median(empty);
    let cap = max_message.saturating_sub(4096).min(4 << 20) as usize;
    let first = (64usize << 10).min(cap);
    let rough_bytes_per_ms = first as f64 / (echo(first).await? - rtt_ms).max(1e-3);
    let size = ((rough_bytes_per_ms * 250.0) as usize).clamp(first, cap);
    let mut points = Vec::new();
    for share in [4, 2, 1] {
        let mut times = Vec::new();
        for _ in 0..3 {
            times.push(echo(size / share).await?);
        }
        points.push(((size / share) as f64, median(times)));
    }
    let ms_per_byte = slope(&points).filter(|s| *s > 0.0).unwrap_or_else(|| {
        // Times that do not grow with size (a link much faster than the calls): the largest alone.
        let (bytes, ms) = points[points.len() - 1];
        (ms - rtt_ms).max(1e-3) / bytes
    });
    Ok(Link { bytes_per_s: 1e3 / ms_per_byte, rtt_ms })
}

/// The least-squares slope of `y` against `x`; `None` when every `x` is the same.
fn slope(points: &[(f64, f64)]) -> Option<f64> {
    let n = points.len() as f64;
    let (mx, my) = points.iter().fold((0.0, 0.0), |(a, b), (x, y)| (a + x / n, b + y / n));
    let (sxy, sxx) = points.iter().fold((0.0, 0.0), |(a, b), (x, y)| (a + (x - mx) * (y - my), b + (x - mx) * (x - mx)));
    (sxx > 0.0).then(|| sxy / sxx)
}

fn print_plan(bundle: &Bundle, report: &PlanReport, server_device: &str, batch: i64, codec: &Codec) {
    let mut table = comfy_table::Table::new();
    table.load_preset(comfy_table::presets::UTF8_FULL_CONDENSED);
    table.set_header(vec!["cut", "name", "edge ms", "on the wire", "upload ms", "server ms", "predicted ms", "measured ms", "req/s", ""]);
    for p in &report.predictions {
        let mark = match (Some(p.cut) == report.best, p.usable) {
            (true, _) => "<- best",
            (false, false) => "unusable",
            _ => "",
        };
        table.add_row(vec![
            p.cut.to_string(),
            bundle.cut(p.cut).name.clone(),
            format!("{:.2}", p.edge_ms),
            if p.cut == bundle.stage_count() { "-".into() } else { human_bytes(report.profiles.cut_wire_bytes[p.cut]) },
            format!("{:.2}", p.upload_ms),
            format!("{:.2}", p.server_ms),
            format!("{:.2}", p.latency_ms),
            report.measured_ms[p.cut].map_or(String::new(), |m| format!("{m:.2}")),
            format!("{:.1}", p.throughput_rps),
            mark.into(),
        ]);
    }
    let link = &report.profiles.link;
    println!(
        "{} at batch {batch}, codec {codec}; server on {server_device}; link {:.1} Mbit/s, round trip {:.2} ms; objective {:?}",
        bundle.manifest().model.source,
        link.bytes_per_s * 8.0 / 1e6,
        link.rtt_ms,
        report.objective
    );
    println!("{table}");
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_slope_of_time_against_size_is_the_inverse_bandwidth() {
        // 1 ms round trip plus 1 ms per 125 kB (1 Gbit/s).
        let points: Vec<(f64, f64)> = [62_500.0, 125_000.0, 250_000.0].iter().map(|&b| (b, 1.0 + b / 125_000.0)).collect();
        assert!((super::slope(&points).unwrap() - 1.0 / 125_000.0).abs() < 1e-15);
        assert_eq!(super::slope(&[(5.0, 1.0), (5.0, 2.0)]), None);
    }
}
