//! One `Train` stream: opens the session from the first frame, then reassembles each call's
//! payload, decodes it (blocking pool), runs it on the session thread and sends the answer
//! back framed like a result, in order: one reply or one error per call, and a failed call
//! leaves the session open. A session opened reattachable outlives a broken stream
//! (`parking`), and a new stream continues it.

use std::sync::{Arc, Mutex};

use cleave_common::config::Limits;
use cleave_common::pb::{self, train_frame, Phase, TrainReply};
use cleave_common::security::ServerSecurity;
use cleave_common::training::microbatch::Microbatch;
use cleave_common::training::{take_targets, TARGETS_VALUE};
use cleave_common::wire::{payload_frames, Direction, FrameAssembler, PayloadReceiver, Reassembly};
use cleave_common::CutTensors;
use tokio::sync::mpsc;
use tonic::{Status, Streaming};
use tracing::Instrument;

use super::admission::Training;
use super::parking::{Attached, Parking};
use super::session::{Answer, Call, SessionHandle};
use crate::budget::{MemoryBudget, Reservation};
use crate::error::{error_frame, GroupError, Internal, RequestError, SessionError};
use crate::metrics::Metrics;
use crate::models::Model;
use crate::payloads::{decode_request, encode_answer, ResultEncoder, ResultSpec};
use crate::peer::Peer;
use crate::reader::{FrameReader, Next};
use crate::streams::OpenStream;
use crate::unsent::{wire_bytes, Unsent};

/// What one `Train` stream needs.
pub(crate) struct TrainContext {
    /// The model the session trains a copy of.
    pub(crate) model: Arc<Model>,
    pub(crate) metrics: Metrics,
    pub(crate) limits: Limits,
    pub(crate) security: Arc<ServerSecurity>,
    pub(crate) training: Training,
    /// Where a reattachable session waits for its host when its stream breaks.
    pub(crate) parking: Parking,
    /// The memory every stream's payloads share (the host's view: its share of it).
    pub(crate) budget: MemoryBudget,
    /// The host's address, when known.
    pub(crate) peer: Option<Peer>,
    /// Where each answer's share of the budget waits for its bytes to be written.
    pub(crate) unsent: Unsent,
}

/// How a stream's calls ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StreamEnd {
    /// The host ended it, or the server did (idle, draining): the session closes.
    Closed,
    /// It broke with the host still there or not: a reattachable session is kept.
    Broken,
}

fn error_reply(request_id: u64, e: &RequestError) -> TrainReply {
    TrainReply { request_id, last: true, error: Some(error_frame(e)), ..Default::default() }
}

/// Serves one `Train` stream: opens the session (or continues a kept one), then answers
/// its calls in order. A reattachable session whose stream breaks is kept for its host.
pub(crate) async fn serve_stream(mut stream: OpenStream<pb::TrainFrame, TrainReply>, ctx: TrainContext) {
    let Some(first) = stream.opening_frame().await else { return };
    let out = &stream.answers;
    let Some(train_frame::Kind::Open(open)) = first.kind else {
        let _ = out.send(Ok(error_reply(0, &SessionError::NotOpened.into()))).await;
        return;
    };
    let attached = match &open.reattach {
        Some(reattach) => ctx.parking.take(reattach, ctx.model.bundle.id()),
        None => open_session(&ctx, &open).await,
    };
    let attached = match attached {
        Ok(attached) => attached,
        Err(e) => {
            tracing::info!(error = %e, "training session refused");
            let _ = out.send(Ok(error_reply(0, &e))).await;
            return;
        }
    };
    let reply = pb::SessionOpened {
        session_id: attached.slot.id.clone(),
        step: attached.session.step(),
        parameters: attached.parameters,
        device: attached.device.clone(),
        namespace: attached.namespace.clone(),
        reattach_token: attached.reattach_token.clone().unwrap_or_default(),
    };
    let ended = if out.send(Ok(TrainReply { opened: Some(reply), last: true, ..Default::default() })).await.is_err() {
        // A new session whose token never reached its host cannot be continued: it closes.
        if open.reattach.is_some() {
            StreamEnd::Broken
        } else {
            StreamEnd::Closed
        }
    } else {
        let _open = ctx.metrics.stream_open("train");
        answer_calls(&mut stream.reader, &ctx, out, &attached).await
    };
    if ended == StreamEnd::Broken && attached.reattach_token.is_some() {
        ctx.parking.keep(attached, ctx.training.options.session_idle_timeout);
    }
}

/// Opens a new session for `open` on the stream's model.
async fn open_session(ctx: &TrainContext, open: &pb::OpenSession) -> Result<Attached, RequestError> {
    let device = (ctx.model.device_spec, ctx.model.scheduler.turns(ctx.model.index));
    let mut setup = ctx.training.setup(&ctx.model.bundle, device, ctx.budget.clone(), open)?;
    let slot = ctx.training.admit(&ctx.model.bundle, open.clients.as_ref().map(|c| c.name.as_str()), ctx.peer.clone())?;
    setup.member = ctx.training.join(&ctx.model.bundle, open)?;
    let (session, opened) = SessionHandle::spawn(setup, &slot.id, ctx.metrics.clone()).await?;
    tracing::info!(
        session = %slot.id, start = open.start, end = open.end, step = opened.step, device = %opened.device, namespace = %opened.namespace,
        reattachable = open.reattachable, "training session open"
    );
    Ok(Attached {
        slot,
        session,
        bundle_id: ctx.model.bundle.id().to_string(),
        start: open.start,
        end: open.end,
        reattach_token: open.reattachable.then(|| hex::encode(rand::random::<[u8; 32]>())),
        parameters: opened.parameters,
        device: opened.device,
        namespace: opened.namespace,
        weights: opened.weights,
        _open: ctx.metrics.session_open(),
    })
}

/// How long after the end of a host's side of the stream a reset may still come: a host that
/// drops its call ends its request side and resets the stream at once (it reads no more).
const RESET_AFTER_END: std::time::Duration = std::time::Duration::from_millis(250);

/// The host ended its side of the stream: it closes the session (it reads on until the server
/// ends its own), unless, for a reattachable session, the answers' reader goes within
/// [`RESET_AFTER_END`]: the host dropped the call, and the stream broke.
async fn host_ended(out: &mpsc::Sender<Result<TrainReply, Status>>, attached: &Attached) -> StreamEnd {
    if attached.reattach_token.is_none() {
        return StreamEnd::Closed;
    }
    match tokio::time::timeout(RESET_AFTER_END, out.closed()).await {
        Ok(()) => StreamEnd::Broken,
        Err(_) => StreamEnd::Closed,
    }
}

/// Answers the calls of a stream in order until it ends.
async fn answer_calls(
    reader: &mut FrameReader<Streaming<pb::TrainFrame>>,
    ctx: &TrainContext,
    out: &mpsc::Sender<Result<TrainReply, Status>>,
    attached: &Attached,
) -> StreamEnd {
    let (slot, session) = (&attached.slot, &attached.session);
    let mut stream = CallStream::new(ctx, attached);
    let idle = ctx.training.options.session_idle_timeout;
    loop {
        // The response went (reset, connection closed): nobody reads the answers.
        let next = reader.next(out.closed()).await;
        let frame = match next {
            Next::Frame(frame) => {
                slot.heard();
                if let Some(train_frame::Kind::Payload(p)) = &frame.kind {
                    ctx.metrics.received(ctx.model.bundle.id(), (p.header.len() + p.data.len()) as u64);
                }
                frame
            }
            Next::End => return host_ended(out, attached).await,
            Next::Broken => return StreamEnd::Broken,
            Next::Refused(e) => {
                // The call part-way in is answered with why; the stream ends, and a
                // reattachable session is kept.
                let _ = out.send(Ok(error_reply(stream.frames.give_up().unwrap_or(0), &e))).await;
                return StreamEnd::Broken;
            }
            Next::Stalled => {
                if let Some(id) = stream.frames.give_up() {
                    if out.send(Ok(error_reply(id, &reader.stalled()))).await.is_err() {
                        return StreamEnd::Broken;
                    }
                }
                continue;
            }
            Next::Idle | Next::Draining => {
                let e = if matches!(next, Next::Draining) {
                    RequestError::Draining
                } else {
                    SessionError::Idle { idle, session: slot.id.clone() }.into()
                };
                tracing::info!(session = %slot.id, error = %e, "training session ended by the server");
                let _ = out.send(Ok(error_reply(stream.frames.give_up().unwrap_or(0), &e))).await;
                return StreamEnd::Closed;
            }
        };
        let (replies, mut held) = match frame.kind {
            Some(train_frame::Kind::Save(save)) => (vec![save_reply(session, save).await], Reservation::none()),
            Some(train_frame::Kind::Clip(clip)) => (vec![clip_reply(session, clip).await], Reservation::none()),
            // The end of a round may wait long for the other edges: a host that leaves
            // meanwhile leaves the session kept (its answer is kept for the call resent).
            Some(train_frame::Kind::EndRound(end)) => tokio::select! {
                reply = end_round_reply(session, end) => (vec![reply], Reservation::none()),
                () = out.closed() => return StreamEnd::Broken,
            },
            Some(train_frame::Kind::Payload(p)) => {
                let handled = stream.call(&p, ctx, session, out).await;
                // A payload part-way in must be complete by its deadline.
                reader.track(&stream.frames);
                match handled {
                    Handled::Replies(replies, held) => (replies, held),
                    Handled::PartWay => continue,
                    Handled::HostGone => return StreamEnd::Broken,
                }
            }
            Some(train_frame::Kind::Open(_)) => (vec![error_reply(0, &SessionError::AlreadyOpen.into())], Reservation::none()),
            None => (vec![error_reply(0, &SessionError::EmptyFrame.into())], Reservation::none()),
        };
        for r in replies {
            ctx.metrics.sent(ctx.model.bundle.id(), (r.header.len() + r.data.len()) as u64);
            ctx.unsent.hold(&r, &mut held);
            if out.send(Ok(r)).await.is_err() {
                return StreamEnd::Broken;
            }
        }
    }
}

/// A `ClipStep` call, answered: the session thread scales the waiting step's gradients
/// and takes it.
async fn clip_reply(session: &SessionHandle, clip: pb::ClipStep) -> TrainReply {
    match session.call(clip.request_id, Call::Clip { coefficient: clip.coefficient }).await {
        Ok((Answer::Stepped { step }, _)) => {
            TrainReply { request_id: clip.request_id, last: true, stepped: Some(pb::StepTaken { step }), ..Default::default() }
        }
        Ok(_) => error_reply(clip.request_id, &Internal::WrongAnswer("ClipStep").into()),
        Err(e) => error_reply(clip.request_id, &e),
    }
}

/// An `EndRound` call, answered once every edge of the session's group has ended the round.
async fn end_round_reply(session: &SessionHandle, end: pb::EndRound) -> TrainReply {
    match session.call(end.request_id, Call::EndRound).await {
        Ok((Answer::RoundEnded { round }, _)) => {
            TrainReply { request_id: end.request_id, last: true, round_ended: Some(pb::RoundEnded { round }), ..Default::default() }
        }
        Ok(_) => error_reply(end.request_id, &Internal::WrongAnswer("EndRound").into()),
        Err(e) => error_reply(end.request_id, &e),
    }
}

/// A `Save` call, answered: the session thread checks the name and the quotas, and writes.
async fn save_reply(session: &SessionHandle, save: pb::SaveCheckpoint) -> TrainReply {
    match session.call(save.request_id, Call::Save { name: save.name }).await {
        Ok((Answer::Saved { name, step }, _)) => {
            TrainReply { request_id: save.request_id, last: true, saved: Some(pb::CheckpointSaved { name, step }), ..Default::default() }
        }
        Ok(_) => error_reply(save.request_id, &Internal::WrongAnswer("Save").into()),
        Err(e) => error_reply(save.request_id, &e),
    }
}

/// What a call's first frame says of it.
struct CallHead {
    phase: Phase,
    /// A training forward's place in its step.
    microbatch: Microbatch,
}

/// What a payload frame comes to.
enum Handled {
    /// The replies to send, and what they hold in the memory budget until written.
    Replies(Vec<TrainReply>, Reservation),
    /// Nothing yet: the payload is part-way in.
    PartWay,
    /// The host left while its call ran.
    HostGone,
}

/// A stream's payload receivers, each with its own replay window; shared with the blocking pool.
#[derive(Clone)]
struct Receivers {
    /// Boundaries in (steps and evaluations).
    requests: Arc<Mutex<PayloadReceiver>>,
    /// Gradients in (U-shaped backward).
    gradients: Arc<Mutex<PayloadReceiver>>,
    /// In a `splitfed` group: the edge's weights at the end of a round.
    weights: Option<Arc<Mutex<PayloadReceiver>>>,
}

impl Receivers {
    /// The receiver of `phase`'s payloads, or why the session takes none.
    fn of(&self, phase: Phase) -> Result<&Arc<Mutex<PayloadReceiver>>, RequestError> {
        match phase {
            Phase::Forward | Phase::Evaluate => Ok(&self.requests),
            Phase::Backward => Ok(&self.gradients),
            Phase::Average => self.weights.as_ref().ok_or_else(|| GroupError::NotSplitFed.into()),
            Phase::Unspecified => Err(SessionError::NoPhase.into()),
        }
    }
}

/// The payload side of a stream: reassembly, decoding and encoding answers.
struct CallStream {
    start: u32,
    end: u32,
    receivers: Receivers,
    encoder: Arc<Mutex<ResultEncoder>>,
    chunk_bytes: usize,
    /// What each payload's first frame says of its call, its bytes in the budget and its
    /// call's span.
    frames: FrameAssembler<(CallHead, Reservation, tracing::Span)>,
}

impl CallStream {
    fn new(ctx: &TrainContext, attached: &Attached) -> Self {
        let (start, end) = (attached.start, attached.end);
        // What each payload declares is checked before its data is reserved: boundaries at
        // the session's start (with the targets when the server computes the loss), gradients
        // at its end (its floating-point tensors).
        let receiver = |d, cut: u32, rule| {
            let receiver = PayloadReceiver::new(d, ctx.limits.max_payload_bytes, ctx.security.policy.clone(), &ctx.security.keys);
            Arc::new(Mutex::new(receiver.checked_at(&ctx.model.bundle, cut as usize, rule).landing_for(ctx.model.torch_device)))
        };
        let holds_loss = end as usize == ctx.model.bundle.stage_count();
        let boundaries = if holds_loss { CutTensors::AllAndMaybe(TARGETS_VALUE) } else { CutTensors::All };
        Self {
            start,
            end,
            receivers: Receivers {
                requests: receiver(Direction::Request, start, boundaries),
                gradients: receiver(Direction::Gradient, end, CutTensors::FloatSubset),
                // The weights travel as requests at `start`, with a replay window of their own.
                weights: attached.weights.as_ref().map(|specs| {
                    let receiver =
                        PayloadReceiver::new(Direction::Request, ctx.limits.max_payload_bytes, ctx.security.policy.clone(), &ctx.security.keys);
                    Arc::new(Mutex::new(receiver.checked_as(Arc::clone(specs))))
                }),
            },
            encoder: Arc::new(Mutex::new(ResultEncoder::new(Arc::clone(&ctx.security), ctx.limits.max_payload_bytes))),
            chunk_bytes: ctx.limits.chunk_bytes(),
            frames: FrameAssembler::default(),
        }
    }

    /// Adds a payload frame; once the payload is complete, runs its call and answers it.
    async fn call(
        &mut self,
        frame: &pb::TrainPayloadFrame,
        ctx: &TrainContext,
        session: &SessionHandle,
        out: &mpsc::Sender<Result<TrainReply, Status>>,
    ) -> Handled {
        let (assembly, (head, bytes, span)) = match self.push(frame, &ctx.budget).await {
            Ok(Some(complete)) => complete,
            Ok(None) => return Handled::PartWay,
            Err((id, e)) => return Handled::Replies(vec![error_reply(id, &e)], Reservation::none()),
        };
        // A host that leaves (its stream reset, its connection closed) takes its call with
        // it: dropping the call before the session thread has the device means it is never run.
        let replies = tokio::select! {
            replies = self.answer(assembly, head, session).instrument(span) => replies,
            () = out.closed() => return Handled::HostGone,
        };
        // The call's reservation becomes its answer's, held until written.
        match ctx.budget.resize(bytes, replies.iter().map(wire_bytes).sum()).await {
            Ok(held) => Handled::Replies(replies, held),
            Err(e) => Handled::Replies(vec![error_reply(replies.first().map_or(0, |r| r.request_id), &e.into())], Reservation::none()),
        }
    }

    /// Adds a frame; a complete payload comes back with its phase (not yet decoded) and its
    /// bytes in the budget (reserved, waiting briefly for room, before its data is).
    async fn push(
        &mut self,
        frame: &pb::TrainPayloadFrame,
        budget: &MemoryBudget,
    ) -> Result<Option<(Reassembly, (CallHead, Reservation, tracing::Span))>, (u64, RequestError)> {
        let started = if self.frames.starts_payload(frame) {
            // Only the receivers cross the await: the stream's frames hold tensors (not `Sync`).
            let receivers = self.receivers.clone();
            Some(Self::start_payload(receivers, frame, budget).await)
        } else {
            None
        };
        self.frames.push_started(frame, started)
    }

    async fn start_payload(
        receivers: Receivers,
        f: &pb::TrainPayloadFrame,
        budget: &MemoryBudget,
    ) -> Result<(Reassembly, (CallHead, Reservation, tracing::Span)), RequestError> {
        let phase = Phase::try_from(f.phase).unwrap_or(Phase::Unspecified);
        let receiver = receivers.of(phase)?;
        let microbatch = if phase == Phase::Forward { f.microbatch()? } else { Microbatch::WHOLE };
        let assembly = receiver.lock().unwrap_or_else(std::sync::PoisonError::into_inner).start(f.request_id, &f.header)?;
        let bytes = budget.reserve(assembly.held_bytes()).await?;
        let span = tracing::debug_span!("train_call", phase = ?phase, request_id = f.request_id);
        cleave_common::telemetry::follow(&span, &f.traceparent);
        Ok((assembly, (CallHead { phase, microbatch }, bytes, span)))
    }

    /// Decodes a complete payload, runs its call and encodes the answer (decoding and
    /// encoding on the blocking pool, the call on the session thread).
    async fn answer(&mut self, assembly: Reassembly, CallHead { phase, microbatch }: CallHead, session: &SessionHandle) -> Vec<TrainReply> {
        let id = assembly.request_id;
        // (Checked against the cut's specs from its envelope, whatever order its tensors come in.)
        let batch = assembly.sizes().map_or(1, |sizes| sizes.batch);
        let receiver = match self.receivers.of(phase) {
            Ok(receiver) => receiver,
            Err(e) => return vec![error_reply(id, &e)],
        };
        let (received, decode_time) = match decode_request(receiver, assembly).instrument(tracing::debug_span!("decode")).await {
            Ok(r) => r,
            Err(e) => return vec![error_reply(id, &e)],
        };
        let expected_cut = if phase == Phase::Backward { self.end } else { self.start };
        if received.split != expected_cut {
            let e = SessionError::WrongCut { cut: received.split, expected: expected_cut, phase }.into();
            return vec![error_reply(id, &e)];
        }
        let (codec, key_id) = (received.codec, received.key_id);
        let mut boundary = received.boundary;
        let call = match phase {
            Phase::Forward => {
                let targets = take_targets(&mut boundary);
                Call::Forward { input: boundary, targets, microbatch, batch }
            }
            Phase::Backward => Call::Backward { grads: boundary },
            Phase::Average => Call::Average { weights: boundary },
            _ => Call::Evaluate { input: boundary },
        };
        let (answer, compute) = match session.call(id, call).instrument(tracing::debug_span!("compute")).await {
            Ok(a) => a,
            Err(e) => return vec![error_reply(id, &e)],
        };
        let spec = |split, direction| ResultSpec { request_id: id, split, codec, key_id, direction, keeps_tensors: true };
        let (loss, norms, boundary, spec) = match answer {
            Answer::Gradients { loss, grads, norms } => (loss, norms.unwrap_or_default(), grads, spec(self.start, Direction::Gradient)),
            // A round's average of the edges' weights comes back at `start`.
            Answer::Output(out) if phase == Phase::Average => (None, Vec::new(), out, spec(self.start, Direction::Result)),
            Answer::Output(out) => (None, Vec::new(), out, spec(self.end, Direction::Result)),
            Answer::Saved { .. } | Answer::Stepped { .. } | Answer::RoundEnded { .. } => {
                return vec![error_reply(id, &Internal::WrongAnswer("payload").into())]
            }
        };
        let (encoded, encode_time) = match encode_answer(&self.encoder, spec, boundary).instrument(tracing::debug_span!("encode")).await {
            Ok(e) => e,
            Err(e) => return vec![error_reply(id, &e)],
        };
        let timings = pb::ServerTimings {
            queue_us: 0,
            decode_us: decode_time.as_micros() as u64,
            compute_us: compute.as_micros() as u64,
            encode_us: encode_time.as_micros() as u64,
        };
        let mut replies: Vec<TrainReply> = payload_frames(id, encoded.envelope, &encoded.data, self.chunk_bytes);
        if let Some(last) = replies.last_mut() {
            (last.loss, last.grad_norms, last.timings) = (loss, norms, Some(timings));
        }
        replies
    }
}
