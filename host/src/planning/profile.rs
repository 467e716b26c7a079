//! The profiles the planner needs, measured: the edge's stages and boundaries (on a
//! blocking thread: every stage timed on the edge's device at the configured batch size,
//! and the boundary at every cut encoded with the configured codec, and with each of
//! `codec: auto`'s candidates), the server's stages (the `Profile` RPC), and the link
//! (round trip and bandwidth, with `Echo`).

use std::time::Instant;

use cleave_client::ServerSession;
use cleave_common::stats::median;
use cleave_common::wire::{Codec, CodecPolicy, Direction, KeyRing, PayloadMeta, PayloadReceiver, PayloadSender};
use cleave_common::{Bundle, DeviceSpec, LoadedStages, StageRange};

use tracing::Instrument;

use crate::config::{EdgeConfig, InputSource};
use crate::error::{HostError, MeasureError, ProfileStep, Result};
use crate::inputs::Inputs;
use crate::planner::codec_cost::{CodecCost, CutCodecs};
use crate::planner::{Link, Profiles};
use crate::records::ProfilingTime;

/// The measured profiles, with the edge's stages they ran and how long each part took.
pub(crate) struct Measured {
    /// What the planner plans from.
    pub profiles: Profiles,
    /// Every stage, loaded on the edge's device and run by the profile: warm, so a run can
    /// use them instead of loading and warming them again.
    pub edge_stages: LoadedStages,
    /// The time each part took.
    pub took: ProfilingTime,
}

/// Measures every profile the planner needs: the edge's stages and boundaries (on a
/// blocking thread; each boundary with every one of `codec_candidates` too, for `codec:
/// auto`), the server's stages, the link.
pub(crate) async fn measure_profiles(
    config: &EdgeConfig,
    session: &mut ServerSession,
    bundle: &Bundle,
    repeats: usize,
    codec_candidates: &[Codec],
) -> Result<Measured> {
    let batch = config.batch_size;
    let started = Instant::now();
    let edge = {
        let (bundle, device, codec, candidates) = (bundle.clone(), config.device, config.codec, codec_candidates.to_vec());
        tokio::task::spawn_blocking(move || profile_edge(&bundle, device, batch, &codec, &candidates, repeats))
            .await
            .map_err(|error| HostError::Task { what: "profiling the edge", error })??
    };
    let edge_s = started.elapsed().as_secs_f64();
    let started = Instant::now();
    let request = session.model_request(cleave_common::pb::ProfileRequest { batch_size: batch as u32, repeats: repeats as u32 });
    let mut client = session.client.clone();
    let call = client.profile(request).instrument(tracing::debug_span!("server_profile", batch, repeats));
    let server = call.await.map_err(|s| HostError::rpc("Profile", &s))?.into_inner();
    let server_s = started.elapsed().as_secs_f64();
    let started = Instant::now();
    let link = probe_link(session).await?;
    let took = ProfilingTime { edge_s, server_s, link_s: started.elapsed().as_secs_f64() };
    let n = bundle.stage_count();
    let profiles = Profiles {
        edge_stage_ms: edge.stage_ms,
        server_stage_ms: server.stage_ms,
        cut_wire_bytes: edge.cut_wire_bytes[..=n].to_vec(),
        cut_usable: (0..=n).map(|k| bundle.cut(k).usable).collect(),
        result_wire_bytes: edge.cut_wire_bytes[n],
        codec_ms_per_mib: edge.codec_ms_per_mib,
        link,
        codec_choices: edge.codec_choices,
    };
    Ok(Measured { profiles, edge_stages: edge.stages, took })
}

/// Passes of each candidate codec over each boundary (the median counts).
const CODEC_REPEATS: usize = 3;

/// The edge's part of the profile.
struct EdgeProfile {
    stage_ms: Vec<f64>,
    /// Bytes on the wire at every cut `0..=N` with the codec.
    cut_wire_bytes: Vec<u64>,
    codec_ms_per_mib: f64,
    /// Each candidate measured at every cut `0..=N` (none without candidates).
    codec_choices: Vec<CutCodecs>,
    /// The stages profiled.
    stages: LoadedStages,
}

fn profile_edge(bundle: &Bundle, device: DeviceSpec, batch: i64, codec: &Codec, candidates: &[Codec], repeats: usize) -> Result<EdgeProfile> {
    let stages = LoadedStages::load(bundle, StageRange::all(bundle), device)?;
    let input = Inputs::new(&InputSource::Synthetic { seed: 0 }, bundle, batch)?.batch(0);
    let mut cut_wire_bytes = vec![0u64; bundle.stage_count() + 1];
    let mut codec_choices = Vec::new();
    let (mut codec_ms, mut codec_bytes) = (0.0f64, 0u64);
    let mut failure = None;
    let stage_ms = stages.profile(&input, repeats, |cut, boundary| {
        let started = Instant::now();
        let encoded = PayloadSender::plain().encode(PayloadMeta { request_id: 0, split: cut as u32, direction: Direction::Request }, codec, boundary);
        match encoded {
            Ok(e) => {
                let mut receiver = PayloadReceiver::new(Direction::Request, u64::MAX, CodecPolicy::default(), &KeyRing::default());
                let decoded = receiver.start(0, &e.envelope).and_then(|mut a| {
                    a.push_data(0, &e.data)?;
                    receiver.finish(a)
                });
                if let Err(error) = decoded {
                    failure.get_or_insert(MeasureError::Boundaries { cut, step: ProfileStep::Decoding, error: Box::new(error) });
                }
                codec_ms += started.elapsed().as_secs_f64() * 1e3;
                codec_bytes += boundary.tensor_bytes() as u64;
                cut_wire_bytes[cut] = (e.envelope.len() + e.data.len()) as u64;
            }
            Err(error) => {
                failure.get_or_insert(MeasureError::Boundaries { cut, step: ProfileStep::Encoding(*codec), error: Box::new(error) });
            }
        }
        if !candidates.is_empty() {
            match CodecCost::measure_all(candidates, boundary, CODEC_REPEATS) {
                Ok(costs) => codec_choices.push(CutCodecs { tensor_bytes: boundary.tensor_bytes() as u64, costs }),
                Err(error) => {
                    failure.get_or_insert(MeasureError::Boundaries { cut, step: ProfileStep::AutoCandidates, error: Box::new(error) });
                }
            }
        }
    })?;
    if let Some(failure) = failure {
        return Err(failure.into());
    }
    let mib = codec_bytes as f64 / (1u64 << 20) as f64;
    Ok(EdgeProfile { stage_ms, cut_wire_bytes, codec_ms_per_mib: if mib > 0.0 { codec_ms / mib } else { 0.0 }, codec_choices, stages })
}

/// Round-trip time (median of empty echoes) and upload bandwidth: a first echo of 64 KiB
/// gives a rough figure, which sizes the probes so that the largest takes about a quarter
/// of a second whatever the link (at most 4 MiB, within the server's message limit); echoes of a quarter,
/// half and all of that size, three each, then give the bandwidth as the inverse slope of
/// time against size (least squares over each size's median), which the round trip and
/// any fixed cost per call do not bias.
pub(crate) async fn probe_link(session: &ServerSession) -> Result<Link> {
    let max_message = session.server.limits.max_message_bytes;
    let echo = |size: usize| {
        let mut client = session.client.clone();
        async move {
            let started = Instant::now();
            client
                .echo(cleave_common::pb::EchoRequest { payload: bytes::Bytes::from(vec![0u8; size]), reply_bytes: 0 })
                .instrument(tracing::debug_span!("link_probe", bytes = size))
                .await
                .map_err(|s| HostError::rpc("Echo", &s))?;
            Ok::<_, HostError>(started.elapsed().as_secs_f64() * 1e3)
        }
    };
    // Eleven and three samples: never empty.
    let median = |v: Vec<f64>| median(&v).unwrap_or(f64::NAN);
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
