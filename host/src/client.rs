//! The streaming client: runs the prefix of each request on its own thread, streams the
//! boundaries to the server and collects the results, with up to `in_flight` requests
//! travelling at once (the prefix of request i+1 runs while request i is on the wire or on
//! the server).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cleave_common::pb::split_inference_client::SplitInferenceClient;
use cleave_common::pb::{self, InferFrame};
use cleave_common::wire::{chunk_bytes_for, chunks, encode_boundary, Reassembly};
use cleave_common::{Boundary, Bundle, DeviceSpec, LoadedStages, StageRange};
use prost::Message;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::transport::{Channel, Endpoint};

use crate::inputs::Inputs;

/// What to send.
pub struct StreamPlan {
    /// The bundle (the server must serve the same id).
    pub bundle: Bundle,
    /// The cut to split at.
    pub split: usize,
    /// Where the prefix runs.
    pub device: DeviceSpec,
    /// Requests to send.
    pub requests: u64,
    /// Requests in flight at once.
    pub in_flight: usize,
    /// Where the input batches come from.
    pub inputs: Inputs,
    /// Largest result payload accepted from the server.
    pub max_payload_bytes: u64,
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

/// Connects to `url` and checks that the server serves `bundle`.
pub async fn connect(url: &str, bundle: &Bundle, max_message: usize) -> anyhow::Result<(SplitInferenceClient<Channel>, pb::InfoReply)> {
    let channel = Endpoint::from_shared(url.to_string())?
        .initial_stream_window_size(Some(8 << 20))
        .initial_connection_window_size(Some(32 << 20))
        .connect()
        .await
        .map_err(|e| anyhow::anyhow!("cannot connect to {url}: {e}"))?;
    let mut client = SplitInferenceClient::new(channel).max_decoding_message_size(max_message).max_encoding_message_size(max_message);
    let info = client.info(pb::InfoRequest {}).await?.into_inner();
    if info.bundle_id != bundle.id() {
        anyhow::bail!(
            "bundle mismatch: this host has {} ({}), the server at {url} serves {} ({})",
            bundle.id(),
            bundle.manifest().model.source,
            info.bundle_id,
            info.model_source
        );
    }
    Ok((client, info))
}

/// Sends every request and calls `on_outcome` once per request id, in arrival order.
pub async fn stream_requests(
    client: &mut SplitInferenceClient<Channel>,
    info: &pb::InfoReply,
    plan: StreamPlan,
    mut on_outcome: impl FnMut(RequestOutcome),
) -> anyhow::Result<()> {
    let limits = info.limits.unwrap_or_default();
    let chunk_bytes = chunk_bytes_for(limits.max_message_bytes);
    let (frame_tx, frame_rx) = mpsc::channel::<InferFrame>(64);
    let sent: Arc<Mutex<HashMap<u64, Sent>>> = Arc::default();
    let (token_tx, token_rx) = std::sync::mpsc::sync_channel::<()>(plan.in_flight);
    for _ in 0..plan.in_flight {
        token_tx.send(()).expect("fresh channel has room");
    }
    let max_payload = plan.max_payload_bytes;
    let requests = plan.requests;
    let producer = {
        let sent = Arc::clone(&sent);
        std::thread::Builder::new().name("cleave-prefix".into()).spawn(move || produce(plan, chunk_bytes, token_rx, frame_tx, sent))?
    };

    let mut request = tonic::Request::new(ReceiverStream::new(frame_rx));
    request.metadata_mut().insert(cleave_server::BUNDLE_ID_METADATA, info.bundle_id.parse()?);
    let mut inbound = client.infer(request).await?.into_inner();
    let mut current: Option<Reassembly> = None;
    let mut answered = 0u64;
    while let Some(frame) = inbound.next().await {
        let frame = match frame {
            Ok(f) => f,
            Err(status) => {
                tracing::warn!(%status, "result stream failed");
                break;
            }
        };
        let id = frame.request_id;
        let output = if let Some(err) = &frame.error {
            current = None;
            Err(format!("{:?}: {}", tonic::Code::from(err.code), err.message))
        } else {
            let mut assembly = match current.take() {
                Some(a) => a,
                None => Reassembly::start(id, frame.header.clone(), max_payload)?,
            };
            assembly.push(id, &frame.data)?;
            if !frame.last {
                current = Some(assembly);
                continue;
            }
            let t = Instant::now();
            let decoded = assembly.finish().map_err(|e| format!("result: {e}"));
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
            anyhow::bail!("the server answered request {id}, which was not sent or was already answered");
        };
        let mut metrics = s.metrics;
        metrics.round_trip_ms = ms(s.sent_at);
        metrics.e2e_ms = ms(s.started);
        answered += 1;
        let _ = token_tx.send(());
        on_outcome(RequestOutcome { request_id: id, metrics, output });
    }
    drop(token_tx);
    let produced = producer.join().map_err(|_| anyhow::anyhow!("the prefix thread panicked"))?;
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

fn produce(
    plan: StreamPlan,
    chunk_bytes: usize,
    tokens: std::sync::mpsc::Receiver<()>,
    frames: mpsc::Sender<InferFrame>,
    sent: Arc<Mutex<HashMap<u64, Sent>>>,
) -> anyhow::Result<()> {
    let prefix = StageRange::prefix(plan.split);
    let stages = LoadedStages::load(&plan.bundle, prefix, plan.device)?;
    for id in 0..plan.requests {
        if tokens.recv().is_err() {
            break; // The result side stopped: no more requests.
        }
        let started = Instant::now();
        let input = plan.inputs.batch(id);
        let t = Instant::now();
        let boundary = stages.run(prefix, &input)?;
        let prefix_ms = ms(t);
        let t = Instant::now();
        let encoded = encode_boundary(&boundary);
        let parts = chunks(&encoded.data, chunk_bytes);
        let last = parts.len() - 1;
        let mut header = Some(encoded.header);
        let frames_out: Vec<InferFrame> = parts
            .into_iter()
            .enumerate()
            .map(|(i, data)| InferFrame { request_id: id, split: plan.split as u32, header: header.take(), data, last: i == last })
            .collect();
        let metrics = RequestMetrics {
            prefix_ms,
            encode_ms: ms(t),
            bytes_raw: encoded.data.len() as u64,
            bytes_wire: frames_out.iter().map(|f| f.encoded_len() as u64).sum(),
            ..Default::default()
        };
        sent.lock().expect("sent map").insert(id, Sent { started, sent_at: Instant::now(), metrics });
        for frame in frames_out {
            if frames.blocking_send(frame).is_err() {
                return Ok(()); // The stream is gone; its requests are reported unanswered.
            }
        }
    }
    Ok(())
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}
