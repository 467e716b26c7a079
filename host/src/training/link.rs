//! The edge's end of a `Train` stream: one call at a time, from the trainer's thread.
//!
//! Training is a strict sequence (a step's gradient must come back before the prefix can
//! step), so the link offers blocking calls; each drives the async stream with the runtime
//! handle. It must therefore be used from a blocking thread, never from an async task.
//!
//! The session is opened reattachable: when the connection breaks, the link connects again
//! (`retry:`), continues the session with its token and resends the call under its id; the
//! server answers a call it had already run from memory, so no step is taken twice. The link
//! ends the session by closing its side of the stream ([`TrainLink::close`]).

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

use crate::config::RetryPolicy;
use crate::error::{Breach, HostError, LinkLost, Refusal, Result};
use crate::session::{connect_retrying, EdgeSession};

/// An answer from the server.
pub(crate) struct Answer {
    /// The boundary it sent back (a gradient or a boundary at the session's end cut).
    pub(crate) boundary: Boundary,
    /// The loss, when the server computed it.
    pub(crate) loss: Option<f64>,
    /// With clipping, on a step's gradient: the norm of each of the server's gradients.
    pub(crate) norms: Vec<f32>,
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
/// `EdgeSession` keeps).
pub(crate) struct Reconnect {
    pub(crate) bundle: Bundle,
    pub(crate) retry: RetryPolicy,
}

/// An open training session.
pub(crate) struct TrainLink {
    runtime: Handle,
    /// The connection the stream runs on.
    session: EdgeSession,
    frames: mpsc::Sender<TrainFrame>,
    replies: Streaming<TrainReply>,
    reconnect: Reconnect,
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
}

/// How to open a session (frames and payloads are sized by the server's limits).
pub(crate) struct SessionRequest {
    pub(crate) open: pb::OpenSession,
    pub(crate) codec: Codec,
    pub(crate) key: Option<(u32, Key)>,
}

fn closed() -> HostError {
    HostError::Lost(LinkLost::Closed)
}

/// Opens a `Train` stream on `session` with `open` as its first frame; returns it and the
/// session the server opened (or continued).
async fn open_stream(
    session: &mut EdgeSession,
    open: pb::OpenSession,
) -> Result<(mpsc::Sender<TrainFrame>, Streaming<TrainReply>, pb::SessionOpened)> {
    let (frames, rx) = mpsc::channel::<TrainFrame>(64);
    let call = session.model_request(ReceiverStream::new(rx));
    frames.send(TrainFrame { kind: Some(train_frame::Kind::Open(open)) }).await.map_err(|_| closed())?;
    let mut replies = session.client.train(call).await.map_err(|s| HostError::rpc("Train", &s))?.into_inner();
    let first = next_reply(&mut replies).await?;
    let opened = first.opened.ok_or(Breach::NotOpened)?;
    Ok((frames, replies, opened))
}

impl TrainLink {
    /// Opens a reattachable session on a connected client (from async code); the server
    /// loads its stages before it answers.
    pub(crate) async fn open(mut session: EdgeSession, request: SessionRequest, reconnect: Reconnect) -> Result<(Self, pb::SessionOpened)> {
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
        };
        Ok((link, opened))
    }

    /// A training step's boundary at `start` (with the targets when the server has the
    /// loss), of the whole batch or one of its micro-batches.
    pub(crate) fn forward(&mut self, boundary: &Boundary, microbatch: Microbatch) -> Result<Answer> {
        let expect = if self.server_has_loss { (Direction::Gradient, self.start) } else { (Direction::Result, self.end) };
        self.call(Phase::Forward, microbatch, (Direction::Request, self.start), boundary, expect)
    }

    /// U-shaped: the gradient at `end` of the step just sent; answers the gradient at `start`.
    pub(crate) fn backward(&mut self, grads: &Boundary) -> Result<Answer> {
        self.call(Phase::Backward, Microbatch::WHOLE, (Direction::Gradient, self.end), grads, (Direction::Gradient, self.start))
    }

    /// An evaluation batch at `start`; answers the boundary at `end` (eval mode).
    pub(crate) fn evaluate(&mut self, boundary: &Boundary) -> Result<Answer> {
        self.call(Phase::Evaluate, Microbatch::WHOLE, (Direction::Request, self.start), boundary, (Direction::Result, self.end))
    }

    /// Asks the server to write its checkpoint `name`; returns the step it holds.
    pub(crate) fn save(&mut self, name: &str) -> Result<u64> {
        let id = self.take_id();
        self.reattaching(|link| link.try_save(id, name))
    }

    /// With clipping: what the gradients of the step just answered are multiplied by; the
    /// server scales its own and takes the step. Returns the steps it has taken.
    pub(crate) fn clip_step(&mut self, coefficient: f32) -> Result<u64> {
        let id = self.take_id();
        self.reattaching(|link| link.try_clip_step(id, coefficient))
    }

    /// Ends the session: closes this side of the stream and waits for the server to end its
    /// own, so that it does not keep the session for a host that has finished.
    pub(crate) fn close(self) {
        let Self { runtime, frames, mut replies, .. } = self;
        drop(frames);
        let ended =
            runtime.block_on(tokio::time::timeout(std::time::Duration::from_secs(10), async { while let Some(Ok(_)) = replies.next().await {} }));
        if ended.is_err() {
            tracing::warn!("the server did not end the training stream within 10 s; the session closes when its idle timeout passes");
        }
    }

    /// Runs `call` (one attempt of a call under its id); when the link broke, continues the
    /// session on a new connection and tries again, up to `retry.max_attempts` times.
    fn reattaching<T>(&mut self, mut call: impl FnMut(&mut Self) -> Result<T>) -> Result<T> {
        let mut attempts = 1;
        loop {
            match call(self) {
                Err(HostError::Lost(reason)) if attempts < self.reconnect.retry.max_attempts => {
                    attempts += 1;
                    tracing::warn!(session = %self.reattach.session_id, %reason, "the training link broke: continuing the session on a new connection");
                    match self.reattach_session() {
                        // Lost again while continuing: the call fails at once on the old link,
                        // and the next attempt continues the session again.
                        Ok(()) | Err(HostError::Lost(_)) => {}
                        Err(e) => return Err(e),
                    }
                }
                other => return other,
            }
        }
    }

    /// Connects again and continues the session on a new stream.
    fn reattach_session(&mut self) -> Result<()> {
        let (r, old) = (&self.reconnect, &self.session);
        let open = pb::OpenSession { reattach: Some(self.reattach.clone()), ..Default::default() };
        let (session, frames, replies) = self.runtime.block_on(async {
            let mut session = connect_retrying(&old.url, &r.bundle, &old.link, &r.retry).await?;
            // The server may not have noticed yet that the old stream broke: it says so, and
            // the session is asked for again a little later, up to `retry.max_attempts` times
            // (a server that restarted, or a session closed meanwhile, answers the same).
            let mut backoff = r.retry.backoff();
            let mut asked = 1;
            loop {
                match open_stream(&mut session, open.clone()).await {
                    Ok((frames, replies, _)) => return Ok((session, frames, replies)),
                    Err(HostError::Refused(Refusal::Call { message, .. }))
                        if message.contains(SESSION_NOT_WAITING) && asked < r.retry.max_attempts =>
                    {
                        asked += 1;
                        tokio::time::sleep(backoff.next().unwrap_or(r.retry.max_backoff)).await;
                    }
                    Err(e) => return Err(e),
                }
            }
        })?;
        (self.session, self.frames, self.replies) = (session, frames, replies);
        (self.results, self.gradient_results) = self.answers.new_pair();
        Ok(())
    }

    fn try_clip_step(&mut self, id: u64, coefficient: f32) -> Result<u64> {
        let frame = TrainFrame { kind: Some(train_frame::Kind::Clip(pb::ClipStep { request_id: id, coefficient })) };
        let (frames, replies) = (&self.frames, &mut self.replies);
        self.runtime.block_on(async {
            send(frames, replies, frame).await?;
            let reply = next_reply(replies).await?;
            check_id(&reply, id)?;
            Ok(reply.stepped.ok_or(Breach::NotStepped)?.step)
        })
    }

    fn try_save(&mut self, id: u64, name: &str) -> Result<u64> {
        let frame = TrainFrame { kind: Some(train_frame::Kind::Save(pb::SaveCheckpoint { request_id: id, name: name.to_string() })) };
        let (frames, replies) = (&self.frames, &mut self.replies);
        self.runtime.block_on(async {
            send(frames, replies, frame).await?;
            let reply = next_reply(replies).await?;
            check_id(&reply, id)?;
            Ok(reply.saved.ok_or(Breach::NotSaved)?.step)
        })
    }

    fn take_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    fn call(&mut self, phase: Phase, microbatch: Microbatch, to: (Direction, u32), boundary: &Boundary, expect: (Direction, u32)) -> Result<Answer> {
        let id = self.take_id();
        self.reattaching(|link| link.try_call(id, (phase, microbatch), to, boundary, expect))
    }

    /// One attempt of call `id`: `to` is the direction and cut of what is sent.
    fn try_call(
        &mut self,
        id: u64,
        head: (Phase, Microbatch),
        to: (Direction, u32),
        boundary: &Boundary,
        expect: (Direction, u32),
    ) -> Result<Answer> {
        let (phase, microbatch) = head;
        let (direction, split) = to;
        let call = tracing::debug_span!("train_call", phase = ?phase, request_id = id).entered();
        let sender = if direction == Direction::Gradient { &mut self.gradients } else { &mut self.boundaries };
        let encoded = sender.encode(PayloadMeta { request_id: id, split, direction }, &self.codec, boundary)?;
        let mut payload: Vec<pb::TrainPayloadFrame> = payload_frames(id, encoded.envelope, &encoded.data, self.chunk_bytes);
        if let Some(first) = payload.first_mut() {
            first.phase = phase as i32;
            if phase == Phase::Forward {
                first.set_microbatch(microbatch);
            }
            first.traceparent = cleave_common::telemetry::traceparent(&call).unwrap_or_default();
        }
        let receiver = if expect.0 == Direction::Gradient { &mut self.gradient_results } else { &mut self.results };
        let (frames, replies) = (&self.frames, &mut self.replies);
        let (received, loss, norms) = self.runtime.block_on(async {
            for frame in payload {
                send(frames, replies, TrainFrame { kind: Some(train_frame::Kind::Payload(frame)) }).await?;
            }
            let mut answer = FrameAssembler::default();
            loop {
                let reply = next_reply(replies).await?;
                check_id(&reply, id)?;
                let assembled = answer.push(&reply, |r| receiver.start(r.request_id, &r.header).map(|a| (a, ()))).map_err(|(_, e)| e)?;
                if let Some((assembly, ())) = assembled {
                    return Ok::<_, HostError>((receiver.finish(assembly)?, reply.loss, reply.grad_norms));
                }
            }
        })?;
        if received.split != expect.1 {
            return Err(Breach::WrongCut { got: received.split, expected: expect.1 }.into());
        }
        Ok(Answer { boundary: received.boundary, loss, norms })
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
        Ok(Err(refused @ HostError::Refused(_))) => Err(refused),
        _ => Err(closed()),
    }
}

async fn next_reply(replies: &mut Streaming<TrainReply>) -> Result<TrainReply> {
    let reply = match replies.next().await {
        Some(Ok(reply)) => reply,
        Some(Err(status)) => return Err(HostError::Lost(LinkLost::Failed { code: status.code(), message: status.message().to_string() })),
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
