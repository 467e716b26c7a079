//! The streaming client: runs the prefix of each request on its own thread, streams the
//! boundaries to the server and collects the results, with up to `in_flight` requests
//! travelling at once (the prefix of request i+1 runs while request i is on the wire or on
//! the server).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cleave_common::pb::{self, InferFrame};
use cleave_common::wire::{frame_parts, Codec, CodecPolicy, Direction, FrameAssembler, Key, KeyRing, PayloadMeta, PayloadReceiver, PayloadSender};
use cleave_common::{Boundary, Bundle, DeviceSpec, LoadedStages, StageRange};
use prost::Message;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;

use crate::error::{HostError, Result};
use crate::inputs::Inputs;
use crate::session::EdgeSession;

/// What to send.
pub struct StreamPlan {
    /// The bundle (the server must serve the same id).
    pub bundle: Bundle,
    /// The cut each request is split at.
    pub split: Splits,
    /// Where the prefix runs.
    pub device: DeviceSpec,
    /// Requests to send.
    pub requests: u64,
    /// Requests in flight at once.
    pub in_flight: usize,
    /// Where the input batches come from.
    pub inputs: Inputs,
    /// How boundaries are encoded (results come back the same way).
    pub codec: Codec,
    /// The key payloads are sealed with, if any.
    pub key: Option<(u32, Key)>,
}

/// Which cut each request is split at. A request split at the last cut runs wholly on the
/// edge and never crosses the network.
#[derive(Debug, Clone)]
pub enum Splits {
    /// Always this cut.
    Fixed(usize),
    /// Read when each request's prefix starts (`split: auto`: the planner moves it between
    /// requests on the same stream).
    Moving(Arc<AtomicUsize>),
    /// Request `i` at `cuts[i % cuts.len()]` (`host plan --measure`: every cut under the
    /// same conditions, interleaved).
    RoundRobin(Vec<usize>),
}

impl Splits {
    /// The cut of request `id`.
    pub fn for_request(&self, id: u64) -> usize {
        match self {
            Splits::Fixed(cut) => *cut,
            Splits::Moving(cut) => cut.load(Ordering::Relaxed),
            Splits::RoundRobin(cuts) => cuts[(id % cuts.len().max(1) as u64) as usize],
        }
    }

    /// The stages the edge must hold.
    fn edge_stages(&self, bundle: &Bundle) -> StageRange {
        match self {
            Splits::Fixed(cut) => StageRange::prefix(*cut),
            Splits::Moving(_) => StageRange::all(bundle),
            Splits::RoundRobin(cuts) => StageRange::prefix(cuts.iter().copied().max().unwrap_or(0)),
        }
    }
}

/// The server's own timings for one request, in milliseconds.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct ServerTimes {
    /// Waiting for the compute worker.
    pub queue_ms: f64,
    /// Decoding the boundary.
    pub decode_ms: f64,
    /// Running the suffix.
    pub compute_ms: f64,
    /// Encoding the result.
    pub encode_ms: f64,
}

impl ServerTimes {
    /// Everything the server spent.
    pub fn total_ms(&self) -> f64 {
        self.queue_ms + self.decode_ms + self.compute_ms + self.encode_ms
    }
}

/// Measurements of one request.
#[derive(Debug, Clone, Default)]
pub struct RequestMetrics {
    /// The cut this request was split at.
    pub split: usize,
    /// Running stages [0, split).
    pub prefix_ms: f64,
    /// Encoding the boundary.
    pub encode_ms: f64,
    /// Tensor bytes of the boundary.
    pub bytes_raw: u64,
    /// Bytes of the frames on the wire.
    pub bytes_wire: u64,
    /// From handing the first frame to gRPC until the last result frame arrived.
    pub round_trip_ms: f64,
    /// The server's timings.
    pub server: ServerTimes,
    /// Decoding the result.
    pub decode_ms: f64,
    /// From making the input to having the output.
    pub e2e_ms: f64,
}

/// The answer to one request.
pub struct RequestOutcome {
    /// The request id.
    pub request_id: u64,
    /// Its measurements.
    pub metrics: RequestMetrics,
    /// The boundary at the last cut, or the error.
    pub output: Result<Boundary, String>,
}

struct Sent {
    started: Instant,
    sent_at: Instant,
    metrics: RequestMetrics,
}

/// Sends every request and calls `on_outcome` once per request id, in arrival order.
/// Results are framed by the server's message limit and accepted up to its payload limit.
pub async fn stream_requests(session: &mut EdgeSession, plan: StreamPlan, mut on_outcome: impl FnMut(RequestOutcome)) -> Result<()> {
    session.check_accepts(&plan.codec, plan.key.as_ref().map(|(id, _)| *id))?;
    if plan.in_flight == 0 {
        return Err(HostError::Invalid("in_flight must be at least 1: no request could be sent".into()));
    }
    let ring = KeyRing::new(plan.key.clone()).expect("one key");
    let sender = match &plan.key {
        Some((id, _)) => PayloadSender::sealed(&ring, *id)?,
        None => PayloadSender::plain(),
    };
    // Results must come back sealed when requests go sealed: a stripped seal is refused.
    let policy = CodecPolicy { require_encryption: plan.key.is_some(), ..CodecPolicy::default() };
    let mut results = ResultAssembler {
        receiver: PayloadReceiver::new(Direction::Result, session.max_payload_bytes(), policy, &ring),
        frames: FrameAssembler::default(),
    };
    let chunk_bytes = session.chunk_bytes();
    let (frame_tx, frame_rx) = mpsc::channel::<InferFrame>(64);
    // Requests split at the last cut never leave the edge: their outcomes come this way. At
    // most `in_flight` requests hold a token, so the channel never holds more.
    let (local_tx, mut local_rx) = mpsc::channel::<RequestOutcome>(plan.in_flight);
    let sent: Arc<Mutex<HashMap<u64, Sent>>> = Arc::default();
    let (token_tx, token_rx) = std::sync::mpsc::sync_channel::<()>(plan.in_flight);
    for _ in 0..plan.in_flight {
        token_tx.send(()).expect("fresh channel has room");
    }
    let requests = plan.requests;
    let producer = {
        let sent = Arc::clone(&sent);
        let channels = Outbound { tokens: token_rx, frames: frame_tx, local: local_tx, sent };
        std::thread::Builder::new()
            .name("cleave-prefix".into())
            .spawn(move || produce(plan, sender, chunk_bytes, channels))
            .map_err(|e| HostError::Invalid(format!("cannot start the prefix thread: {e}")))?
    };

    let request = session.stream_request(ReceiverStream::new(frame_rx));
    let mut inbound = session.client.infer(request).await.map_err(|s| HostError::rpc("Infer", &s))?.into_inner();
    let (mut inbound_open, mut local_open) = (true, true);
    let mut answered = 0u64;
    loop {
        let outcome = tokio::select! {
            frame = inbound.next(), if inbound_open => match frame {
                None => {
                    inbound_open = false;
                    continue;
                }
                Some(Err(status)) => {
                    tracing::warn!(%status, "result stream failed");
                    break;
                }
                Some(Ok(frame)) => match results.push(frame, &sent)? {
                    Some(outcome) => outcome,
                    None => continue, // More frames of this result to come.
                },
            },
            local = local_rx.recv(), if local_open => match local {
                None => {
                    local_open = false;
                    continue;
                }
                Some(outcome) => outcome,
            },
            else => break,
        };
        answered += 1;
        let _ = token_tx.send(());
        on_outcome(outcome);
    }
    drop(token_tx);
    let produced = producer.join().map_err(|_| HostError::Invalid("the prefix thread panicked".into()))?;
    // Every request id gets exactly one outcome: one sent but never answered is an error.
    let mut orphans: Vec<(u64, Sent)> = sent.lock().expect("sent map").drain().collect();
    orphans.sort_by_key(|(id, _)| *id);
    for (id, s) in orphans {
        on_outcome(RequestOutcome { request_id: id, metrics: s.metrics, output: Err("no answer: the stream ended".into()) });
    }
    produced?;
    if answered < requests {
        tracing::warn!(answered, requests, "not every request was answered");
    }
    Ok(())
}

/// Reassembles result payloads from their frames and matches them with the sent requests.
struct ResultAssembler {
    receiver: PayloadReceiver,
    frames: FrameAssembler,
}

impl ResultAssembler {
    /// Takes one result frame; returns the request's outcome once its last frame is in. A
    /// result that cannot be reassembled ends the stream: the server broke the framing.
    fn push(&mut self, frame: pb::ResultFrame, sent: &Mutex<HashMap<u64, Sent>>) -> Result<Option<RequestOutcome>> {
        let id = frame.request_id;
        let output = if let Some(err) = &frame.error {
            self.frames.abandon();
            Err(format!("{:?}: {}", tonic::Code::from(err.code), err.message))
        } else {
            let receiver = &self.receiver;
            let assembled = self.frames.push(&frame, |f| receiver.start(f.request_id, &f.header).map(|a| (a, ())));
            let assembly = match assembled {
                Ok(None) => return Ok(None),
                Ok(Some((assembly, ()))) => assembly,
                Err((id, e)) => return Err(HostError::Stream(format!("result of request {id}: {e}"))),
            };
            let t = Instant::now();
            let decoded = self.receiver.finish(assembly).map(|r| r.boundary).map_err(|e| format!("result: {e}"));
            let decode_ms = ms(t);
            if let Some(s) = sent.lock().expect("sent map").get_mut(&id) {
                s.metrics.decode_ms = decode_ms;
                if let Some(t) = frame.timings {
                    s.metrics.server = ServerTimes {
                        queue_ms: t.queue_us as f64 / 1e3,
                        decode_ms: t.decode_us as f64 / 1e3,
                        compute_ms: t.compute_us as f64 / 1e3,
                        encode_ms: t.encode_us as f64 / 1e3,
                    };
                }
            }
            decoded
        };
        let Some(s) = sent.lock().expect("sent map").remove(&id) else {
            return Err(HostError::Stream(format!("the server answered request {id}, which was not sent or was already answered")));
        };
        let mut metrics = s.metrics;
        metrics.round_trip_ms = ms(s.sent_at);
        metrics.e2e_ms = ms(s.started);
        Ok(Some(RequestOutcome { request_id: id, metrics, output }))
    }
}

/// Where the prefix thread sends its work.
struct Outbound {
    /// One per request allowed in flight.
    tokens: std::sync::mpsc::Receiver<()>,
    /// Frames for the server.
    frames: mpsc::Sender<InferFrame>,
    /// Outcomes of requests that ran wholly on the edge.
    local: mpsc::Sender<RequestOutcome>,
    /// Requests sent and not yet answered.
    sent: Arc<Mutex<HashMap<u64, Sent>>>,
}

fn produce(plan: StreamPlan, mut sender: PayloadSender, chunk_bytes: usize, out: Outbound) -> Result<()> {
    let edge_stages = plan.split.edge_stages(&plan.bundle);
    let stages = LoadedStages::load(&plan.bundle, edge_stages, plan.device)?;
    // TorchScript optimises a module over its first runs, which take several times longer:
    // two passes before the first request keep that out of every request's latency.
    if !edge_stages.is_empty() && plan.requests > 0 {
        let input = plan.inputs.batch(0);
        for _ in 0..2 {
            stages.run(edge_stages, &input)?;
        }
    }
    let last_cut = plan.bundle.stage_count();
    for id in 0..plan.requests {
        if out.tokens.recv().is_err() {
            break; // The result side stopped: no more requests.
        }
        let split = plan.split.for_request(id);
        let prefix = StageRange::prefix(split);
        let started = Instant::now();
        let input = plan.inputs.batch(id);
        let t = Instant::now();
        let boundary = stages.run(prefix, &input)?;
        let prefix_ms = ms(t);
        if split == last_cut {
            let metrics = RequestMetrics { split, prefix_ms, e2e_ms: ms(started), ..Default::default() };
            if out.local.blocking_send(RequestOutcome { request_id: id, metrics, output: Ok(boundary) }).is_err() {
                return Ok(()); // The result side stopped.
            }
            continue;
        }
        let t = Instant::now();
        let meta = PayloadMeta { request_id: id, split: split as u32, direction: Direction::Request };
        let encoded = sender.encode(meta, &plan.codec, &boundary)?;
        let frames_out: Vec<InferFrame> = frame_parts(encoded.envelope, &encoded.data, chunk_bytes)
            .into_iter()
            .map(|part| InferFrame { request_id: id, header: part.header, data: part.data, last: part.last })
            .collect();
        let metrics = RequestMetrics {
            split,
            prefix_ms,
            encode_ms: ms(t),
            bytes_raw: encoded.raw_bytes,
            bytes_wire: frames_out.iter().map(|f| f.encoded_len() as u64).sum(),
            ..Default::default()
        };
        out.sent.lock().expect("sent map").insert(id, Sent { started, sent_at: Instant::now(), metrics });
        for frame in frames_out {
            if out.frames.blocking_send(frame).is_err() {
                return Ok(()); // The stream is gone; its requests are reported unanswered.
            }
        }
    }
    Ok(())
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}
