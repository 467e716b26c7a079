//! The `Infer` stream. Each stream has a reader task, which reassembles requests, decodes
//! and checks them and queues them for the compute worker, and a responder task, which
//! answers them in arrival order. Every request id gets exactly one result or one error
//! frame; a bad request never ends the stream.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use cleave_common::pb::{self, InferFrame, ResultFrame};
use cleave_common::security::ServerSecurity;
use cleave_common::wire::{frame_parts, Codec, Direction, FrameAssembler, PayloadReceiver};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::StreamExt;
use tonic::{Status, Streaming};

use crate::error::{error_frame, RequestError};
use crate::payloads::{decode_blocking, encode_blocking, ResultEncoder, ResultSpec};
use crate::worker::{Job, JobResult, Work};

/// What one `Infer` stream needs.
pub(crate) struct InferContext {
    /// Stages in the bundle (a split must be at most this).
    pub(crate) stage_count: usize,
    /// Opens and decodes the stream's requests.
    pub(crate) receiver: PayloadReceiver,
    /// The compute worker's queue.
    pub(crate) worker: mpsc::Sender<Work>,
    /// Keys the results are sealed with.
    pub(crate) security: Arc<ServerSecurity>,
    /// The largest result (tensor bytes) sent back.
    pub(crate) max_payload_bytes: u64,
    /// Data bytes per result frame.
    pub(crate) chunk_bytes: usize,
    /// Requests decoded and waiting for their answer before the reader waits.
    pub(crate) depth: usize,
}

/// Serves one stream: spawns its reader and responder; results go to `out`.
pub(crate) fn serve_stream(inbound: Streaming<InferFrame>, ctx: InferContext, out: mpsc::Sender<Result<ResultFrame, Status>>) {
    let (pending_tx, pending_rx) = mpsc::channel::<Pending>(ctx.depth);
    let encoder = ResultEncoder::new(Arc::clone(&ctx.security), ctx.max_payload_bytes);
    tokio::spawn(respond(pending_rx, out, encoder, ctx.chunk_bytes));
    tokio::spawn(read_requests(inbound, ctx, pending_tx));
}

/// A request waiting for its answer, in arrival order.
struct Pending {
    request_id: u64,
    split: u32,
    decode_us: u64,
    /// The result travels back with the request's codec and key.
    codec: Codec,
    key_id: Option<u32>,
    answer: oneshot::Receiver<Result<JobResult, RequestError>>,
}

impl Pending {
    /// A request answered at once (with an error, before it reached the worker).
    fn answered(request_id: u64, answer: Result<JobResult, RequestError>) -> Self {
        let (tx, rx) = oneshot::channel();
        let _ = tx.send(answer);
        Self { request_id, split: 0, decode_us: 0, codec: Codec::RAW, key_id: None, answer: rx }
    }
}

async fn read_requests(mut inbound: Streaming<InferFrame>, ctx: InferContext, pending: mpsc::Sender<Pending>) {
    let receiver = Arc::new(Mutex::new(ctx.receiver));
    let mut frames = FrameAssembler::default();
    loop {
        let frame = match inbound.next().await {
            Some(Ok(frame)) => frame,
            Some(Err(status)) => {
                tracing::debug!(%status, "inbound stream failed");
                return;
            }
            None => return,
        };
        let start = |f: &InferFrame| receiver.lock().expect("payload receiver").start(f.request_id, &f.header).map(|a| (a, ()));
        let assembly = match frames.push(&frame, start) {
            Ok(None) => continue,
            Ok(Some((assembly, ()))) => assembly,
            Err((id, e)) => {
                if pending.send(Pending::answered(id, Err(e.into()))).await.is_err() {
                    return;
                }
                continue;
            }
        };
        let (id, split) = (assembly.request_id, assembly.split());
        let Some(decoded) = decode_blocking(&receiver, assembly).await else {
            tracing::error!(request_id = id, "decoding a payload panicked: the stream ends");
            return;
        };
        let (tx, rx) = oneshot::channel();
        let (mut codec, mut key_id, mut decode_us) = (Codec::RAW, None, 0);
        match decoded {
            Err(e) => {
                let _ = tx.send(Err(e));
            }
            Ok((r, took)) => {
                (codec, key_id, decode_us) = (r.codec, r.key_id, took.as_micros() as u64);
                if r.split as usize > ctx.stage_count {
                    let _ = tx.send(Err(RequestError::SplitOutOfRange { split: r.split, cuts: ctx.stage_count }));
                } else {
                    let (job_tx, job_rx) = oneshot::channel();
                    let job = Job { split: r.split as usize, input: r.boundary, queued_at: Instant::now(), reply: job_tx };
                    if ctx.worker.send(Work::Run(job)).await.is_err() {
                        let _ = tx.send(Err(RequestError::Unavailable));
                    } else {
                        tokio::spawn(async move {
                            let answer = job_rx.await.map_err(|_| RequestError::Unavailable);
                            let _ = tx.send(answer);
                        });
                    }
                }
            }
        }
        if pending.send(Pending { request_id: id, split, decode_us, codec, key_id, answer: rx }).await.is_err() {
            return;
        }
    }
}

/// Answers the stream's requests in arrival order.
async fn respond(mut pending: mpsc::Receiver<Pending>, out: mpsc::Sender<Result<ResultFrame, Status>>, encoder: ResultEncoder, chunk_bytes: usize) {
    let encoder = Arc::new(Mutex::new(encoder));
    while let Some(mut p) = pending.recv().await {
        let answer = (&mut p.answer).await.unwrap_or(Err(RequestError::Unavailable));
        let spec = ResultSpec { request_id: p.request_id, split: p.split, codec: p.codec, key_id: p.key_id, direction: Direction::Result };
        let encoded = match answer.and_then(|r| Ok((r.output?, r.queue, r.compute))) {
            Ok((output, queue, compute)) => encode_blocking(&encoder, spec, output).await.map(|(e, took)| (e, queue, compute, took)),
            Err(e) => Err(e),
        };
        let frames = match encoded {
            Ok((encoded, queue, compute, encode)) => {
                let timings = pb::ServerTimings {
                    queue_us: queue.as_micros() as u64,
                    decode_us: p.decode_us,
                    compute_us: compute.as_micros() as u64,
                    encode_us: encode.as_micros() as u64,
                };
                frame_parts(encoded.envelope, &encoded.data, chunk_bytes)
                    .into_iter()
                    .map(|part| ResultFrame {
                        request_id: p.request_id,
                        header: part.header,
                        data: part.data,
                        last: part.last,
                        timings: part.last.then_some(timings),
                        error: None,
                    })
                    .collect()
            }
            Err(e) => {
                tracing::info!(request_id = p.request_id, error = %e, "request refused");
                vec![ResultFrame { request_id: p.request_id, last: true, error: Some(error_frame(&e)), ..Default::default() }]
            }
        };
        for frame in frames {
            if out.send(Ok(frame)).await.is_err() {
                return; // The host is gone: stop working for it.
            }
        }
    }
}
