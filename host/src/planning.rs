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

use crate::client::{check_server_accepts, connect, stream_requests, Client, Link as LinkConfig, StreamPlan};
use crate::inputs::Inputs;
use crate::report::Percentiles;

/// The plot of predicted against measured latency (`--measure`).
pub const PREDICTED_VS_MEASURED: &str = "predicted_vs_measured.svg";

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
    if opts.measure > 0 {
        for p in predictions.iter().filter(|p| p.usable) {
            let plan = StreamPlan {
                bundle: bundle.clone(),
                split: p.cut,
                device: config.device,
                requests: opts.measure + 1,
                in_flight: 1,
                inputs: Inputs::new(&cleave_common::config::InputSource::Synthetic { seed: 0 }, &bundle, batch)?,
                max_payload_bytes: config.loopback_limits.max_payload_bytes,
                codec: config.codec,
                key: config.security.key.clone(),
                split_source: None,
            };
            let mut e2e = Vec::new();
            stream_requests(&mut client, &info, plan, |o| {
                // The first request warms up; failures are left out.
                if o.request_id > 0 && o.output.is_ok() {
                    e2e.push(o.metrics.e2e_ms);
                }
            })
            .await?;
            measured_ms[p.cut] = (!e2e.is_empty()).then(|| Percentiles::of(&e2e).p50);
        }
    }
    if let Some(server) = loopback {
        server.shutdown().await?;
    }
    let report = PlanReport { profiles, predictions, measured_ms, objective: opts.objective, best: chosen };
    print_plan(&bundle, &report, &info.device, batch, &config.codec);
    let output = opts.output.unwrap_or_else(|| config.output.clone());
    std::fs::create_dir_all(&output)?;
    std::fs::write(output.join("plan.json"), serde_json::to_string_pretty(&report)? + "\n")?;
    let (dot, svg) = cleave_common::graph::write_stage_graph(&bundle, report.best, &output)?;
    let measured: Vec<(usize, f64, f64)> =
        report.predictions.iter().filter_map(|p| report.measured_ms[p.cut].map(|m| (p.cut, p.latency_ms, m))).collect();
    if !measured.is_empty() {
        let title = format!("{}: predicted and measured latency per cut", bundle.manifest().model.source);
        crate::pictures::plot_predicted_vs_measured(&output.join(PREDICTED_VS_MEASURED), &title, &measured)?;
    }
    println!(
        "plan written to {} (and {}{}{})",
        output.join("plan.json").display(),
        dot.display(),
        svg.map_or(String::new(), |s| format!(", {}", s.display())),
        if measured.is_empty() { String::new() } else { format!(", {}", output.join(PREDICTED_VS_MEASURED).display()) }
    );
    Ok(report)
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

/// Round-trip time (median of empty echoes) and bandwidth (the largest echo that fits a
/// message, both ways: 2 x size over its time less the round trip).
async fn probe_link(client: &mut Client, max_message: u64) -> anyhow::Result<Link> {
    let echo = |size: usize| {
        let mut client = client.clone();
        async move {
            let started = Instant::now();
            client
                .echo(cleave_common::pb::EchoRequest { payload: bytes::Bytes::from(vec![0u8; size]), reply_bytes: size as u64 })
                .await
                .map_err(|s| anyhow::anyhow!("Echo: {:?}: {}", s.code(), s.message()))?;
            anyhow::Ok(started.elapsed().as_secs_f64() * 1e3)
        }
    };
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mut empty = Vec::new();
    for _ in 0..11 {
        empty.push(echo(0).await?);
    }
    let rtt_ms = median(empty);
    let size = ((max_message.saturating_sub(4096)).min(4 << 20)) as usize;
    let mut full = Vec::new();
    for _ in 0..5 {
        full.push(echo(size).await?);
    }
    let moving_ms = (median(full) - rtt_ms).max(1e-3);
    Ok(Link { bytes_per_s: 2.0 * size as f64 / moving_ms * 1e3, rtt_ms })
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
