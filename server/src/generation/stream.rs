//! One `Generate` stream: opens the session from the first frame (a place, the caches'
//! share of the budget, the caches), then runs its steps in order through the model's step
//! queue (batched with other sessions' steps), one answer or one error each (a sealed step's
//! answer sealed: `sealing`); a refused step leaves the session as it was. The session ends
//! with the stream, when no step of its runs for `generation.session_idle_timeout` (refused
//! steps and empty frames do not count), or when the server drains; its caches and place go
//! with it.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use cleave_common::pb::{self, generate_frame, GenerateReply};
use cleave_common::spec::TorchDType;
use cleave_common::wire::KeyRing;
use tokio::sync::mpsc;
use tonic::{Status, Streaming};

use super::admission::Generation;
use super::queue::{Ran, StepQueues};
use super::sealing::StreamSeals;
use super::session::{check_open, Answer, Session};
use crate::budget::{MemoryBudget, Reservation};
use crate::error::{catch_panic, error_frame, GenerationError, Internal, RequestError};
use crate::metrics::Metrics;
use crate::models::Model;
use crate::peer::Peer;
use crate::reader::{FrameReader, Next};
use crate::streams::OpenStream;
use crate::unsent::Unsent;

/// What one `Generate` stream needs.
pub(crate) struct GenerateContext {
    pub(crate) model: Arc<Model>,
    /// Who opens the session, for its share of places and caches.
    pub(crate) peer: Option<Peer>,
    /// Cancelled once the call's response is dropped (the host reset the stream or left).
    pub(crate) peer_gone: tokio_util::sync::CancellationToken,
    pub(crate) generation: Generation,
    pub(crate) queues: StepQueues,
    pub(crate) metrics: Metrics,
    /// The keys sealed steps are opened and their answers sealed with, and whether steps
    /// must come sealed.
    pub(crate) keys: KeyRing,
    pub(crate) sealing_required: bool,
    /// The largest message either way: every step and every answer fits in one.
    pub(crate) max_message_bytes: u64,
    /// The memory every stream's messages share (a step and its answer are held in it).
    pub(crate) budget: MemoryBudget,
    pub(crate) unsent: Unsent,
}

type Out = mpsc::Sender<Result<GenerateReply, Status>>;

fn error_reply(request_id: u64, e: &RequestError) -> GenerateReply {
    GenerateReply { request_id, error: Some(error_frame(e)), ..Default::default() }
}

/// Serves one `Generate` stream: opens its session, then answers its steps in order.
pub(crate) async fn serve_stream(mut stream: OpenStream<pb::GenerateFrame, GenerateReply>, ctx: GenerateContext) {
    let Some(first) = stream.opening_frame().await else { return };
    let out = &stream.answers;
    let (session, opened) = match open_session(&ctx, first).await {
        Ok(opened) => opened,
        Err(e) => {
            tracing::info!(error = %e, "generation session refused");
            let _ = out.send(Ok(error_reply(0, &e))).await;
            return;
        }
    };
    tracing::info!(session = %opened.session_id, cache_bytes = opened.cache_bytes, "generation session open");
    let id = opened.session_id.clone();
    if out.send(Ok(GenerateReply { opened: Some(opened), ..Default::default() })).await.is_ok() {
        let _open = ctx.metrics.stream_open("generate");
        answer_steps(&mut stream.reader, &ctx, out, session, &id).await;
    }
    tracing::info!(session = %id, "generation session closed");
}

/// Checks the opening frame, takes a place and the caches' bytes, and makes the caches.
async fn open_session(ctx: &GenerateContext, first: pb::GenerateFrame) -> Result<(Session, pb::GenerationOpened), RequestError> {
    let Some(generate_frame::Kind::Open(open)) = first.kind else { return Err(GenerationError::NotOpened.into()) };
    let asked = check_open(&ctx.model.bundle, &open)?;
    let (admission, cache_bytes) =
        (ctx.generation.admit(ctx.model.bundle.id(), asked.range, asked.cache_bytes, ctx.peer.clone())?, asked.cache_bytes);
    let (generation, model) = (ctx.generation.clone(), Arc::clone(&ctx.model));
    let session = tokio::task::spawn_blocking(move || {
        catch_panic("opening a generation session", || Session::open(&generation.stages(&model)?, &asked, admission))
    })
    .await
    .map_err(|_| Internal::Cancelled("opening a generation session"))??;
    let opened = pb::GenerationOpened { session_id: hex::encode(rand::random::<[u8; 8]>()), device: ctx.model.device.clone(), cache_bytes };
    Ok((session, opened))
}

/// Answers the steps of a stream in order until it ends.
async fn answer_steps(reader: &mut FrameReader<Streaming<pb::GenerateFrame>>, ctx: &GenerateContext, out: &Out, session: Session, id: &str) {
    let idle = ctx.generation.options().session_idle_timeout;
    let mut session = Some(session);
    let mut seals = StreamSeals::new(ctx.keys.clone(), ctx.sealing_required);
    // Only a step that runs keeps the session: refused steps and empty frames do not.
    reader.renewed_by_work();
    loop {
        let frame = match reader.next(out.closed()).await {
            Next::Frame(frame) => frame,
            Next::End | Next::Broken => return,
            Next::Refused(e) => {
                let _ = out.send(Ok(error_reply(0, &e))).await;
                return;
            }
            // A step is one message: nothing is ever part-way in.
            Next::Stalled => continue,
            Next::Idle => {
                let _ = out.send(Ok(error_reply(0, &GenerationError::Idle { idle, session: id.to_string() }.into()))).await;
                return;
            }
            Next::Draining => {
                let _ = out.send(Ok(error_reply(0, &RequestError::Draining))).await;
                return;
            }
        };
        let step_id = request_id(&frame);
        let (reply, mut held) = match step_of(&mut seals, frame.kind) {
            Ok(Some((step, sealed))) => {
                let (reply, held, kept) = run_step(ctx, session.take().expect("kept between steps"), step).await;
                if reply.error.is_none() {
                    reader.renew();
                }
                let reply =
                    if sealed && reply.error.is_none() { seals.seal(&reply).unwrap_or_else(|e| error_reply(reply.request_id, &e)) } else { reply };
                let Some(kept) = kept else {
                    let _ = out.send(Ok(reply)).await;
                    return;
                };
                session = Some(kept);
                (reply, held)
            }
            Err(e) => (error_reply(step_id, &e), Reservation::none()),
            Ok(None) => (error_reply(0, &GenerationError::AlreadyOpen.into()), Reservation::none()),
        };
        ctx.unsent.hold(&reply, &mut held);
        if out.send(Ok(reply)).await.is_err() {
            return;
        }
    }
}

/// A frame's step, opened where it came sealed (and whether it did); `None` for a second
/// opening frame.
fn step_of(seals: &mut StreamSeals, kind: Option<generate_frame::Kind>) -> Result<Option<(pb::GenerateStep, bool)>, RequestError> {
    match kind {
        Some(generate_frame::Kind::Step(step)) => Ok(Some((seals.plain(step)?, false))),
        Some(generate_frame::Kind::SealedStep(sealed)) => Ok(Some((seals.open(sealed)?, true))),
        Some(generate_frame::Kind::Open(_)) => Ok(None),
        None => Err(GenerationError::EmptyFrame.into()),
    }
}

fn request_id(frame: &pb::GenerateFrame) -> u64 {
    match &frame.kind {
        Some(generate_frame::Kind::Step(step)) => step.request_id,
        _ => 0,
    }
}

/// Runs `step` through the model's step queue: its answer, the memory it holds until
/// written, and the session back (none where the queue lost it: the stream ends).
async fn run_step(ctx: &GenerateContext, session: Session, step: pb::GenerateStep) -> (GenerateReply, Reservation, Option<Session>) {
    let id = step.request_id;
    let limit = ctx.max_message_bytes.saturating_sub(1 << 10);
    let arrived = Instant::now();
    // The answer is held in the memory budget until written, as every answer is; while the
    // step runs (in parts, for a prompt), so is the tensor its hidden states are decoded into.
    let answer_bytes = limit.min(session.answer_bound(&step));
    let mut held = match ctx.budget.reserve(answer_bytes.saturating_add(step.hidden.len() as u64)).await {
        Ok(held) => held,
        Err(e) => return (error_reply(id, &e.into()), Reservation::none(), Some(session)),
    };
    let ran = ctx.queues.run(&ctx.model, session, step, limit, &ctx.peer_gone).await;
    held.shrink_to(answer_bytes);
    let Some(Ran { session, output, decode, compute }) = ran else {
        return (error_reply(id, &Internal::Cancelled("a generation step").into()), Reservation::none(), None);
    };
    let timings = pb::ServerTimings {
        queue_us: arrived.elapsed().saturating_sub(decode + compute).as_micros() as u64,
        decode_us: decode.as_micros() as u64,
        compute_us: compute.as_micros() as u64,
        encode_us: 0,
    };
    let reply = match output.and_then(|a| answer(id, &a)) {
        Ok(mut reply) => {
            reply.timings = Some(timings);
            ctx.metrics.generation_step(ctx.model.bundle.id());
            ctx.metrics.sent(ctx.model.bundle.id(), reply.output.len() as u64);
            reply
        }
        Err(e) => error_reply(id, &e),
    };
    (reply, held, Some(session))
}

/// A step's answer: its tensors' bytes as they lie (little-endian, contiguous on the CPU).
fn answer(request_id: u64, answer: &Answer) -> Result<GenerateReply, RequestError> {
    let output = &answer.output;
    let dtype = <cleave_common::spec::DType as TorchDType>::from_kind(output.kind())
        .ok_or_else(|| Internal::Torch(format!("an output of {:?}", output.kind())))?;
    let token_ids = answer.token_ids.as_ref().map(bytes_of).transpose()?.unwrap_or_default();
    Ok(GenerateReply {
        request_id,
        output: bytes_of(output)?,
        shape: output.size(),
        dtype: dtype.name().to_string(),
        token_ids,
        ..Default::default()
    })
}

fn bytes_of(tensor: &tch::Tensor) -> Result<Bytes, RequestError> {
    let mut bytes = vec![0u8; tensor.numel() * tensor.kind().elt_size_in_bytes()];
    tensor.f_copy_data_u8(&mut bytes, tensor.numel()).map_err(|e| Internal::Torch(e.to_string()))?;
    Ok(Bytes::from(bytes))
}
