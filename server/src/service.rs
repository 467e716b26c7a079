//! The tonic service: it selects the model every call names (by the bundle id it carries)
//! and delegates: `Info` and the unary profiling calls here, `Infer` to [`crate::infer`],
//! `Train` to [`crate::training`]. Every refusal is a [`RequestError`], turned into a status
//! in one place.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use cleave_common::config::Limits;
use cleave_common::pb::split_inference_server::SplitInference;
use cleave_common::pb::{self, InferFrame};
use cleave_common::protocol::{ServerInfo, HOST_SESSION_METADATA};
use cleave_common::security::ServerSecurity;
use cleave_common::telemetry::TRACEPARENT_METADATA;
use cleave_common::wire::{Direction, PayloadReceiver};
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use crate::budget::MemoryBudget;
use crate::config::PeerLimits;
use crate::connections::connection_of;
use crate::error::{BadCall, Busy, Internal, RequestError};
use crate::generation::admission::Generation;
use crate::generation::queue::StepQueues;
use crate::generation::stream::GenerateContext;
use crate::infer::InferContext;
use crate::metrics::Metrics;
use crate::models::Models;
use crate::peer::CallPeer;
use crate::reader::FrameReader;
use crate::scheduler::ProfileJob;
use crate::streams::{Answers, OpenStream, StreamKind};
use crate::training::admission::Training;
use crate::training::parking::Parking;
use crate::training::stream::TrainContext;
use crate::unsent::Unsent;
use crate::window::{HostSession, ResultWindow};

/// Timed passes when a `Profile` call asks for none.
const DEFAULT_PROFILE_REPEATS: usize = 5;

/// The service state shared by every stream.
pub(crate) struct Service {
    pub(crate) models: Models,
    pub(crate) limits: Limits,
    pub(crate) security: Arc<ServerSecurity>,
    pub(crate) metrics: Metrics,
    pub(crate) training: Training,
    /// Generation sessions' places, cache budget and stages.
    pub(crate) generation: Generation,
    /// Generation steps, batched across sessions.
    pub(crate) step_queues: StepQueues,
    /// Reattachable training sessions whose stream broke, kept for their hosts.
    pub(crate) parking: Parking,
    /// What the server holds for its peers.
    pub(crate) peers: PeerLimits,
    /// The memory every stream's requests and answers share.
    pub(crate) budget: MemoryBudget,
    /// Recent results, for requests resent after a broken connection.
    pub(crate) window: ResultWindow,
    /// Cancelled when the server starts draining.
    pub(crate) draining: CancellationToken,
    /// One profile at a time.
    pub(crate) profiling: Arc<Semaphore>,
}

impl Service {
    async fn run_profile(&self, request: Request<pb::ProfileRequest>) -> Result<Response<pb::ProfileReply>, Status> {
        let model = self.models.select(request.metadata(), true)?;
        let r = request.into_inner();
        let batch = model.bundle.manifest().batch;
        let size = i64::from(r.batch_size);
        if size < batch.min || size > batch.max {
            return Err(RequestError::from(BadCall::BatchSize { size, min: batch.min, max: batch.max }).into());
        }
        let max = self.peers.max_profile_repeats;
        let repeats = match r.repeats {
            0 => DEFAULT_PROFILE_REPEATS.min(max as usize),
            n if n > max => return Err(RequestError::from(BadCall::Repeats { repeats: n, max }).into()),
            n => n as usize,
        };
        // One at a time: a profile holds its device between the requests it lets by.
        let _profiling = Arc::clone(&self.profiling).try_acquire_owned().map_err(|_| RequestError::from(Busy::Profile))?;
        // Dropping this handler (its caller went away) drops `rx`; the worker sees it and stops.
        let (tx, rx) = oneshot::channel();
        model.scheduler.profile(ProfileJob { model: model.index, batch: size, repeats, reply: tx }).await?;
        // `None` only when this handler is gone: nobody reads this then.
        let stage_ms = rx.await.map_err(|_| RequestError::from(Internal::Unanswered))??.ok_or(RequestError::from(Internal::Unanswered))?;
        Ok(Response::new(pb::ProfileReply { device: model.device.clone(), batch_size: r.batch_size, stage_ms }))
    }

    async fn run_echo(&self, request: Request<pb::EchoRequest>) -> Result<Response<pb::EchoReply>, Status> {
        let unsent = unsent_of(&request);
        let budget = self.budget_of(request.extensions());
        // Only the size is kept: the payload, a slice of tonic's read buffer, goes now rather
        // than wait for room with the reply.
        let reply_bytes = request.into_inner().reply_bytes;
        // The reply must fit in one message, and a caller must not make the server allocate more.
        let cap = self.limits.max_message_bytes.saturating_sub(1024);
        if reply_bytes > cap {
            return Err(RequestError::from(BadCall::ReplyBytes { asked: reply_bytes, cap }).into());
        }
        // A reply holds its bytes in the memory budget until they are written: peers that ask
        // and never read cannot pile replies up past it.
        let mut held = budget.reserve(reply_bytes).await.map_err(RequestError::from)?;
        let reply = pb::EchoReply { payload: Bytes::from(vec![0u8; reply_bytes as usize]) };
        unsent.hold(&reply, &mut held);
        Ok(answering(reply, unsent))
    }
}

/// A span for a unary call, continuing the caller's trace when its `traceparent` metadata
/// parses (W3C trace context; an `Infer` or `Train` stream's requests carry theirs in their
/// frames).
fn call_span<T>(rpc: &'static str, request: &Request<T>) -> tracing::Span {
    let span = tracing::debug_span!("call", otel.name = rpc);
    if let Some(parent) = request.metadata().get(TRACEPARENT_METADATA).and_then(|v| v.to_str().ok()) {
        cleave_common::telemetry::follow(&span, parent);
    }
    span
}

#[tonic::async_trait]
impl SplitInference for Service {
    async fn info(&self, request: Request<pb::InfoRequest>) -> Result<Response<pb::InfoReply>, Status> {
        let _call = call_span("Info", &request).entered();
        let info = ServerInfo {
            server_version: env!("CARGO_PKG_VERSION").into(),
            models: self.models.all().iter().map(|m| m.info()).collect(),
            limits: self.limits,
            policy: self.security.policy.clone(),
            key_ids: self.security.keys.ids(),
        };
        Ok(Response::new(pb::InfoReply::from(&info)))
    }

    type InferStream = Answers<pb::ResultFrame>;

    async fn infer(&self, request: Request<Streaming<InferFrame>>) -> Result<Response<Self::InferStream>, Status> {
        let session = match request.metadata().get(HOST_SESSION_METADATA) {
            None => None,
            Some(value) => Some(HostSession::parse(value.to_str().unwrap_or(""))?),
        };
        let context = |open: &OpenStream<InferFrame, pb::ResultFrame>| InferContext {
            receiver: Arc::new(Mutex::new(
                PayloadReceiver::new(Direction::Request, self.limits.max_payload_bytes, self.security.policy.clone(), &self.security.keys)
                    .checked_against(&open.model.bundle)
                    .landing_for(open.model.torch_device),
            )),
            model: Arc::clone(&open.model),
            metrics: self.metrics.clone(),
            security: Arc::clone(&self.security),
            max_payload_bytes: self.limits.max_payload_bytes,
            chunk_bytes: self.limits.chunk_bytes(),
            max_requests: self.peers.max_requests_per_stream as usize,
            budget: open.budget.clone(),
            draining: self.draining.clone(),
            window: session.map(|s| (self.window.clone(), s)),
            peer_gone: open.peer_gone.clone(),
            unsent: open.unsent.clone(),
        };
        self.open_stream(request, StreamKind::Infer, context, crate::infer::serve_stream)
    }

    async fn profile(&self, request: Request<pb::ProfileRequest>) -> Result<Response<pb::ProfileReply>, Status> {
        let span = call_span("Profile", &request);
        self.run_profile(request).instrument(span).await
    }

    async fn echo(&self, request: Request<pb::EchoRequest>) -> Result<Response<pb::EchoReply>, Status> {
        let span = call_span("Echo", &request);
        self.run_echo(request).instrument(span).await
    }

    type TrainStream = Answers<pb::TrainReply>;

    async fn train(&self, request: Request<Streaming<pb::TrainFrame>>) -> Result<Response<Self::TrainStream>, Status> {
        let context = |open: &OpenStream<pb::TrainFrame, pb::TrainReply>| TrainContext {
            model: Arc::clone(&open.model),
            metrics: self.metrics.clone(),
            limits: self.limits,
            security: Arc::clone(&self.security),
            training: self.training.clone(),
            parking: self.parking.clone(),
            budget: open.budget.clone(),
            peer: open.peer.clone(),
            unsent: open.unsent.clone(),
        };
        self.open_stream(request, StreamKind::Train, context, crate::training::stream::serve_stream)
    }

    type GenerateStream = Answers<pb::GenerateReply>;

    async fn generate(&self, request: Request<Streaming<pb::GenerateFrame>>) -> Result<Response<Self::GenerateStream>, Status> {
        let context = |open: &OpenStream<pb::GenerateFrame, pb::GenerateReply>| GenerateContext {
            model: Arc::clone(&open.model),
            peer: open.peer.clone(),
            peer_gone: open.peer_gone.clone(),
            generation: self.generation.clone(),
            queues: self.step_queues.clone(),
            metrics: self.metrics.clone(),
            keys: self.security.keys.clone(),
            sealing_required: self.security.policy.require_encryption,
            max_message_bytes: self.limits.max_message_bytes,
            budget: open.budget.clone(),
            unsent: open.unsent.clone(),
        };
        self.open_stream(request, StreamKind::Generate, context, crate::generation::stream::serve_stream)
    }
}

/// The one skeleton every stream opens through.
impl Service {
    /// Opens a stream of `kind`: selects the model its metadata names and refuses it while
    /// the server drains; then spawns `serve` with the stream and the context `context`
    /// makes for it, and answers with the stream's answers (their bytes unsent until
    /// written; the response, when tonic drops it, says the peer is gone). The bearer token
    /// was checked before, once, by [`check_token`].
    fn open_stream<F, R, C, Fut>(
        &self,
        request: Request<Streaming<F>>,
        kind: StreamKind,
        context: impl FnOnce(&OpenStream<F, R>) -> C,
        serve: impl FnOnce(OpenStream<F, R>, C) -> Fut,
    ) -> Result<Response<Answers<R>>, Status>
    where
        F: Send + 'static,
        R: Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let model = self.models.select(request.metadata(), false)?;
        if self.draining.is_cancelled() {
            return Err(RequestError::Draining.into());
        }
        let unsent = unsent_of(&request);
        let peer = CallPeer::of(request.extensions());
        let budget = self.budget_of(request.extensions());
        let (answers, answers_rx) = mpsc::channel(kind.answers_queued());
        let peer_gone = CancellationToken::new();
        let reader = FrameReader::new(request.into_inner(), self.draining.clone(), self.peers.request_timeout, self.idle_timeout(kind));
        let open = OpenStream { model, reader, answers, unsent: unsent.clone(), peer_gone: peer_gone.clone(), peer, budget };
        let ctx = context(&open);
        tokio::spawn(serve(open, ctx));
        // tonic drops the response when the peer resets the stream or its connection closes.
        let gone_on_drop = peer_gone.drop_guard();
        let answers = ReceiverStream::new(answers_rx).map(move |answer| {
            let _held = &gone_on_drop;
            answer
        });
        Ok(answering(Box::pin(answers) as Answers<R>, unsent))
    }

    /// The call's peer's view of the memory budget: the one its body counts its messages in
    /// (made by `CallTracking`), else made here from its connection.
    fn budget_of(&self, extensions: &http::Extensions) -> MemoryBudget {
        extensions.get::<MemoryBudget>().cloned().unwrap_or_else(|| self.budget.for_peer(CallPeer::of(extensions)))
    }

    /// How long a stream of `kind` may do nothing: an `Infer` stream with no request in
    /// progress, a training or generation session with no call (none: as long as it likes).
    /// The one place the idle rule of streams is set.
    fn idle_timeout(&self, kind: StreamKind) -> Option<Duration> {
        match kind {
            StreamKind::Infer => Some(self.peers.idle_stream_timeout),
            StreamKind::Train => Some(self.training.options.session_idle_timeout),
            StreamKind::Generate => Some(self.generation.options().session_idle_timeout),
        }
    }
}

/// What the answers of `request`'s call hold until written, on its connection's clocks.
fn unsent_of<T>(request: &Request<T>) -> Unsent {
    Unsent::new(connection_of(request.extensions()).map(|c| Arc::clone(&c.answers)))
}

/// A response whose messages hold what `unsent` registers for them.
fn answering<T>(message: T, unsent: Unsent) -> Response<T> {
    let mut response = Response::new(message);
    response.extensions_mut().insert(unsent);
    response
}

/// Refuses a call without a bearer token of the server's (when it has any), before any handler.
pub(crate) fn check_token(tokens: &cleave_common::security::ServerTokens, request: Request<()>) -> Result<Request<()>, Status> {
    if !tokens.required() {
        return Ok(request);
    }
    match request.metadata().get("authorization") {
        Some(value) if tokens.take(value.as_bytes()) => Ok(request),
        Some(_) => Err(RequestError::Unauthenticated("wrong bearer token").into()),
        None => Err(RequestError::Unauthenticated("this server requires a bearer token (`authorization: Bearer ...`)").into()),
    }
}
