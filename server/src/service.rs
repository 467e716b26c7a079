//! The tonic service: it checks what every call carries (the bundle id of a stream) and
//! delegates: `Info` and the unary profiling calls here, `Infer` to [`crate::infer`], `Train`
//! to [`crate::training`]. Every refusal is a [`RequestError`], turned into a status in one place.

use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use cleave_common::config::Limits;
use cleave_common::pb::split_inference_server::SplitInference;
use cleave_common::pb::{self, InferFrame, ResultFrame};
use cleave_common::protocol::{ServerInfo, BUNDLE_ID_METADATA};
use cleave_common::security::ServerSecurity;
use cleave_common::wire::{Direction, PayloadReceiver};
use cleave_common::{Bundle, DeviceSpec};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

use crate::error::RequestError;
use crate::infer::InferContext;
use crate::training::admission::Training;
use crate::training::stream::TrainContext;
use crate::worker::{ProfileJob, Work};

/// Most timed passes a `Profile` call may ask for: a profile holds the compute worker.
const MAX_PROFILE_REPEATS: u32 = 50;
/// Timed passes when a `Profile` call asks for none.
const DEFAULT_PROFILE_REPEATS: usize = 5;

/// The service state shared by every stream.
pub(crate) struct Service {
    pub(crate) bundle: Bundle,
    pub(crate) device: String,
    pub(crate) limits: Limits,
    pub(crate) security: Arc<ServerSecurity>,
    pub(crate) worker: mpsc::Sender<Work>,
    /// The device training sessions load their stages on.
    pub(crate) device_spec: DeviceSpec,
    pub(crate) training: Training,
}

type ResultStream = Pin<Box<dyn Stream<Item = Result<ResultFrame, Status>> + Send>>;

#[tonic::async_trait]
impl SplitInference for Service {
    async fn info(&self, _: Request<pb::InfoRequest>) -> Result<Response<pb::InfoReply>, Status> {
        let info = ServerInfo {
            server_version: env!("CARGO_PKG_VERSION").into(),
            bundle_id: self.bundle.id().into(),
            model_source: self.bundle.manifest().model.source.clone(),
            stage_count: self.bundle.stage_count(),
            device: self.device.clone(),
            limits: self.limits,
            max_batch: self.bundle.manifest().batch.max as u32,
            policy: self.security.policy.clone(),
            key_ids: self.security.keys.ids(),
        };
        Ok(Response::new(pb::InfoReply::from(&info)))
    }

    type InferStream = ResultStream;

    async fn infer(&self, request: Request<Streaming<InferFrame>>) -> Result<Response<ResultStream>, Status> {
        self.check_bundle_id(request.metadata())?;
        let depth = self.limits.queue_depth as usize;
        let (out_tx, out_rx) = mpsc::channel::<Result<ResultFrame, Status>>(depth * 4);
        let ctx = InferContext {
            stage_count: self.bundle.stage_count(),
            receiver: PayloadReceiver::new(Direction::Request, self.limits.max_payload_bytes, self.security.policy.clone(), &self.security.keys)
                .checked_against(&self.bundle),
            worker: self.worker.clone(),
            security: Arc::clone(&self.security),
            max_payload_bytes: self.limits.max_payload_bytes,
            chunk_bytes: self.limits.chunk_bytes(),
            depth,
        };
        crate::infer::serve_stream(request.into_inner(), ctx, out_tx);
        Ok(Response::new(Box::pin(ReceiverStream::new(out_rx))))
    }

    async fn profile(&self, request: Request<pb::ProfileRequest>) -> Result<Response<pb::ProfileReply>, Status> {
        let r = request.into_inner();
        let batch = self.bundle.manifest().batch;
        let size = i64::from(r.batch_size);
        if size < batch.min || size > batch.max {
            return Err(RequestError::BadCall(format!("batch size {size} is outside the bundle's range {}..={}", batch.min, batch.max)).into());
        }
        let repeats = match r.repeats {
            0 => DEFAULT_PROFILE_REPEATS,
            n if n > MAX_PROFILE_REPEATS => return Err(RequestError::BadCall(format!("{n} repeats: at most {MAX_PROFILE_REPEATS}")).into()),
            n => n as usize,
        };
        let (tx, rx) = oneshot::channel();
        self.worker.send(Work::Profile(ProfileJob { batch: size, repeats, reply: tx })).await.map_err(|_| RequestError::Unavailable)?;
        let stage_ms = rx.await.map_err(|_| RequestError::Unavailable)?.map_err(RequestError::Profile)?;
        Ok(Response::new(pb::ProfileReply { device: self.device.clone(), batch_size: r.batch_size, stage_ms }))
    }

    async fn echo(&self, request: Request<pb::EchoRequest>) -> Result<Response<pb::EchoReply>, Status> {
        let r = request.into_inner();
        // The reply must fit in one message, and a caller must not make the server allocate more.
        let cap = self.limits.max_message_bytes.saturating_sub(1024);
        if r.reply_bytes > cap {
            return Err(
                RequestError::BadCall(format!("reply_bytes {} is above {cap} (the server's message limit less framing)", r.reply_bytes)).into()
            );
        }
        Ok(Response::new(pb::EchoReply { payload: Bytes::from(vec![0u8; r.reply_bytes as usize]) }))
    }

    type TrainStream = Pin<Box<dyn Stream<Item = Result<pb::TrainReply, Status>> + Send>>;

    async fn train(&self, request: Request<Streaming<pb::TrainFrame>>) -> Result<Response<Self::TrainStream>, Status> {
        self.check_bundle_id(request.metadata())?;
        let (out_tx, out_rx) = mpsc::channel(16);
        let ctx = TrainContext {
            bundle: self.bundle.clone(),
            device: self.device_spec,
            limits: self.limits,
            security: Arc::clone(&self.security),
            training: self.training.clone(),
        };
        tokio::spawn(crate::training::stream::serve_stream(request.into_inner(), ctx, out_tx));
        Ok(Response::new(Box::pin(ReceiverStream::new(out_rx))))
    }
}

impl Service {
    /// Refuses a stream whose host has another bundle than this server serves.
    fn check_bundle_id(&self, metadata: &tonic::metadata::MetadataMap) -> Result<(), RequestError> {
        let theirs = metadata.get(BUNDLE_ID_METADATA).and_then(|v| v.to_str().ok()).unwrap_or("");
        if theirs != self.bundle.id() {
            let host = if theirs.is_empty() { "(none given)".to_string() } else { theirs.to_string() };
            return Err(RequestError::BundleMismatch { host, server: self.bundle.id().to_string() });
        }
        Ok(())
    }
}

/// Refuses a call without the server's bearer token (when it has one), before any handler.
pub(crate) fn check_token(token: Option<&cleave_common::security::Token>, request: Request<()>) -> Result<Request<()>, Status> {
    let Some(token) = token else { return Ok(request) };
    match request.metadata().get("authorization") {
        Some(value) if token.matches_header(value.as_bytes()) => Ok(request),
        Some(_) => Err(RequestError::Unauthenticated("wrong bearer token").into()),
        None => Err(RequestError::Unauthenticated("this server requires a bearer token (`authorization: Bearer ...`)").into()),
    }
}
