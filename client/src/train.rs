//! The edge's end of a `Train` stream, from the trainer's thread.
//!
//! The link offers blocking calls, and for a step's micro-batches sends without waiting
//! ([`TrainLink::send_forward`]) whose answers are taken in order; each drives the async
//! stream with the runtime handle. It must therefore be used from a blocking thread, never
//! from an async task.
//!
//! The session is opened reattachable: when the connection breaks, the link connects again
//! (`retry:`), continues the session with its token and resends every call in flight under
//! its id; the server answers a call it had already run from memory (it keeps as many
//! answers as the session's pipeline depth), so no step is taken twice. The link ends the
//! session by closing its side of the stream ([`TrainLink::close`]).

use std::collections::VecDeque;

use cleave_common::pb::{self, train_frame, Phase, TrainFrame, TrainReply};
use cleave_common::protocol::SESSION_NOT_WAITING;
use cleave_common::training::microbatch::Microbatch;
use cleave_common::wire::{payload_frames, Codec, CodecPolicy, Direction, FrameAssembler, Key, KeyRing, PayloadMeta, PayloadReceiver, PayloadSender};
use cleave_common::{Boundary, Bundle};
use tokio::runtime::Handle;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::Streaming;
use tracing::Instrument;

use crate::connector::connect_retrying;
use crate::error::{Breach, LinkError, LinkLost, Refusal};
use crate::link::RetryPolicy;
use crate::session::ServerSession;

type Result<T, E = LinkError> = std::result::Result<T, E>;

/// A training call's answer from the server.
#[derive(Debug)]
pub struct TrainAnswer {
    /// The boundary it sent back (a gradient or a boundary at the session's end cut).
    pub boundary: Boundary,
    /// The loss, when the server computed it.
    pub loss: Option<f64>,
    /// With clipping, on a step's gradient: the norm of each of the server's gradients.
    pub norms: Vec<f32>,
}

/// What the answers of a stream are received with: each stream's answers are sealed under a
/// nonce prefix of their own, so a new stream gets new receivers.
struct AnswerReceivers {
    ring: KeyRing,
    policy: CodecPolicy,
    max_payload: u64,
}

impl AnswerReceivers {
    /// Receivers of results and of gradients.
    fn new_pair(&self) -> (PayloadReceiver, PayloadReceiver) {
        let receiver = |d| PayloadReceiver::new(d, self.max_payload, self.policy.clone(), &self.ring);
        (receiver(Direction::Result), receiver(Direction::Gradient))
    }
}

/// What reaching the server again takes besides the session's URL and link (which its
/// `ServerSession` keeps).
pub struct TrainReconnect {
    /// The bundle the session trains (checked again on the new connection).
    pub bundle: Bundle,
    /// How often and how patiently to connect again.
    pub retry: RetryPolicy,
}

/// An open training session.
pub struct TrainLink {
    runtime: Handle,
    /// The connection the stream runs on.
    session: ServerSession,
    frames: mpsc::Sender<TrainFrame>,
    replies: Streaming<TrainReply>,
    reconnect: TrainReconnect,
    /// What continues the session on a new stream.
    reattach: pb::Reattach,
    codec: Codec,
    /// One sender per direction, so each has its own nonce sequence when sealed.
    boundaries: PayloadSender,
    gradients: PayloadSender,
    results: PayloadReceiver,
    gradient_results: PayloadReceiver,
    answers: AnswerReceivers,
    chunk_bytes: usize,
    next_id: u64,
    start: u32,
    end: u32,
    /// Whether the server computes the loss (its answer to a forward is then a gradient).
    server_has_loss: bool,
    /// Calls sent whose answers have not come, oldest first.
    in_flight: VecDeque<InFlight>,
    /// The stream took no more frames: mended when the next answer is asked for.
    broken: bool,
}

/// How to open a session (frames and payloads are sized by the server's limits).
pub struct SessionRequest {
    /// The session asked for (stages, optimizer, pipeline depth, ...).
    pub open: pb::OpenSession,
    /// The codec of the boundaries and gradients sent.
    pub codec: Codec,
    /// The key id and key payloads are sealed with (plaintext where absent).
    pub key: Option<(u32, Key)>,
}

fn closed() -> LinkError {
    LinkError::Lost(LinkLost::Closed)
}

/// Opens a `Train` stream on `session` with `open` as its first frame; returns it and the
/// session the server opened (or continued).
async fn open_stream(
    session: &mut ServerSession,
    open: pb::OpenSession,
) -> Result<(mpsc::Sender<TrainFrame>, Streaming<TrainReply>, pb::SessionOpened)> {
    let (frames, rx) = mpsc::channel::<TrainFrame>(64);
    let call = session.model_request(ReceiverStream::new(rx));
    frames.send(TrainFrame { kind: Some(train_frame::Kind::Open(open)) }).await.map_err(|_| closed())?;
    let mut replies = session.client.train(call).await.map_err(|s| LinkError::rpc("Train", &s))?.into_inner();
    let first = next_reply(&mut replies).await?;
    let opened = first.opened.ok_or(Breach::NotOpened)?;
    Ok((frames, replies, opened))
}

impl TrainLink {
    /// Opens a reattachable session on a connected client (from async code); the server
    /// loads its stages before it answers.
    pub async fn open(mut session: ServerSession, request: SessionRequest, reconnect: TrainReconnect) -> Result<(Self, pb::SessionOpened)> {
        let (start, end) = (request.open.start, request.open.end);
        let server_has_loss = end as usize == session.model.stage_count;
        let open = pb::OpenSession { reattachable: true, ..request.open };
        let (frames, replies, opened) = open_stream(&mut session, open).await?;
        let reattach = pb::Reattach { session_id: opened.session_id.clone(), token: opened.reattach_token.clone() };
        let ring = KeyRing::new(request.key.clone()).expect("one key");
        let sender = || -> Result<PayloadSender> {
            Ok(match &request.key {
                Some((id, _)) => PayloadSender::sealed(&ring, *id)?,
                None => PayloadSender::plain(),
            })
        };
        // Answers must come back sealed when calls go sealed: a stripped seal is refused.
        let policy = CodecPolicy { require_encryption: request.key.is_some(), ..CodecPolicy::default() };
        let answers = AnswerReceivers { ring: ring.clone(), policy, max_payload: session.max_payload_bytes() };
        let (results, gradient_results) = answers.new_pair();
        let chunk_bytes = session.chunk_bytes();
        let link = Self {
            runtime: Handle::current(),
            session,
            frames,
            replies,
            reconnect,
            reattach,
            codec: request.codec,
            boundaries: sender()?,
            gradients: sender()?,
            results,
            gradient_results,
            answers,
            chunk_bytes,
            next_id: 1,
            start,
            end,
            server_has_loss,
            in_flight: VecDeque::new(),
            broken: false,
        };
        Ok((link, opened))
    }

    /// A training step's boundary at `start` (with the targets when the server has the
    /// loss), of the whole batch or one of its micro-batches.
    pub fn forward(&mut self, boundary: &Boundary, microbatch: Microbatch) -> Result<TrainAnswer> {
        self.send_forward(boundary, microbatch)?;
        self.next_answer()
    }

    /// [`Self::forward`] without waiting for the answer: micro-batches are sent one after
    /// another while the server works, and their answers taken in order with
    /// [`Self::forward_answer`] (at most the session's pipeline depth in flight).
    pub fn send_forward(&mut self, boundary: &Boundary, microbatch: Microbatch) -> Result<()> {
        let expect = if self.server_has_loss { (Direction::Gradient, self.start) } else { (Direction::Result, self.end) };
        let id = self.take_id();
        let to = (Direction::Request, self.start);
        self.send(InFlight { id, phase: Phase::Forward, microbatch, to, boundary: boundary.shallow_clone(), expect })
    }

    /// The answer to the oldest forward sent with [`Self::send_forward`].
    pub fn forward_answer(&mut self) -> Result<TrainAnswer> {
        self.next_answer()
    }

    /// U-shaped: the gradient at `end` of the step just sent; answers the gradient at `start`.
    pub fn backward(&mut self, grads: &Boundary) -> Result<TrainAnswer> {
        self.call(Phase::Backward, Microbatch::WHOLE, (Direction::Gradient, self.end), grads, (Direction::Gradient, self.start))
    }

    /// An evaluation batch at `start`; answers the boundary at `end` (eval mode).
    pub fn evaluate(&mut self, boundary: &Boundary) -> Result<TrainAnswer> {
        self.call(Phase::Evaluate, Microbatch::WHOLE, (Direction::Request, self.start), boundary, (Direction::Result, self.end))
    }

    /// Asks the server to write its checkpoint `name`; returns the step it holds.
    pub fn save(&mut self, name: &str) -> Result<u64> {
        let id = self.take_id();
        let kind = train_frame::Kind::Save(pb::SaveCheckpoint { request_id: id, name: name.to_string() });
        Ok(self.message(id, kind)?.saved.ok_or(Breach::NotSaved)?.step)
    }

    /// With clipping: what the gradients of the step just answered are multiplied by; the
    /// server scales its own and takes the step. Returns the steps it has taken.
    pub fn clip_step(&mut self, coefficient: f32) -> Result<u64> {
        let id = self.take_id();
        let kind = train_frame::Kind::Clip(pb::ClipStep { request_id: id, coefficient });
        Ok(self.message(id, kind)?.stepped.ok_or(Breach::NotStepped)?.step)
    }

    /// In a client group: this edge's steps of the round are taken; returns once every edge
    /// of the group has ended the round, with the rounds ended.
    pub fn end_round(&mut self) -> Result<u64> {
        let id = self.take_id();
        let kind = train_frame::Kind::EndRound(pb::EndRound { request_id: id });
        Ok(self.message(id, kind)?.round_ended.ok_or(Breach::RoundNotEnded)?.round)
    }

    /// In a `splitfed` group: [`Self::end_round`] with this edge's weights; answers the
    /// average of every edge's.
    pub fn average(&mut self, weights: &Boundary) -> Result<Boundary> {
        let at_start = (Direction::Request, self.start);
        Ok(self.call(Phase::Average, Microbatch::WHOLE, at_start, weights, (Direction::Result, self.start))?.boundary)
    }

    /// Ends the session: closes this side of the stream and waits for the server to end its
    /// own, so that it does not keep the session for a host that has finished.
    pub fn close(self) {
        let Self { runtime, frames, mut replies, .. } = self;
        drop(frames);
        let ended =
            runtime.block_on(tokio::time::timeout(std::time::Duration::from_secs(10), async { while let Some(Ok(_)) = replies.next().await {} }));
        if ended.is_err() {
            tracing::warn!("the server did not end the training stream within 10 s; the session closes when its idle timeout passes");
        }
    }

    /// Runs `call` (one attempt of a call under its id); when the link broke, continues the
    /// session on a new connection, sends every call in flight again and tries again, as
    /// [`RetryPolicy::resuming`] rules.
    fn resuming<T>(&mut self, call: impl AsyncFnMut(&mut Self) -> Result<T>) -> Result<T> {
        let (runtime, retry) = (self.runtime.clone(), self.reconnect.retry);
        runtime.block_on(retry.resuming(self, reattachable, call, Self::reattach))
    }

    /// Connects again, continues the session on a new stream and sends every call in flight
    /// on it under its id (the server answers those it had run from memory).
    async fn reattach(&mut self) -> Result<()> {
        tracing::info!(session = %self.reattach.session_id, "continuing the training session on a new connection");
        let mut session = connect_retrying(&self.session.url, &self.reconnect.bundle, &self.session.link, &self.reconnect.retry).await?;
        let open = pb::OpenSession { reattach: Some(self.reattach.clone()), ..Default::default() };
        let (frames, replies, _) = open_stream(&mut session, open).await?;
        (self.session, self.frames, self.replies) = (session, frames, replies);
        (self.results, self.gradient_results) = self.answers.new_pair();
        self.broken = false;
        let calls: Vec<InFlight> = self.in_flight.iter().map(InFlight::shallow_clone).collect();
        for call in &calls {
            self.send_call(call).await?;
        }
        Ok(())
    }

    /// A call `id` that is one message each way (no payload).
    fn message(&mut self, id: u64, kind: train_frame::Kind) -> Result<TrainReply> {
        self.resuming(async |link| {
            if link.broken {
                return Err(closed());
            }
            send(&link.frames, &mut link.replies, TrainFrame { kind: Some(kind.clone()) }).await?;
            let reply = next_reply(&mut link.replies).await?;
            check_id(&reply, id)?;
            Ok(reply)
        })
    }

    fn take_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    fn call(
        &mut self,
        phase: Phase,
        microbatch: Microbatch,
        to: (Direction, u32),
        boundary: &Boundary,
        expect: (Direction, u32),
    ) -> Result<TrainAnswer> {
        let id = self.take_id();
        self.send(InFlight { id, phase, microbatch, to, boundary: boundary.shallow_clone(), expect })?;
        self.next_answer()
    }

    /// Sends a call without waiting for its answer ([`Self::next_answer`] takes the answers
    /// in order). A link found broken here is mended when the next answer is asked for.
    fn send(&mut self, call: InFlight) -> Result<()> {
        let sent = if self.broken { Ok(()) } else { self.runtime.clone().block_on(self.send_call(&call)) };
        self.in_flight.push_back(call);
        match sent {
            Err(LinkError::Lost(_)) => {
                self.broken = true;
                Ok(())
            }
            other => other,
        }
    }

    /// The answer to the oldest call in flight. When the link broke, continues the session
    /// on a new connection (which sends every call in flight again) and waits again.
    fn next_answer(&mut self) -> Result<TrainAnswer> {
        let oldest = self.in_flight.front().map(InFlight::shallow_clone).ok_or(Breach::NothingInFlight)?;
        let answer = self.resuming(async |link| if link.broken { Err(closed()) } else { link.receive(&oldest).await })?;
        self.in_flight.pop_front();
        Ok(answer)
    }

    /// Encodes a call and hands its frames to the stream.
    async fn send_call(&mut self, call: &InFlight) -> Result<()> {
        let (direction, split) = call.to;
        let span = tracing::debug_span!("train_call", phase = ?call.phase, request_id = call.id);
        let sender = if direction == Direction::Gradient { &mut self.gradients } else { &mut self.boundaries };
        let encoded = span.in_scope(|| sender.encode(PayloadMeta { request_id: call.id, split, direction }, &self.codec, &call.boundary))?;
        let mut payload: Vec<pb::TrainPayloadFrame> = payload_frames(call.id, encoded.envelope, &encoded.data, self.chunk_bytes);
        if let Some(first) = payload.first_mut() {
            first.phase = call.phase as i32;
            if call.phase == Phase::Forward {
                first.set_microbatch(call.microbatch);
            }
            first.traceparent = cleave_common::telemetry::traceparent(&span).unwrap_or_default();
        }
        let (frames, replies) = (&self.frames, &mut self.replies);
        async {
            for frame in payload {
                send(frames, replies, TrainFrame { kind: Some(train_frame::Kind::Payload(frame)) }).await?;
            }
            Ok(())
        }
        .instrument(span)
        .await
    }

    /// Receives the answer to `call`, the next one on the stream.
    async fn receive(&mut self, call: &InFlight) -> Result<TrainAnswer> {
        let (id, expect) = (call.id, call.expect);
        let receiver = if expect.0 == Direction::Gradient { &mut self.gradient_results } else { &mut self.results };
        let mut answer = FrameAssembler::default();
        let (received, loss, norms) = loop {
            let reply = next_reply(&mut self.replies).await?;
            check_id(&reply, id)?;
            let assembled = answer.push(&reply, |r| receiver.start(r.request_id, &r.header).map(|a| (a, ()))).map_err(|(_, e)| e)?;
            if let Some((assembly, ())) = assembled {
                break (receiver.finish(assembly)?, reply.loss, reply.grad_norms);
            }
        };
        if received.split != expect.1 {
            return Err(Breach::WrongCut { got: received.split, expected: expect.1 }.into());
        }
        Ok(TrainAnswer { boundary: received.boundary, loss, norms })
    }
}

/// Whether a new connection can mend `error`: the link was lost, or the server has not yet
/// noticed that the session's old stream broke (it is asked again a little later; a server
/// that restarted, or a session closed meanwhile, answers the same).
fn reattachable(error: &LinkError) -> bool {
    match error {
        LinkError::Lost(_) => true,
        LinkError::Refused(Refusal::Call { message, .. }) => message.contains(SESSION_NOT_WAITING),
        _ => false,
    }
}

/// A call sent whose answer has not come: what sends it again.
struct InFlight {
    id: u64,
    phase: Phase,
    microbatch: Microbatch,
    /// The direction and cut of what is sent, and of the answer expected.
    to: (Direction, u32),
    boundary: Boundary,
    expect: (Direction, u32),
}

impl InFlight {
    fn shallow_clone(&self) -> Self {
        Self { boundary: self.boundary.shallow_clone(), ..*self }
    }
}

/// Sends a frame of a call. When the stream no longer takes frames, the server may have ended
/// it on purpose (idle, a refusal) with an error reply first: that error, rather than a lost
/// link (which would continue the session).
async fn send(frames: &mpsc::Sender<TrainFrame>, replies: &mut Streaming<TrainReply>, frame: TrainFrame) -> Result<()> {
    if frames.send(frame).await.is_ok() {
        return Ok(());
    }
    match tokio::time::timeout(std::time::Duration::from_secs(5), next_reply(replies)).await {
        Ok(Err(refused @ LinkError::Refused(_))) => Err(refused),
        _ => Err(closed()),
    }
}

async fn next_reply(replies: &mut Streaming<TrainReply>) -> Result<TrainReply> {
    let reply = match replies.next().await {
        Some(Ok(reply)) => reply,
        Some(Err(status)) => return Err(LinkError::Lost(LinkLost::Failed { code: status.code(), message: status.message().to_string() })),
        None => return Err(closed()),
    };
    if let Some(e) = &reply.error {
        return Err(Refusal::Call { call: reply.request_id, code: tonic::Code::from_i32(e.code), message: e.message.clone() }.into());
    }
    Ok(reply)
}

fn check_id(reply: &TrainReply, id: u64) -> Result<()> {
    if reply.request_id != id {
        return Err(Breach::OutOfOrder { answered: reply.request_id, waiting: id }.into());
    }
    Ok(())
}
