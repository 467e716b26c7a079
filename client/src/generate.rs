//! The `Generate` stream as calls: open a session, then one step at a time, each answered
//! before the next is sent (a decode step needs the token its answer gives). With a key
//! (`encryption`), each step goes sealed whole and its answer must come back so.

use std::time::Duration;

use cleave_common::pb::{self, generate_frame, GenerateFrame, GenerateReply};
use cleave_common::protocol::{SEALED_REPLY_KIND, SEALED_STEP_KIND};
use cleave_common::spec::{DType, TorchDType};
use cleave_common::wire::{KeyRing, Opener, Sealer};
use prost::Message;
use tch::Tensor;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;

use crate::error::{Breach, LinkError};
use crate::session::ServerSession;
use crate::times::ServerTimes;

type Result<T, E = LinkError> = std::result::Result<T, E>;

/// A session open on a server.
pub struct GenerateLink {
    frames: mpsc::Sender<GenerateFrame>,
    replies: Streaming<GenerateReply>,
    next_id: u64,
    /// How long an answer may take (the link's `request_timeout`).
    answer_timeout: Duration,
    /// Seals the steps and opens their answers, with the link's key.
    seals: Option<(Sealer, Opener)>,
    /// What the server said when it opened the session.
    pub opened: pb::GenerationOpened,
}

/// A step's answer.
pub struct GenerateAnswer {
    /// Hidden states or logits, of the shape asked for.
    pub output: Tensor,
    /// For a step of a `top_k`: the token id of each logit of `output`, in its order.
    pub token_ids: Option<Vec<u32>>,
    /// What the server says the step waited and took.
    pub server_times: ServerTimes,
}

/// The stream ended under a step: the server went (its caches with it).
fn closed() -> LinkError {
    LinkError::Rpc { call: "Generate", code: tonic::Code::Unavailable, message: "the server closed the stream".into() }
}

/// No answer within `request_timeout`: the server holds the stream but does not answer.
fn unanswered(timeout: Duration) -> LinkError {
    let message = format!("no answer within {timeout:?} (`resilience.request_timeout`)");
    LinkError::Rpc { call: "Generate", code: tonic::Code::DeadlineExceeded, message }
}

fn refused(error: &pb::Error) -> LinkError {
    LinkError::Rpc { call: "Generate", code: tonic::Code::from_i32(error.code), message: error.message.clone() }
}

impl GenerateLink {
    /// Opens a session on `session`'s server: it reserves the caches of `open`'s stages.
    pub async fn open(session: &mut ServerSession, open: pb::OpenGeneration) -> Result<Self> {
        let key = session.link.key.clone();
        session.check_accepts(&cleave_common::wire::Codec::RAW, key.as_ref().map(|(id, _)| *id))?;
        let seals = match key {
            Some((id, key)) => {
                let ring = KeyRing::new([(id, key)]).expect("one key");
                Some((ring.sealer(id)?, ring.opener()))
            }
            None => None,
        };
        let (frames, rx) = mpsc::channel(4);
        frames.send(GenerateFrame { kind: Some(generate_frame::Kind::Open(open)) }).await.map_err(|_| closed())?;
        let call = session.model_request(ReceiverStream::new(rx));
        let answer_timeout = session.link.request_timeout;
        let opening = async {
            let mut replies = session.client.generate(call).await.map_err(|s| LinkError::rpc("Generate", &s))?.into_inner();
            let first = next_reply(&mut replies).await?;
            Ok::<_, LinkError>((replies, first))
        };
        let (replies, first) = tokio::time::timeout(answer_timeout, opening).await.map_err(|_| unanswered(answer_timeout))??;
        if let Some(error) = &first.error {
            return Err(refused(error));
        }
        let opened = first.opened.ok_or(Breach::NotOpened)?;
        Ok(Self { frames, replies, next_id: 0, answer_timeout, seals, opened })
    }

    /// Sends `step` (its request id set here) and waits for its output, which must be of
    /// `shape` and `dtype` (with a `top_k`, the logits of each token's candidates, with their
    /// ids below `vocab_size`), and the times the server gives with it.
    pub async fn step(&mut self, mut step: pb::GenerateStep, shape: &[i64], dtype: DType, vocab_size: i64) -> Result<GenerateAnswer> {
        let id = self.next_id;
        self.next_id += 1;
        step.request_id = id;
        let top_k = step.top_k;
        let kind = match &mut self.seals {
            Some((sealer, _)) => generate_frame::Kind::SealedStep(sealer.seal_message(SEALED_STEP_KIND, step.encode_to_vec())?),
            None => generate_frame::Kind::Step(step),
        };
        self.frames.send(GenerateFrame { kind: Some(kind) }).await.map_err(|_| closed())?;
        let answer = tokio::time::timeout(self.answer_timeout, next_reply(&mut self.replies));
        let mut reply = answer.await.map_err(|_| unanswered(self.answer_timeout))??;
        if let Some(error) = &reply.error {
            return Err(refused(error));
        }
        let mismatch = |got: String| Breach::GenerationAnswer { request_id: id, got, expected: format!("{} {shape:?}", dtype.name()) };
        let reply = match (&mut self.seals, reply.sealed.take()) {
            (Some((_, opener)), Some(sealed)) => {
                let bytes = opener.open_message(SEALED_REPLY_KIND, sealed)?;
                GenerateReply::decode(bytes.as_slice()).map_err(|e| mismatch(format!("a sealed answer that does not decode: {e}")))?
            }
            (Some(_), None) => return Err(mismatch("an answer not sealed".into()).into()),
            (None, Some(_)) => return Err(mismatch("a sealed answer to a plain step".into()).into()),
            (None, None) => reply,
        };
        if reply.request_id != id {
            return Err(mismatch(format!("the answer of step {}", reply.request_id)).into());
        }
        if DType::from_name(&reply.dtype) != Some(dtype) {
            return Err(mismatch(format!("dtype {:?}", reply.dtype)).into());
        }
        let bytes = shape.iter().try_fold(dtype.size() as u64, |n, &d| n.checked_mul(u64::try_from(d).ok()?));
        if reply.shape != shape || bytes != Some(reply.output.len() as u64) {
            return Err(mismatch(format!("{} {:?} in {} bytes", reply.dtype, reply.shape, reply.output.len())).into());
        }
        let token_ids = if top_k > 0 { Some(token_ids(&reply.token_ids, shape, vocab_size).map_err(mismatch)?) } else { None };
        let output = Tensor::f_from_data_size(&reply.output, shape, dtype.kind()).map_err(|e| mismatch(e.to_string()))?;
        Ok(GenerateAnswer { output, token_ids, server_times: reply.timings.map(ServerTimes::from).unwrap_or_default() })
    }
}

/// An answer's token ids: one u32 for each element of `shape`, each below `vocab_size`.
fn token_ids(bytes: &[u8], shape: &[i64], vocab_size: i64) -> std::result::Result<Vec<u32>, String> {
    let count = shape.iter().product::<i64>() as usize;
    if bytes.len() != count * 4 {
        return Err(format!("{} bytes of token ids for {shape:?}", bytes.len()));
    }
    let ids: Vec<u32> = bytes.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    match ids.iter().find(|&&id| i64::from(id) >= vocab_size) {
        Some(id) => Err(format!("token id {id}, outside the vocabulary of {vocab_size}")),
        None => Ok(ids),
    }
}

async fn next_reply(replies: &mut Streaming<GenerateReply>) -> Result<GenerateReply> {
    match replies.message().await {
        Ok(Some(reply)) => Ok(reply),
        Ok(None) => Err(closed()),
        Err(status) => Err(LinkError::rpc("Generate", &status)),
    }
}
