//! The `Infer` stream. Each stream has a reader task, which reassembles requests, decodes
//! and checks them and queues them for the compute worker, and a responder task, which
//! answers them in arrival order. Every request id gets exactly one result or one error
//! frame; a bad request never ends the stream.
//!
//! What a stream holds is bounded: at most `limits.max_requests_per_stream` requests between
//! their first frame and their answer (the stream is not read further until one is
//! answered); each request's declared bytes, or the room its answer will take where that is
//! more, reserved in the server's memory budget before its data is read or its result
//! computed, that reservation becoming its answer's when its result comes, held until the
//! answer is written (see [`crate::unsent`]); a request whose frames stall past
//! `limits.request_timeout` answered DEADLINE_EXCEEDED and freed; an answer its host does not
//! take within `limits.answer_timeout` closes the connection. When the server drains, the
//! reader stops and what was received is answered.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cleave_common::pb::{self, InferFrame, ResultFrame};
use cleave_common::security::ServerSecurity;
use cleave_common::spec::{BoundarySizes, Sizes};
use cleave_common::wire::{payload_frames, Codec, Direction, FrameAssembler, PayloadReceiver, Reassembly, Received};
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tonic::{Status, Streaming};
use tracing::Instrument;

use crate::budget::{MemoryBudget, Reservation};
use crate::error::{error_frame, status_code, Internal, RequestError};
use crate::metrics::{Answered, Metrics};
use crate::models::Model;
use crate::payloads::{decode_request, encode_answer, ResultEncoder, ResultSpec};
use crate::reader::{FrameReader, Next};
use crate::scheduler::{InferJob, JobResult};
use crate::streams::OpenStream;
use crate::unsent::{answer_bytes, Unsent};
use crate::window::{HostSession, ResultWindow};

/// What one `Infer` stream needs.
pub(crate) struct InferContext {
    /// The model the stream's host runs (its device's scheduler runs the suffixes).
    pub(crate) model: Arc<Model>,
    /// Opens and decodes the stream's requests (shared with the blocking pool).
    pub(crate) receiver: Arc<Mutex<PayloadReceiver>>,
    pub(crate) metrics: Metrics,
    /// Keys the results are sealed with.
    pub(crate) security: Arc<ServerSecurity>,
    /// The largest result (tensor bytes) sent back.
    pub(crate) max_payload_bytes: u64,
    /// Data bytes per result frame.
    pub(crate) chunk_bytes: usize,
    /// Requests between their first frame and their answer.
    pub(crate) max_requests: usize,
    /// The memory every stream's requests share.
    pub(crate) budget: MemoryBudget,
    /// Cancelled when the server starts draining.
    pub(crate) draining: CancellationToken,
    /// The window of recent results and the session of this stream's host, when it gave one.
    pub(crate) window: Option<(ResultWindow, HostSession)>,
    /// Cancelled when the stream's response is dropped: its peer reset the stream or its
    /// connection closed (or the stream ended, with nothing left to answer).
    pub(crate) peer_gone: CancellationToken,
    /// Where each result frame's share of the budget waits for its bytes to be written.
    pub(crate) unsent: Unsent,
}

/// Serves one stream: its reader and its responder, results to the stream's answers.
pub(crate) async fn serve_stream(open: OpenStream<InferFrame, ResultFrame>, ctx: InferContext) {
    let (pending_tx, pending_rx) = mpsc::channel::<Pending>(ctx.max_requests);
    let encoder = ResultEncoder::new(Arc::clone(&ctx.security), ctx.max_payload_bytes);
    let responder = Responder {
        out: open.answers.clone(),
        encoder: Arc::new(Mutex::new(encoder)),
        chunk_bytes: ctx.chunk_bytes,
        unsent: ctx.unsent.clone(),
        model: Arc::clone(&ctx.model),
        metrics: ctx.metrics.clone(),
    };
    let responder = tokio::spawn(responder.respond(pending_rx));
    let reader = tokio::spawn(read_requests(open.reader, ctx, pending_tx));
    match reader.await {
        // The call's bytes were refused with no request part-way in: it ends with why, after
        // the answers to the requests before.
        Ok(Some(refused)) => {
            let _ = responder.await;
            let _ = open.answers.send(Err(refused.into())).await;
        }
        Ok(None) => {}
        // A panic in the reader (a bug) ends the stream with INTERNAL rather than silently.
        Err(e) => {
            if e.is_panic() {
                let message = crate::error::panic_message(e.into_panic().as_ref());
                tracing::error!(panic = %message, "an Infer stream's reader panicked");
                let _ = open.answers.send(Err(RequestError::Panicked(format!("the stream's reader panicked: {message}")).into())).await;
            }
        }
    }
}

/// What a request holds from its first frame to its answer: its place among the stream's
/// requests and its bytes in the memory budget (until its result comes: they are its
/// answer's then).
struct Held {
    /// When its first frame came.
    since: Instant,
    _slot: Slot,
    bytes: Option<Reservation>,
    /// The request's envelope: its result is kept in the window under it.
    envelope: bytes::Bytes,
    /// The request's span, in its host's trace when the host sent one.
    span: tracing::Span,
    /// Open while its frames are read.
    reading: tracing::Span,
}

/// A request waiting for its answer, in arrival order.
struct Pending {
    request_id: u64,
    split: u32,
    decode_us: u64,
    /// The result travels back with the request's codec and key.
    codec: Codec,
    key_id: Option<u32>,
    answer: oneshot::Receiver<Answer>,
    /// What it holds until answered (none for one refused before its first frame was read).
    held: Option<Held>,
    /// The request's span (none for one refused before its first frame was read).
    span: tracing::Span,
}

impl Pending {
    /// When its first frame came (now, for a request refused before it had one).
    fn since(&self) -> Instant {
        self.held.as_ref().map_or_else(Instant::now, |h| h.since)
    }

    /// A request answered at once (with an error, before it reached the worker).
    fn answered(request_id: u64, answer: Answer) -> Self {
        let (tx, rx) = oneshot::channel();
        let _ = tx.send(answer);
        Self { request_id, split: 0, decode_us: 0, codec: Codec::RAW, key_id: None, answer: rx, held: None, span: tracing::Span::none() }
    }
}

/// Reads the stream's requests until it ends; the error its call ends with when its request
/// bytes were refused as they came (after the answers to the requests before).
async fn read_requests(mut reader: FrameReader<Streaming<InferFrame>>, ctx: InferContext, pending: mpsc::Sender<Pending>) -> Option<RequestError> {
    let slots = Slots::new(ctx.max_requests);
    let mut frames = FrameAssembler::<Held>::default();
    loop {
        // A new request needs a place among the stream's requests before it is read.
        let mut slot = None;
        if !frames.in_progress() {
            tokio::select! {
                biased;
                () = ctx.draining.cancelled() => return None,
                s = Arc::clone(&slots.places).acquire_owned() => slot = s.ok(),
            }
        }
        // Answers are sent by the responder, which goes with the stream.
        let next = reader.next(std::future::pending()).await;
        let frame = match next {
            Next::Frame(frame) => {
                ctx.metrics.received(ctx.model.bundle.id(), (frame.header.len() + frame.data.len()) as u64);
                frame
            }
            Next::End | Next::Broken => return None,
            Next::Refused(e) => {
                // The request part-way in is answered with why (none: the call ends with it).
                match frames.give_up() {
                    Some(id) => {
                        let _ = pending.send(given_up(id, e)).await;
                        return None;
                    }
                    None => return Some(e),
                }
            }
            Next::Idle if slots.busy(slot.is_some()) => {
                // Requests are being answered: the stream is working.
                reader.renew();
                continue;
            }
            // A request was answered since the stream was last active: it has another idle
            // period from now (`next` starts one).
            Next::Idle if slots.freed_at() > reader.active_at() => continue,
            Next::Idle => {
                // (A request part-way in has its own deadline, which comes first: Stalled.)
                tracing::debug!("ending an Infer stream with no request in progress (`limits.idle_stream_timeout`)");
                return None;
            }
            Next::Stalled | Next::Draining => {
                let draining = matches!(next, Next::Draining);
                if let Some(id) = frames.give_up() {
                    let e = if draining { RequestError::Draining } else { reader.stalled() };
                    reader.track(&frames);
                    if pending.send(given_up(id, e)).await.is_err() {
                        return None;
                    }
                }
                if draining {
                    return None;
                }
                continue;
            }
        };
        let done = match (frames.starts_payload(&frame), slot) {
            (true, Some(slot)) => match start_request(&ctx.receiver, &ctx, &frame, slots.held(slot)).await {
                Ok(Started::Recalled(answer)) => {
                    frames.skip_payload(&frame);
                    Some(answer)
                }
                Ok(Started::New(assembly, held)) => push(&mut frames, &frame, Some(Ok((*assembly, held))), &ctx).await,
                Err(e) => push(&mut frames, &frame, Some(Err(e)), &ctx).await,
            },
            _ => push(&mut frames, &frame, None, &ctx).await,
        };
        // A request part-way in must be complete by its deadline.
        reader.track(&frames);
        if let Some(done) = done {
            if pending.send(done).await.is_err() {
                return None;
            }
        }
    }
}

/// The places of a stream's requests (`limits.max_requests_per_stream`), one held by each
/// request from its first frame to its answer, and when one was last given back.
struct Slots {
    places: Arc<Semaphore>,
    max: usize,
    freed_at: Arc<Mutex<tokio::time::Instant>>,
}

/// A request's place among its stream's: given back with its answer, the stream's last work.
struct Slot {
    _place: OwnedSemaphorePermit,
    freed_at: Arc<Mutex<tokio::time::Instant>>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        *self.freed_at.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = tokio::time::Instant::now();
    }
}

impl Slots {
    fn new(max: usize) -> Self {
        Self { places: Arc::new(Semaphore::new(max)), max, freed_at: Arc::new(Mutex::new(tokio::time::Instant::now())) }
    }

    /// The place taken for the next request, now held by a request.
    fn held(&self, place: OwnedSemaphorePermit) -> Slot {
        Slot { _place: place, freed_at: Arc::clone(&self.freed_at) }
    }

    /// Whether a request is between its first frame and its answer (`reading`: one place is
    /// taken for the next request, not yet read).
    fn busy(&self, reading: bool) -> bool {
        self.places.available_permits() + usize::from(reading) < self.max
    }

    /// When a request last gave its place back.
    fn freed_at(&self) -> tokio::time::Instant {
        *self.freed_at.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A request's first frame, started: its reassembly and what it holds, or why it is refused.
type StartResult = Result<(Reassembly, Held), RequestError>;

/// Adds `frame` to the request part-way in (`started` with it, when it is a request's
/// first); the request to answer when it is complete (queued for its device) or failed.
async fn push(frames: &mut FrameAssembler<Held>, frame: &InferFrame, started: Option<StartResult>, ctx: &InferContext) -> Option<Pending> {
    match frames.push_started(frame, started) {
        Ok(None) => None,
        Ok(Some((assembly, held))) => Some(queue_request(&ctx.receiver, ctx, assembly, held).await),
        Err((id, e)) => Some(Pending::answered(id, Err(e))),
    }
}

/// The answer of request `id`, given up part-way with `e`.
fn given_up(id: u64, e: RequestError) -> Pending {
    tracing::info!(request_id = id, error = %e, "request given up part-way");
    Pending::answered(id, Err(e))
}

/// A request started from its first frame.
enum Started {
    /// To be received, its bytes reserved.
    New(Box<Reassembly>, Held),
    /// Resent, and answered from the window of recent results.
    Recalled(Pending),
}

/// Starts a request from its first frame: its envelope checked against the cut it names;
/// then its answer taken from the window when its host sent it before, or else its declared
/// bytes reserved in the memory budget (waiting briefly for room).
async fn start_request(receiver: &Mutex<PayloadReceiver>, ctx: &InferContext, frame: &InferFrame, slot: Slot) -> Result<Started, RequestError> {
    let since = Instant::now();
    let assembly = receiver.lock().unwrap_or_else(std::sync::PoisonError::into_inner).start(frame.request_id, &frame.header)?;
    let span = request_span(ctx, frame, &assembly);
    if let Some(output) = ctx.window.as_ref().and_then(|(window, session)| window.recall(session, frame.request_id, &frame.header)) {
        tracing::debug!(request_id = frame.request_id, "a resent request answered from the window of recent results");
        let (tx, answer) = oneshot::channel();
        let bytes = ctx.budget.reserve(answer_bytes(output.tensor_bytes() as u64)).await?;
        let _ = tx.send(Ok((JobResult { output: Ok(output), queue: Duration::ZERO, compute: Duration::ZERO }, bytes)));
        span.record("recalled", true);
        let held = Some(Held { since, _slot: slot, bytes: None, envelope: bytes::Bytes::new(), span: span.clone(), reading: tracing::Span::none() });
        let (request_id, split, codec, key_id) = (frame.request_id, assembly.split(), assembly.codec(), assembly.key_id());
        return Ok(Started::Recalled(Pending { request_id, split, decode_us: 0, codec, key_id, answer, held, span }));
    }
    // Room for its answer too, before it is computed: a result computed without room would
    // wait for it outside the budget (and be thrown away if none came).
    let answer = assembly.sizes().map_or(0, |sizes| answer_room(&ctx.model.bundle, sizes));
    let bytes = ctx.budget.reserve(assembly.held_bytes().max(answer)).await?;
    let reading = tracing::debug_span!(parent: &span, "read");
    let held = Held { since, _slot: slot, bytes: Some(bytes), envelope: kept_envelope(&frame.header), span, reading };
    Ok(Started::New(Box::new(assembly), held))
}

/// A request's span, from its first frame: a child of the span its host sent the context of.
fn request_span(ctx: &InferContext, frame: &InferFrame, assembly: &Reassembly) -> tracing::Span {
    let span = tracing::debug_span!(
        "request",
        request_id = frame.request_id,
        model = %ctx.model.bundle.id(),
        cut = assembly.split(),
        codec = %assembly.codec(),
        recalled = false,
    );
    cleave_common::telemetry::follow(&span, &frame.traceparent);
    span
}

/// What the answer to a request of `sizes` will hold in the budget: the bundle's output at
/// those sizes, on the wire (0 where its size depends on the data: that room is taken when
/// the result comes).
fn answer_room(bundle: &cleave_common::bundle::Bundle, sizes: BoundarySizes) -> u64 {
    let output = bundle.cut(bundle.stage_count());
    output.bytes_at(Sizes::from(sizes)).map_or(0, answer_bytes)
}

/// The envelope a request keeps until answered: a copy. A frame's bytes are a slice of
/// tonic's read buffer, which a kept slice would pin, with the whole frame (its data long
/// since decoded, outside the budget), until the answer is written.
fn kept_envelope(header: &bytes::Bytes) -> bytes::Bytes {
    bytes::Bytes::copy_from_slice(header)
}

/// Decodes a complete request, checks it against its cut and hands it to its device's
/// scheduler; returns it as pending.
async fn queue_request(receiver: &Arc<Mutex<PayloadReceiver>>, ctx: &InferContext, assembly: Reassembly, mut held: Held) -> Pending {
    let (id, split) = (assembly.request_id, assembly.split());
    let (tx, rx) = oneshot::channel();
    let (mut codec, mut key_id, mut decode_us) = (Codec::RAW, None, 0);
    held.reading = tracing::Span::none();
    let decoding = tracing::debug_span!(parent: &held.span, "decode");
    let submitted = match decode_request(receiver, assembly).instrument(decoding).await {
        Err(e) => Err(e),
        Ok((r, took)) => {
            (codec, key_id, decode_us) = (r.codec, r.key_id, took.as_micros() as u64);
            ctx.metrics.received_copied(ctx.model.bundle.id(), r.copied_bytes, r.pinned_bytes);
            submit(ctx, r, &held.span).await
        }
    };
    match submitted {
        Err(e) => {
            let _ = tx.send(Err(e));
        }
        Ok(job_rx) => {
            let (window, envelope, gone) = (ctx.window.clone(), held.envelope.clone(), ctx.peer_gone.clone());
            let (budget, bytes) = (ctx.budget.clone(), held.bytes.take().unwrap_or_else(Reservation::none));
            tokio::spawn(async move {
                // Once the stream's peer is gone, dropping `job_rx` tells the scheduler: the
                // request never starts, or a running batch of only such requests stops.
                let answer = tokio::select! {
                    answer = job_rx => answer.map_err(|_| Internal::Unanswered.into()),
                    () = gone.cancelled() => return,
                };
                // Kept when this stream goes while it is answered: its host will resend it.
                if let (Ok(JobResult { output: Ok(output), .. }), Some((window, session))) = (&answer, window) {
                    window.keep(&session, id, &envelope, output);
                }
                let _ = tx.send(hold_answer(&budget, bytes, answer).await);
            });
        }
    }
    let span = held.span.clone();
    Pending { request_id: id, split, decode_us, codec, key_id, answer: rx, held: Some(held), span }
}

/// A result, with the request's reservation made its answer's: grown or shrunk to what the
/// answer holds until written (waiting for room as a request does; refused, the result is
/// dropped and the request answered RESOURCE_EXHAUSTED, to be resent).
async fn hold_answer(budget: &MemoryBudget, held: Reservation, answer: Result<JobResult, RequestError>) -> Answer {
    let result = answer?;
    let bytes = result.output.as_ref().map_or(0, |o| answer_bytes(o.tensor_bytes() as u64));
    let held = budget.resize(held, bytes).await?;
    Ok((result, held))
}

/// Checks a decoded request against its cut (its batch size comes from there) and queues
/// it on its device's scheduler.
async fn submit(ctx: &InferContext, r: Received, span: &tracing::Span) -> Result<oneshot::Receiver<JobResult>, RequestError> {
    let cuts = ctx.model.bundle.stage_count();
    if r.split as usize > cuts {
        return Err(RequestError::SplitOutOfRange { split: r.split, cuts });
    }
    let sizes = ctx.model.bundle.check_boundary(r.split as usize, &r.boundary)?;
    let (reply, answer) = oneshot::channel();
    let job = InferJob { model: ctx.model.index, split: r.split as usize, input: r.boundary, sizes, reply, trace: span.clone() };
    ctx.model.scheduler.submit(job).await?;
    Ok(answer)
}

/// A request's result and what its answer holds in the memory budget, or why not.
type Answer = Result<(JobResult, Reservation), RequestError>;

/// What answers a stream's requests.
struct Responder {
    out: mpsc::Sender<Result<ResultFrame, Status>>,
    encoder: Arc<Mutex<ResultEncoder>>,
    chunk_bytes: usize,
    unsent: Unsent,
    model: Arc<Model>,
    metrics: Metrics,
}

impl Responder {
    /// Answers the stream's requests in arrival order.
    async fn respond(self, mut pending: mpsc::Receiver<Pending>) {
        let _open = self.metrics.stream_open("infer");
        while let Some(mut p) = pending.recv().await {
            let answer = (&mut p.answer).await.unwrap_or(Err(Internal::Unanswered.into()));
            let spec = ResultSpec {
                request_id: p.request_id,
                split: p.split,
                codec: p.codec,
                key_id: p.key_id,
                direction: Direction::Result,
                keeps_tensors: false,
            };
            let (mut queue, mut compute) = (Duration::ZERO, Duration::ZERO);
            let mut held = Reservation::none();
            let encoded = match answer.and_then(|(r, bytes)| {
                (queue, compute, held) = (r.queue, r.compute, bytes);
                r.output
            }) {
                Ok(output) => encode_answer(&self.encoder, spec, output).instrument(tracing::debug_span!(parent: &p.span, "encode")).await,
                Err(e) => Err(e),
            };
            let mut copied_bytes = 0;
            let (frames, code) = match encoded {
                Ok((encoded, encode)) => {
                    copied_bytes = encoded.copied_bytes;
                    let timings = pb::ServerTimings {
                        queue_us: queue.as_micros() as u64,
                        decode_us: p.decode_us,
                        compute_us: compute.as_micros() as u64,
                        encode_us: encode.as_micros() as u64,
                    };
                    let mut frames: Vec<ResultFrame> = payload_frames(p.request_id, encoded.envelope, &encoded.data, self.chunk_bytes);
                    if let Some(last) = frames.last_mut() {
                        last.timings = Some(timings);
                    }
                    (frames, tonic::Code::Ok)
                }
                Err(e) => {
                    tracing::info!(request_id = p.request_id, error = %e, "request refused");
                    (vec![ResultFrame { request_id: p.request_id, last: true, error: Some(error_frame(&e)), ..Default::default() }], status_code(&e))
                }
            };
            self.metrics.answered(&Answered {
                model: self.model.bundle.id(),
                code,
                queue,
                compute,
                total: p.since().elapsed(),
                bytes_out: frames.iter().map(|f: &ResultFrame| (f.header.len() + f.data.len()) as u64).sum(),
                copied_bytes,
                slo: self.model.slo,
            });
            // Each frame holds its share until written; a host that does not take it within
            // `limits.answer_timeout` has its connection closed, which ends this send.
            let answering = tracing::debug_span!(parent: &p.span, "answer", frames = frames.len());
            let sent = async {
                for frame in frames {
                    self.unsent.hold(&frame, &mut held);
                    if self.out.send(Ok(frame)).await.is_err() {
                        return false;
                    }
                }
                true
            };
            if !sent.instrument(answering).await {
                return; // The host is gone: stop working for it.
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_envelope_does_not_pin_the_buffer_its_frame_was_read_into() {
        let read_buffer = bytes::Bytes::from(vec![7u8; 128 << 10]);
        let kept = kept_envelope(&read_buffer.slice(..64));
        assert_eq!(kept, read_buffer.slice(..64));
        assert!(read_buffer.is_unique(), "the kept envelope still holds the 128 KiB read buffer");
    }
}
