//! The gRPC service: `Info` and the `Infer` stream.
//!
//! Each `Infer` stream has a reader task, which reassembles requests and queues them for the
//! compute worker, and a responder task, which answers them in arrival order. Every request
//! id gets exactly one result or one error frame; a bad request never ends the stream.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use cleave_common::pb::split_inference_server::SplitInference;
use cleave_common::pb::{self, InferFrame, ResultFrame};
use cleave_common::security::ServerSecurity;
use cleave_common::wire::{frame_parts, Codec, CodecError, Direction, PayloadMeta, PayloadReceiver, PayloadSender, Reassembly, WireError};
use cleave_common::training::TrainError;
use cleave_common::{Boundary, Bundle, BundleError, DeviceSpec};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Code, Request, Response, Status, Streaming};

use crate::worker::{Job, JobResult, ProfileJob, Work};

/// Protocol version of `cleave.v1`.
pub const PROTOCOL_VERSION: u32 = 1;
/// Metadata key carrying the bundle id the host expects.
pub const BUNDLE_ID_METADATA: &str = "cleave-bundle-id";

/// Why a request failed, by the phase that failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RequestError {
    /// The payload is malformed.
    #[error("decode: {0}")]
    Wire(#[from] WireError),
    /// The split point does not exist.
    #[error("split {split} is out of range: the bundle has cuts 0..={cuts}")]
    SplitOutOfRange { split: u32, cuts: usize },
    /// The boundary does not fit the manifest, or a stage failed.
    #[error("compute: {0}")]
    Bundle(#[from] BundleError),
    /// The result cannot be encoded (a lossy precision cannot carry it, say).
    #[error("encode: {0}")]
    Encode(WireError),
    /// The server is shutting down.
    #[error("the server is shutting down")]
    Unavailable,
    /// A training call failed (setting up, a step, a checkpoint).
    #[error("training: {0}")]
    Training(#[from] TrainError),
    /// A training call out of order (no session yet, a backward without its forward...).
    #[error("training session: {0}")]
    Session(String),
    /// The bundle is already being trained and the server keeps one session per bundle.
    #[error("{0}")]
    AlreadyTraining(String),
}

/// The one place that maps errors to gRPC status codes.
pub(crate) fn status_code(err: &RequestError) -> Code {
    use CodecError as C;
    match err {
        RequestError::Wire(WireError::Codec(C::PayloadTooLarge { .. })) => Code::ResourceExhausted,
        // The payload is not authentic: no key, wrong key, altered, replayed, or unsealed
        // where sealing is required.
        RequestError::Wire(WireError::Codec(
            C::NotSealed | C::NoKeys { .. } | C::UnknownKeyId { .. } | C::WrongKey { .. } | C::HeaderTampered | C::DataTampered | C::Replayed { .. },
        )) => Code::Unauthenticated,
        RequestError::Wire(WireError::Codec(C::CodecRefused { .. })) => Code::FailedPrecondition,
        RequestError::Wire(_) | RequestError::SplitOutOfRange { .. } => Code::InvalidArgument,
        RequestError::Encode(_) => Code::Internal,
        RequestError::Bundle(BundleError::BoundaryMismatch { .. } | BundleError::BatchOutOfRange { .. }) => Code::InvalidArgument,
        RequestError::Bundle(_) => Code::Internal,
        RequestError::Unavailable => Code::Unavailable,
        RequestError::Training(e) => match e {
            TrainError::Bundle(BundleError::BoundaryMismatch { .. } | BundleError::BatchOutOfRange { .. } | BundleError::InvalidRange { .. })
            | TrainError::Invalid(_)
            | TrainError::Loss(_)
            | TrainError::Gradients(_) => Code::InvalidArgument,
            TrainError::NotTrainable(_) | TrainError::Checkpoint { .. } => Code::FailedPrecondition,
            TrainError::Bundle(_) | TrainError::Torch { .. } => Code::Internal,
        },
        RequestError::Session(_) | RequestError::AlreadyTraining(_) => Code::FailedPrecondition,
    }
}

/// The service state shared by every stream.
pub(crate) struct Service {
    pub(crate) bundle: Bundle,
    pub(crate) device: String,
    pub(crate) limits: cleave_common::config::Limits,
    pub(crate) security: Arc<ServerSecurity>,
    pub(crate) worker: mpsc::Sender<Work>,
    /// The device training sessions load their stages on.
    pub(crate) device_spec: DeviceSpec,
    pub(crate) training: crate::training::Training,
}

type ResultStream = Pin<Box<dyn Stream<Item = Result<ResultFrame, Status>> + Send>>;

#[tonic::async_trait]
impl SplitInference for Service {
    async fn info(&self, _: Request<pb::InfoRequest>) -> Result<Response<pb::InfoReply>, Status> {
        Ok(Response::new(pb::InfoReply {
            protocol_version: PROTOCOL_VERSION,
            server_version: env!("CARGO_PKG_VERSION").into(),
            bundle_id: self.bundle.id().into(),
            model_source: self.bundle.manifest().model.source.clone(),
            stage_count: self.bundle.stage_count() as u32,
            device: self.device.clone(),
            limits: Some(pb::Limits {
                max_message_bytes: self.limits.max_message_bytes,
                max_payload_bytes: self.limits.max_payload_bytes,
                queue_depth: self.limits.queue_depth,
                max_batch: self.bundle.manifest().batch.max as u32,
            }),
            codecs: Some(pb::CodecSupport {
                precisions: self.security.policy.precisions.iter().map(|p| p.name().to_string()).collect(),
                compressions: self.security.policy.compressions.clone(),
                encryption_required: self.security.policy.require_encryption,
                key_ids: self.security.keys.ids(),
            }),
        }))
    }

    type InferStream = ResultStream;

    async fn infer(&self, request: Request<Streaming<InferFrame>>) -> Result<Response<ResultStream>, Status> {
        self.check_bundle_id(request.metadata())?;
        let depth = self.limits.queue_depth as usize;
        let (out_tx, out_rx) = mpsc::channel::<Result<ResultFrame, Status>>(depth * 4);
        let (pending_tx, pending_rx) = mpsc::channel::<Pending>(depth);
        tokio::spawn(read_requests(request.into_inner(), self.context(), pending_tx));
        tokio::spawn(respond(pending_rx, out_tx, self.limits.chunk_bytes(), Arc::clone(&self.security)));
        Ok(Response::new(Box::pin(ReceiverStream::new(out_rx))))
    }

    async fn profile(&self, request: Request<pb::ProfileRequest>) -> Result<Response<pb::ProfileReply>, Status> {
        let r = request.into_inner();
        let batch = self.bundle.manifest().batch;
        let size = i64::from(r.batch_size);
        if size < batch.min || size > batch.max {
            return Err(Status::invalid_argument(format!("batch size {size} is outside the bundle's range {}..={}", batch.min, batch.max)));
        }
        // A profile holds the compute worker: keep it short.
        let repeats = match r.repeats {
            0 => 5,
            n if n > 50 => return Err(Status::invalid_argument(format!("{n} repeats: at most 50"))),
            n => n as usize,
        };
        let (tx, rx) = oneshot::channel();
        self.worker.send(Work::Profile(ProfileJob { batch: size, repeats, reply: tx })).await.map_err(|_| Status::unavailable("the server is shutting down"))?;
        let stage_ms = rx.await.map_err(|_| Status::unavailable("the server is shutting down"))?.map_err(|e| Status::internal(format!("profile: {e}")))?;
        Ok(Response::new(pb::ProfileReply { device: self.device.clone(), batch_size: r.batch_size, stage_ms }))
    }

    async fn echo(&self, request: Request<pb::EchoRequest>) -> Result<Response<pb::EchoReply>, Status> {
        let r = request.into_inner();
        // The reply must fit in one message, and a caller must not make the server allocate more.
        let cap = self.limits.max_message_bytes.saturating_sub(1024);
        if r.reply_bytes > cap {
            return Err(Status::invalid_argument(format!("reply_bytes {} is above {cap} (the server's message limit less framing)", r.reply_bytes)));
        }
        Ok(Response::new(pb::EchoReply { payload: Bytes::from(vec![0u8; r.reply_bytes as usize]) }))
    }

    type TrainStream = Pin<Box<dyn Stream<Item = Result<pb::TrainReply, Status>> + Send>>;

    async fn train(&self, request: Request<Streaming<pb::TrainFrame>>) -> Result<Response<Self::TrainStream>, Status> {
        self.check_bundle_id(request.metadata())?;
        let (out_tx, out_rx) = mpsc::channel(16);
        let ctx = crate::training::StreamContext {
            bundle: self.bundle.clone(),
            device: self.device_spec,
            limits: self.limits,
            security: Arc::clone(&self.security),
            training: self.training.clone(),
        };
        tokio::spawn(crate::training::serve_stream(request.into_inner(), ctx, out_tx));
        Ok(Response::new(Box::pin(ReceiverStream::new(out_rx))))
    }
}

/// What a stream's reader task needs.
struct StreamContext {
    stage_count: usize,
    /// Shared with the blocking pool, where payloads are opened and decoded.
    receiver: Arc<Mutex<PayloadReceiver>>,
    worker: mpsc::Sender<Work>,
}

impl Service {
    /// Refuses a stream whose host has another bundle than this server serves.
    fn check_bundle_id(&self, metadata: &tonic::metadata::MetadataMap) -> Result<(), Status> {
        let theirs = metadata.get(BUNDLE_ID_METADATA).and_then(|v| v.to_str().ok()).unwrap_or("");
        if theirs != self.bundle.id() {
            return Err(Status::failed_precondition(format!(
                "bundle mismatch: the host has bundle {}, this server serves {}",
                if theirs.is_empty() { "(none given)" } else { theirs },
                self.bundle.id()
            )));
        }
        Ok(())
    }

    fn context(&self) -> StreamContext {
        let receiver = PayloadReceiver::new(Direction::Request, self.limits.max_payload_bytes, self.security.policy.clone(), &self.security.keys);
        StreamContext { stage_count: self.bundle.stage_count(), receiver: Arc::new(Mutex::new(receiver)), worker: self.worker.clone() }
    }
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

async fn read_requests(mut inbound: Streaming<InferFrame>, ctx: StreamContext, pending: mpsc::Sender<Pending>) {
    let mut current: Option<Reassembly> = None;
    // A request already answered with an error whose remaining frames are skipped.
    let mut skipping: Option<u64> = None;
    loop {
        let frame = match inbound.next().await {
            Some(Ok(frame)) => frame,
            Some(Err(status)) => {
                tracing::debug!(%status, "inbound stream failed");
                return;
            }
            None => return,
        };
        let id = frame.request_id;
        if skipping == Some(id) {
            if frame.last {
                skipping = None;
            }
            continue;
        }
        skipping = None;
        let step = match current.take() {
            None => ctx.receiver.lock().expect("payload receiver").start(id, &frame.header),
            Some(assembly) => Ok(assembly),
        };
        let mut assembly = match step {
            Ok(a) => a,
            Err(e) => {
                if !frame.last {
                    skipping = Some(id);
                }
                if !answer_now(&pending, id, Err(e.into())).await {
                    return;
                }
                continue;
            }
        };
        if let Err(e) = assembly.push(id, &frame.data) {
            // An interleaved frame fails the incomplete request; a stray frame of another
            // request cannot be trusted either, so that one is skipped to its end too.
            let failed = assembly.request_id;
            skipping = if frame.last { None } else { Some(id) };
            if !answer_now(&pending, failed, Err(e.into())).await {
                return;
            }
            continue;
        }
        if !frame.last {
            current = Some(assembly);
            continue;
        }
        let split = assembly.split();
        // Decrypting and decompressing a large boundary takes milliseconds: it runs on the
        // blocking pool, and this stream waits for it, so payloads are still opened in order.
        let receiver = Arc::clone(&ctx.receiver);
        let decoded = tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            let received = receiver.lock().expect("payload receiver").finish(assembly);
            (received, started.elapsed())
        })
        .await;
        let Ok((received, decode_time)) = decoded else {
            tracing::error!(request_id = id, "decoding a payload panicked");
            return;
        };
        let decode_us = decode_time.as_micros() as u64;
        let (tx, rx) = oneshot::channel();
        let (mut codec, mut key_id) = (Codec::RAW, None);
        match received {
            Err(e) => {
                let _ = tx.send(Err(e.into()));
            }
            Ok(r) if r.split as usize > ctx.stage_count => {
                (codec, key_id) = (r.codec, r.key_id);
                let _ = tx.send(Err(RequestError::SplitOutOfRange { split: r.split, cuts: ctx.stage_count }));
            }
            Ok(r) => {
                (codec, key_id) = (r.codec, r.key_id);
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
        if pending.send(Pending { request_id: id, split, decode_us, codec, key_id, answer: rx }).await.is_err() {
            return;
        }
    }
}

async fn answer_now(pending: &mpsc::Sender<Pending>, id: u64, answer: Result<JobResult, RequestError>) -> bool {
    let (tx, rx) = oneshot::channel();
    let _ = tx.send(answer);
    pending.send(Pending { request_id: id, split: 0, decode_us: 0, codec: Codec::RAW, key_id: None, answer: rx }).await.is_ok()
}

/// Encodes results with each request's codec, sealed with each request's key (one sender,
/// so one nonce sequence, per key on this stream).
pub(crate) struct ResultEncoder {
    security: Arc<ServerSecurity>,
    senders: HashMap<(Option<u32>, i32), PayloadSender>,
}

/// What a result needs to be encoded like its request.
#[derive(Clone, Copy)]
pub(crate) struct ResultSpec {
    pub(crate) request_id: u64,
    pub(crate) split: u32,
    pub(crate) codec: Codec,
    pub(crate) key_id: Option<u32>,
    /// `Result` for boundaries, `Gradient` for gradients (each its own nonce sequence).
    pub(crate) direction: Direction,
}

impl ResultEncoder {
    pub(crate) fn new(security: Arc<ServerSecurity>) -> Self {
        Self { security, senders: HashMap::new() }
    }

    pub(crate) fn encode(&mut self, p: ResultSpec, output: &Boundary) -> Result<cleave_common::wire::EncodedPayload, RequestError> {
        let sender = match self.senders.entry((p.key_id, p.direction as i32)) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(match p.key_id {
                None => PayloadSender::plain(),
                Some(id) => PayloadSender::sealed(&self.security.keys, id).map_err(|err| RequestError::Encode(err.into()))?,
            }),
        };
        let meta = PayloadMeta { request_id: p.request_id, split: p.split, direction: p.direction };
        sender.encode(meta, &p.codec, output).map_err(RequestError::Encode)
    }
}

async fn respond(
    mut pending: mpsc::Receiver<Pending>,
    out: mpsc::Sender<Result<ResultFrame, Status>>,
    chunk_bytes: usize,
    security: Arc<ServerSecurity>,
) {
    let encoder = Arc::new(Mutex::new(ResultEncoder::new(security)));
    while let Some(mut p) = pending.recv().await {
        {
            let answer = (&mut p.answer).await.unwrap_or(Err(RequestError::Unavailable));
            let spec = ResultSpec { request_id: p.request_id, split: p.split, codec: p.codec, key_id: p.key_id, direction: Direction::Result };
            let encoder = Arc::clone(&encoder);
            // Like decoding, encoding runs on the blocking pool; results stay in order
            // because this task waits for each one.
            let encoded = tokio::task::spawn_blocking(move || {
                answer.and_then(|r| {
                    let output = r.output?;
                    let encode_start = Instant::now();
                    let encoded = encoder.lock().expect("result encoder").encode(spec, &output)?;
                    Ok((encoded, r.queue, r.compute, encode_start.elapsed()))
                })
            })
            .await
            .unwrap_or(Err(RequestError::Unavailable));
            let frames = match encoded {
                Ok((encoded, queue, compute, encode)) => {
                    let timings = pb::ServerTimings {
                        queue_us: queue.as_micros() as u64,
                        decode_us: p.decode_us,
                        compute_us: compute.as_micros() as u64,
                        encode_us: encode.as_micros() as u64,
                    };
                    result_frames(p.request_id, encoded.envelope, &encoded.data, timings, chunk_bytes)
                }
                Err(e) => {
                    tracing::info!(request_id = p.request_id, error = %e, "request refused");
                    vec![ResultFrame {
                        request_id: p.request_id,
                        last: true,
                        error: Some(pb::Error { code: status_code(&e) as i32, message: e.to_string() }),
                        ..Default::default()
                    }]
                }
            };
            for frame in frames {
                if out.send(Ok(frame)).await.is_err() {
                    return; // The host is gone: stop working for it.
                }
            }
        }
    }
}

fn result_frames(request_id: u64, envelope: Bytes, data: &Bytes, timings: pb::ServerTimings, chunk_bytes: usize) -> Vec<ResultFrame> {
    frame_parts(envelope, data, chunk_bytes)
        .into_iter()
        .map(|part| ResultFrame {
            request_id,
            header: part.header,
            data: part.data,
            last: part.last,
            timings: part.last.then_some(timings),
            error: None,
        })
        .collect()
}
