//! Payloads in and out of a stream: on the blocking pool where that is work (decrypting,
//! decompressing and encoding a large boundary takes milliseconds), on the stream's own task
//! where it is not (a raw payload's bytes are in its tensors as received, and a raw
//! inference answer is sent from its tensors' memory). Answers travel back like requests: each
//! result (or gradient) is encoded with its request's codec and sealed with its request's
//! key, one sender, so one nonce sequence, per (key, direction) on a stream.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use cleave_common::security::ServerSecurity;
use cleave_common::wire::{Codec, Direction, EncodedPayload, PayloadMeta, PayloadReceiver, PayloadSender, Reassembly, Received};
use cleave_common::Boundary;

use crate::error::{catch_panic, Internal, RequestError};

/// The most bytes decoded or encoded on the stream's own task: handing a payload to the
/// blocking pool and back wakes two threads, which costs more than copying or decompressing
/// 64 KiB (a few to a few tens of microseconds) and, on a server with idle cores, about 0.1 ms.
const INLINE_WORK_BYTES: u64 = 64 << 10;

/// What a result needs to be encoded like its request.
#[derive(Clone, Copy)]
pub(crate) struct ResultSpec {
    pub(crate) request_id: u64,
    pub(crate) split: u32,
    pub(crate) codec: Codec,
    pub(crate) key_id: Option<u32>,
    /// `Result` for boundaries, `Gradient` for gradients (each its own nonce sequence).
    pub(crate) direction: Direction,
    /// Whether the server goes on working on tensors the answer may share memory with: a
    /// training session's optimizer step overlaps with sending its answer and writes the
    /// parameters in place, so a training answer is copied (nothing shows that a gradient
    /// shares their memory, but nothing rules it out); an inference answer is sent from its
    /// tensors' memory.
    pub(crate) keeps_tensors: bool,
}

/// Encodes one stream's answers.
pub(crate) struct ResultEncoder {
    security: Arc<ServerSecurity>,
    /// The largest answer (tensor bytes) sent: the limit requests have, `max_payload_bytes`,
    /// which the host accepts answers up to.
    max_payload_bytes: u64,
    senders: HashMap<(Option<u32>, i32), PayloadSender>,
}

impl ResultEncoder {
    pub(crate) fn new(security: Arc<ServerSecurity>, max_payload_bytes: u64) -> Self {
        Self { security, max_payload_bytes, senders: HashMap::new() }
    }

    /// The bytes encoding an answer works through: none for a raw, unsealed answer sent from
    /// its tensors' memory as it lies, all of them otherwise (a tensor on a device is copied
    /// to the host first, one that is not contiguous is made so).
    fn work_bytes(p: &ResultSpec, output: &Boundary) -> u64 {
        let as_it_lies = |t: &tch::Tensor| t.device() == tch::Device::Cpu && t.is_contiguous();
        let from_tensors = p.codec == Codec::RAW && p.key_id.is_none() && !p.keeps_tensors && output.tensors().iter().all(|(_, t)| as_it_lies(t));
        if from_tensors {
            0
        } else {
            output.tensor_bytes() as u64
        }
    }

    /// Encodes an answer: a raw one travels as its tensors' memory unless the server keeps
    /// using them.
    fn encode(&mut self, p: ResultSpec, output: Boundary) -> Result<EncodedPayload, RequestError> {
        let bytes = output.tensor_bytes() as u64;
        if bytes > self.max_payload_bytes {
            return Err(RequestError::AnswerTooLarge { bytes, limit: self.max_payload_bytes });
        }
        let sender = match self.senders.entry((p.key_id, p.direction as i32)) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(match p.key_id {
                None => PayloadSender::plain(),
                Some(id) => PayloadSender::sealed(&self.security.keys, id).map_err(|err| RequestError::Encode(err.into()))?,
            }),
        };
        let meta = PayloadMeta { request_id: p.request_id, split: p.split, direction: p.direction };
        if p.keeps_tensors {
            return sender.encode(meta, &p.codec, &output).map_err(RequestError::Encode);
        }
        // SAFETY: an inference answer is the suffix's output, given up here; inference never
        // writes a tensor (no optimizer steps, no in-place ops on outputs), so nothing writes
        // its memory, even where it aliases a parameter, while the answer's frames live.
        #[allow(unsafe_code)]
        let encoded = unsafe { sender.encode_owned(meta, &p.codec, output) };
        encoded.map_err(RequestError::Encode)
    }
}

/// Encodes `output`, on the blocking pool unless that is little work; returns the payload
/// and the time encoding took. The caller awaits each answer in turn, so answers keep their
/// order. A panic is caught inside the lock (which is then not poisoned): that answer is
/// INTERNAL, the stream goes on.
pub(crate) async fn encode_answer(
    encoder: &Arc<Mutex<ResultEncoder>>,
    spec: ResultSpec,
    output: Boundary,
) -> Result<(EncodedPayload, Duration), RequestError> {
    let inline = ResultEncoder::work_bytes(&spec, &output) <= INLINE_WORK_BYTES;
    let encoder = Arc::clone(encoder);
    let encode = move || {
        let started = Instant::now();
        let mut encoder = encoder.lock().unwrap_or_else(PoisonError::into_inner);
        let encoded = catch_panic("encoding an answer", || encoder.encode(spec, output))?;
        Ok((encoded, started.elapsed()))
    };
    on_blocking_pool_unless(inline, encode, "encoding an answer").await
}

/// Opens and decodes a complete payload, on the blocking pool unless that is little work;
/// returns it and the time it took. The caller awaits each payload in turn, so payloads are
/// opened in order (the receiver's replay window needs that). A panic is caught inside the
/// lock: that request is INTERNAL, the stream goes on.
pub(crate) async fn decode_request(receiver: &Arc<Mutex<PayloadReceiver>>, assembly: Reassembly) -> Result<(Received, Duration), RequestError> {
    let inline = assembly.finish_work_bytes() <= INLINE_WORK_BYTES;
    let receiver = Arc::clone(receiver);
    let decode = move || {
        let started = Instant::now();
        let mut receiver = receiver.lock().unwrap_or_else(PoisonError::into_inner);
        let received = catch_panic("decoding a payload", || Ok(receiver.finish(assembly)?))?;
        Ok((received, started.elapsed()))
    };
    on_blocking_pool_unless(inline, decode, "decoding a payload").await
}

/// Runs `work` here when `inline`, else on the blocking pool.
async fn on_blocking_pool_unless<T: Send + 'static>(
    inline: bool,
    work: impl FnOnce() -> Result<T, RequestError> + Send + 'static,
    what: &'static str,
) -> Result<T, RequestError> {
    if inline {
        return work();
    }
    tokio::task::spawn_blocking(work).await.unwrap_or(Err(Internal::Cancelled(what).into()))
}
