//! One `Train` stream: opens the session from the first frame, then reassembles each call's
//! payload, decodes it (blocking pool), runs it on the session thread and sends the answer
//! back framed like a result, in order: one reply or one error per call, and a failed call
//! leaves the session open.

use std::sync::{Arc, Mutex};

use cleave_common::config::Limits;
use cleave_common::pb::{self, train_frame, Phase, TrainReply};
use cleave_common::security::ServerSecurity;
use cleave_common::training::take_targets;
use cleave_common::wire::{frame_parts, Direction, FrameAssembler, PayloadReceiver, Reassembly};
use cleave_common::{Bundle, DeviceSpec};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tonic::{Status, Streaming};

use super::admission::Training;
use super::session::{checkpoint_path, Answer, Call, SessionHandle};
use crate::error::{error_frame, RequestError};
use crate::payloads::{decode_blocking, encode_blocking, ResultEncoder, ResultSpec};

/// What one `Train` stream needs.
pub(crate) struct TrainContext {
    pub(crate) bundle: Bundle,
    pub(crate) device: DeviceSpec,
    pub(crate) limits: Limits,
    pub(crate) security: Arc<ServerSecurity>,
    pub(crate) training: Training,
}

fn error_reply(request_id: u64, e: &RequestError) -> TrainReply {
    TrainReply { request_id, last: true, error: Some(error_frame(e)), ..Default::default() }
}

/// Serves one `Train` stream: opens the session, then answers its calls in order.
pub(crate) async fn serve_stream(mut inbound: Streaming<pb::TrainFrame>, ctx: TrainContext, out: mpsc::Sender<Result<TrainReply, Status>>) {
    let open = match inbound.next().await {
        Some(Ok(pb::TrainFrame { kind: Some(train_frame::Kind::Open(open)) })) => open,
        Some(Ok(_)) => {
            let _ = out.send(Ok(error_reply(0, &RequestError::Session("the first frame of a Train stream opens the session".into())))).await;
            return;
        }
        _ => return,
    };
    let opened = async {
        let setup = ctx.training.setup(&ctx.bundle, ctx.device, &open)?;
        let slot = ctx.training.admit(&ctx.bundle)?;
        let (session, opened) = SessionHandle::spawn(setup).await?;
        Ok::<_, RequestError>((slot, session, opened))
    }
    .await;
    let (slot, session, opened) = match opened {
        Ok(x) => x,
        Err(e) => {
            tracing::info!(error = %e, "training session refused");
            let _ = out.send(Ok(error_reply(0, &e))).await;
            return;
        }
    };
    tracing::info!(session = %slot.id, start = open.start, end = open.end, step = opened.step, device = %opened.device, "training session open");
    let reply = pb::SessionOpened { session_id: slot.id.clone(), step: opened.step, parameters: opened.parameters, device: opened.device };
    if out.send(Ok(TrainReply { opened: Some(reply), last: true, ..Default::default() })).await.is_err() {
        return;
    }
    let mut stream = CallStream::new(&ctx, open.start, open.end);
    while let Some(frame) = inbound.next().await {
        let Ok(frame) = frame else { return };
        let replies = match frame.kind {
            Some(train_frame::Kind::Save(save)) => {
                let answer = match checkpoint_path(ctx.training.options.checkpoint_dir.as_ref(), &save.name) {
                    Ok(path) => session.call(Call::Save { path, name: save.name }).await,
                    Err(e) => Err(e),
                };
                vec![match answer {
                    Ok((Answer::Saved { name, step }, _)) => {
                        TrainReply { request_id: save.request_id, last: true, saved: Some(pb::CheckpointSaved { name, step }), ..Default::default() }
                    }
                    Ok(_) => error_reply(save.request_id, &RequestError::Unavailable),
                    Err(e) => error_reply(save.request_id, &e),
                }]
            }
            Some(train_frame::Kind::Payload(p)) => match stream.push(&p) {
                Ok(None) => continue,
                Ok(Some((assembly, phase))) => stream.answer(assembly, phase, &session).await,
                Err((id, e)) => vec![error_reply(id, &e)],
            },
            Some(train_frame::Kind::Open(_)) => vec![error_reply(0, &RequestError::Session("this stream already has a session open".into()))],
            None => vec![error_reply(0, &RequestError::Session("an empty frame".into()))],
        };
        for r in replies {
            if out.send(Ok(r)).await.is_err() {
                return; // The host is gone; dropping the session's handle ends its thread.
            }
        }
    }
    drop(slot);
}

/// The payload side of a stream: reassembly, decoding and encoding answers.
struct CallStream {
    start: u32,
    end: u32,
    /// Boundaries in (steps and evaluations) and gradients in (U-shaped backward), each with
    /// its own replay window; shared with the blocking pool.
    requests: Arc<Mutex<PayloadReceiver>>,
    gradients: Arc<Mutex<PayloadReceiver>>,
    encoder: Arc<Mutex<ResultEncoder>>,
    chunk_bytes: usize,
    /// The phase a call's first frame names travels with its payload.
    frames: FrameAssembler<Phase>,
}

impl CallStream {
    fn new(ctx: &TrainContext, start: u32, end: u32) -> Self {
        let receiver =
            |d| Arc::new(Mutex::new(PayloadReceiver::new(d, ctx.limits.max_payload_bytes, ctx.security.policy.clone(), &ctx.security.keys)));
        Self {
            start,
            end,
            requests: receiver(Direction::Request),
            gradients: receiver(Direction::Gradient),
            encoder: Arc::new(Mutex::new(ResultEncoder::new(Arc::clone(&ctx.security), ctx.limits.max_payload_bytes))),
            chunk_bytes: ctx.limits.chunk_bytes(),
            frames: FrameAssembler::default(),
        }
    }

    fn receiver(&self, phase: Phase) -> &Arc<Mutex<PayloadReceiver>> {
        if phase == Phase::Backward {
            &self.gradients
        } else {
            &self.requests
        }
    }

    /// Adds a frame; a complete payload comes back with its phase (not yet decoded).
    fn push(&mut self, frame: &pb::TrainPayloadFrame) -> Result<Option<(Reassembly, Phase)>, (u64, RequestError)> {
        let (requests, gradients) = (&self.requests, &self.gradients);
        self.frames.push(frame, |f| {
            let phase = Phase::try_from(f.phase).unwrap_or(Phase::Unspecified);
            let receiver = match phase {
                Phase::Forward | Phase::Evaluate => requests,
                Phase::Backward => gradients,
                Phase::Unspecified => {
                    return Err(RequestError::Session("a payload's first frame names its phase (forward, backward, evaluate)".into()));
                }
            };
            let assembly = receiver.lock().expect("payload receiver").start(f.request_id, &f.header)?;
            Ok((assembly, phase))
        })
    }

    /// Decodes a complete payload, runs its call and encodes the answer (decoding and
    /// encoding on the blocking pool, the call on the session thread).
    async fn answer(&mut self, assembly: Reassembly, phase: Phase, session: &SessionHandle) -> Vec<TrainReply> {
        let id = assembly.request_id;
        let (received, decode_time) = match decode_blocking(self.receiver(phase), assembly).await {
            Some(Ok(r)) => r,
            Some(Err(e)) => return vec![error_reply(id, &e)],
            None => return vec![error_reply(id, &RequestError::Unavailable)],
        };
        let expected_cut = if phase == Phase::Backward { self.end } else { self.start };
        if received.split != expected_cut {
            let e = RequestError::Session(format!("the payload is at cut {}, this session expects cut {expected_cut} for {phase:?}", received.split));
            return vec![error_reply(id, &e)];
        }
        let (codec, key_id) = (received.codec, received.key_id);
        let mut boundary = received.boundary;
        let call = match phase {
            Phase::Forward => {
                let targets = take_targets(&mut boundary);
                Call::Forward { input: boundary, targets }
            }
            Phase::Backward => Call::Backward { grads: boundary },
            _ => Call::Evaluate { input: boundary },
        };
        let (answer, compute) = match session.call(call).await {
            Ok(a) => a,
            Err(e) => return vec![error_reply(id, &e)],
        };
        let spec = |split, direction| ResultSpec { request_id: id, split, codec, key_id, direction };
        let (loss, boundary, spec) = match answer {
            Answer::Gradients { loss, grads } => (loss, grads, spec(self.start, Direction::Gradient)),
            Answer::Output(out) => (None, out, spec(self.end, Direction::Result)),
            Answer::Saved { .. } => return vec![error_reply(id, &RequestError::Unavailable)],
        };
        let (encoded, encode_time) = match encode_blocking(&self.encoder, spec, boundary).await {
            Ok(e) => e,
            Err(e) => return vec![error_reply(id, &e)],
        };
        let timings = pb::ServerTimings {
            queue_us: 0,
            decode_us: decode_time.as_micros() as u64,
            compute_us: compute.as_micros() as u64,
            encode_us: encode_time.as_micros() as u64,
        };
        frame_parts(encoded.envelope, &encoded.data, self.chunk_bytes)
            .into_iter()
            .map(|part| TrainReply {
                request_id: id,
                header: part.header,
                data: part.data,
                last: part.last,
                loss: if part.last { loss } else { None },
                timings: part.last.then_some(timings),
                ..Default::default()
            })
            .collect()
    }
}
