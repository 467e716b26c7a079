//! The prefix thread: it owns the edge's stages (libtorch modules are not `Sync`), runs each
//! request's prefix and encodes its boundary, one request per go-ahead from the streaming
//! loop (so at most `in_flight` are between their prefix and their outcome). With
//! `fallback: edge` it holds every stage: while no server answers, new requests run wholly
//! here, and requests already encoded come back to have their suffix run here.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::Instant;

use cleave_common::pb::InferFrame;
use cleave_common::wire::{payload_frames, Direction, PayloadMeta, PayloadSender};
use cleave_common::{Boundary, LoadedStages, StageRange};
use prost::Message;
use tokio::sync::mpsc::UnboundedSender;

use super::request::{ms, RequestMetrics, RequestOutcome, ServedBy, StreamPlan};
use crate::config::Fallback;
use crate::cpu_time;
use crate::error::{RequestFailure, Result};

/// What the streaming loop asks of the prefix thread.
pub(super) enum ToPrefix {
    /// One more request may start.
    Go,
    /// Run the rest of a request on the edge: no server answered it.
    Finish(Box<Prepared>),
}

/// What the prefix thread hands the streaming loop.
pub(super) enum Produced {
    /// A request encoded for the server.
    Remote(Prepared),
    /// A request answered on the edge.
    Local(RequestOutcome),
}

/// A request encoded for the server, kept until answered so that it can be resent as it is
/// (or finished on the edge).
pub(super) struct Prepared {
    pub(super) id: u64,
    pub(super) frames: Vec<InferFrame>,
    pub(super) metrics: RequestMetrics,
    pub(super) started: Instant,
    /// The boundary itself, with `fallback: edge`.
    pub(super) boundary: Option<Boundary>,
    /// The request's span, open until its outcome.
    pub(super) span: tracing::Span,
}

/// The prefix thread's ends of its channels.
pub(super) struct PrefixChannels {
    pub(super) asks: Receiver<ToPrefix>,
    pub(super) produced: UnboundedSender<Produced>,
    /// Set while no server answers (with `fallback: edge`): new requests run wholly here.
    pub(super) on_edge: Arc<AtomicBool>,
}

pub(super) fn run_prefixes(mut plan: StreamPlan, mut sender: PayloadSender, chunk_bytes: usize, ch: PrefixChannels) -> Result<()> {
    let fallback = plan.resilience.fallback == Fallback::Edge;
    let edge_stages = if fallback { StageRange::all(&plan.bundle) } else { plan.split.edge_stages(&plan.bundle) };
    let stages = match plan.warm_stages.take() {
        Some(warm) if warm.range().contains(edge_stages) => warm,
        _ => load_warm(&plan, edge_stages)?,
    };
    let last_cut = plan.bundle.stage_count();
    let mut ids = plan.ids.iter().copied();
    // Ends when the streaming loop hangs up: every request has its outcome, or the run stopped.
    while let Ok(ask) = ch.asks.recv() {
        let outcome = match ask {
            ToPrefix::Finish(p) => finish_on_edge(*p, &stages, last_cut),
            ToPrefix::Go => {
                let Some(id) = ids.next() else { continue };
                let split = if ch.on_edge.load(Ordering::Relaxed) { last_cut } else { plan.split.for_request(id) };
                let started = Instant::now();
                let span = tracing::debug_span!("request", request_id = id, model = %plan.bundle.id(), cut = split, codec = tracing::field::Empty);
                let input = plan.inputs.batch(id);
                let input_ms = ms(started);
                let (t, cpu) = (Instant::now(), cpu_time::thread());
                let prefix = tracing::debug_span!(parent: &span, "prefix").entered();
                let boundary = stages.run(StageRange::prefix(split), &input)?;
                drop(prefix);
                let (prefix_ms, prefix_cpu_ms) = (ms(t), (cpu_time::thread() - cpu).as_secs_f64() * 1e3);
                if split == last_cut {
                    let metrics = RequestMetrics {
                        split,
                        input_ms,
                        prefix_ms,
                        prefix_cpu_ms,
                        e2e_ms: ms(started),
                        served_by: ServedBy::Edge,
                        ..Default::default()
                    };
                    Produced::Local(RequestOutcome { request_id: id, metrics, output: Ok(boundary) })
                } else {
                    let t = Instant::now();
                    let encode = tracing::debug_span!(parent: &span, "encode").entered();
                    let meta = PayloadMeta { request_id: id, split: split as u32, direction: Direction::Request };
                    // A boundary kept for `fallback: edge` may be finished here in place: it
                    // is copied; otherwise the wire takes its memory as it is.
                    let codec = plan.codec.for_boundary(split, &boundary)?;
                    let (encoded, boundary) = if fallback {
                        (sender.encode(meta, &codec, &boundary)?, Some(boundary))
                    } else {
                        // SAFETY: the prefix's output is given up here, and an inference
                        // prefix never writes a tensor it has computed.
                        #[allow(unsafe_code)]
                        let encoded = unsafe { sender.encode_owned(meta, &codec, boundary)? };
                        (encoded, None)
                    };
                    let frames: Vec<InferFrame> = payload_frames(id, encoded.envelope, &encoded.data, chunk_bytes);
                    drop(encode);
                    span.record("codec", tracing::field::display(&codec));
                    let metrics = RequestMetrics {
                        split,
                        input_ms,
                        prefix_ms,
                        prefix_cpu_ms,
                        encode_ms: ms(t),
                        bytes_raw: encoded.raw_bytes,
                        copied_sent_bytes: encoded.copied_bytes,
                        codec: Some(codec),
                        bytes_wire: frames.iter().map(|f| f.encoded_len() as u64).sum(),
                        ..Default::default()
                    };
                    Produced::Remote(Prepared { id, frames, metrics, started, boundary, span })
                }
            }
        };
        if ch.produced.send(outcome).is_err() {
            break; // The streaming loop stopped.
        }
    }
    Ok(())
}

/// A request no server answered (`fallback: edge`), its suffix run here from the boundary
/// it kept.
fn finish_on_edge(p: Prepared, stages: &LoadedStages, last_cut: usize) -> Produced {
    let boundary = p.boundary.expect("requests keep their boundary with `fallback: edge`");
    let t = Instant::now();
    let on_edge = tracing::debug_span!(parent: &p.span, "suffix_on_edge", from = p.metrics.split).entered();
    let output = stages.run(StageRange::new(p.metrics.split, last_cut), &boundary).map_err(|e| RequestFailure::OnEdge(Arc::new(e)));
    drop(on_edge);
    let metrics = RequestMetrics { served_by: ServedBy::Edge, suffix_on_edge_ms: ms(t), e2e_ms: ms(p.started), ..p.metrics };
    Produced::Local(RequestOutcome { request_id: p.id, metrics, output })
}

/// Loads `range` and runs it twice on the first request's input: TorchScript optimises a
/// module over its first runs, which take several times longer, and two passes before the
/// first request keep that out of every request's latency.
fn load_warm(plan: &StreamPlan, range: StageRange) -> Result<LoadedStages> {
    let stages = LoadedStages::load(&plan.bundle, range, plan.device)?;
    if let (false, Some(&first)) = (range.is_empty(), plan.ids.first()) {
        let input = plan.inputs.batch(first);
        for _ in 0..2 {
            stages.run(range, &input)?;
        }
    }
    Ok(stages)
}
