//! An `Infer` stream on one connection: the frames going out, the results coming back and
//! reassembled into boundaries. A stream is opened per connection (with a fresh result
//! receiver: the server seals each stream's results under a new nonce prefix) and dropped
//! whole when the connection breaks, stalls or carries garbage.

use std::time::{Duration, Instant};

use cleave_common::pb::{self, InferFrame};
use cleave_common::protocol::HOST_SESSION_METADATA;
use cleave_common::wire::{
    payload_frames, Codec, CodecError, CodecPolicy, Direction, FrameAssembler, Key, KeyRing, PayloadMeta, PayloadReceiver, PayloadSender, WireError,
};
use cleave_common::Boundary;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;

use crate::error::{ConnectFailure, LinkError, StreamError};
use crate::session::ServerSession;
use crate::times::ServerTimes;

/// What every `Infer` stream of a run opens with.
#[derive(Debug, Clone)]
pub struct InferSetup {
    /// Every codec requests may travel with: each server must accept each.
    pub codecs: Vec<Codec>,
    /// The key id requests are sealed with (their results must then come back sealed).
    pub key_id: Option<u32>,
    /// The keys results are opened with.
    pub ring: KeyRing,
    /// The caller's session id (hex), on every stream: the server answers a request it already
    /// computed for this session from its window of recent results.
    pub host_session: String,
    /// How long a stream may take to open.
    pub open_timeout: Duration,
}

impl InferSetup {
    /// A run's setup under a fresh random session id.
    pub fn new(codecs: Vec<Codec>, key: Option<(u32, Key)>, open_timeout: Duration) -> Self {
        let key_id = key.as_ref().map(|(id, _)| *id);
        let ring = KeyRing::new(key).expect("one key");
        Self { codecs, key_id, ring, host_session: format!("{:032x}", rand::random::<u128>()), open_timeout }
    }

    /// Checks that `session`'s server accepts every codec and the key (see
    /// [`ServerSession::check_accepts`]).
    pub fn check(&self, session: &ServerSession) -> Result<(), LinkError> {
        self.codecs.iter().try_for_each(|codec| session.check_accepts(codec, self.key_id))
    }

    /// The one payload sender of a run: it seals with the run's key, if any. A request sent
    /// again goes as it was sealed, and new ones continue its nonce counter.
    pub fn sender(&self) -> Result<PayloadSender, CodecError> {
        match self.key_id {
            Some(id) => PayloadSender::sealed(&self.ring, id),
            None => Ok(PayloadSender::plain()),
        }
    }

    /// Checks that `session`'s server accepts every codec and the key, then opens a stream on it.
    pub async fn open(&self, session: &ServerSession) -> Result<InferStream, LinkError> {
        self.check(session)?;
        InferStream::open(session, &self.host_session, &self.ring, self.key_id.is_some(), self.open_timeout).await
    }
}

/// A live `Infer` stream.
pub struct InferStream {
    frames: mpsc::UnboundedSender<InferFrame>,
    /// Data bytes per frame under the server's message limit.
    chunk_bytes: usize,
    inbound: tonic::Streaming<pb::ResultFrame>,
    results: ResultAssembler,
}

/// A whole answer from the server.
#[derive(Debug)]
pub struct InferAnswer {
    /// The request's id.
    pub id: u64,
    /// The boundary at the last cut, or why there is none.
    pub output: Result<Boundary, AnswerError>,
    /// Reassembling and decoding the result, in milliseconds.
    pub decode_ms: f64,
    /// Bytes copied as they were to receive the result (frames into tensors, decoding).
    pub copied_bytes: u64,
    /// The server's own times for the request.
    pub server: Option<ServerTimes>,
    /// The server it came from, when the caller sends to several.
    pub from: Option<std::sync::Arc<str>>,
}

/// Why an answer holds no result.
#[derive(Debug, Clone, thiserror::Error)]
pub enum AnswerError {
    /// The server answered the request with an error status.
    #[error("{code:?}: {message}")]
    Refused {
        /// The answer's status code.
        code: tonic::Code,
        /// The server's message.
        message: String,
    },
    /// Its result came back and cannot be opened or decoded.
    #[error("result: {0}")]
    Undecodable(WireError),
}

impl InferStream {
    /// Opens the stream on a connected session, within `timeout`. Requests carry the caller's
    /// session id (`host_session`, hex), so that the server answers one it already computed
    /// from its window. Results are opened with `ring`, and must come back sealed when `sealed`.
    async fn open(session: &ServerSession, host_session: &str, ring: &KeyRing, sealed: bool, timeout: Duration) -> Result<Self, LinkError> {
        let (frames, rx) = mpsc::unbounded_channel();
        let mut request = session.model_request(UnboundedReceiverStream::new(rx));
        request.metadata_mut().insert(HOST_SESSION_METADATA, host_session.parse().expect("a hex session id is a valid header value"));
        let mut client = session.client.clone();
        let opened = tokio::time::timeout(timeout, client.infer(request))
            .await
            .map_err(|_| LinkError::Connect { url: session.url.clone(), failure: ConnectFailure::StreamNotOpened(timeout), attempts: 1 })?
            .map_err(|s| LinkError::rpc("Infer", &s))?;
        // Results must come back sealed when requests go sealed: a stripped seal is refused.
        let policy = CodecPolicy { require_encryption: sealed, ..CodecPolicy::default() };
        let results = ResultAssembler {
            receiver: PayloadReceiver::new(Direction::Result, session.max_payload_bytes(), policy, ring),
            frames: FrameAssembler::default(),
        };
        Ok(Self { frames, chunk_bytes: session.chunk_bytes(), inbound: opened.into_inner(), results })
    }

    /// Queues a request's frames, its trace context in the first; false when the stream is
    /// gone. The queue is not bounded here: the stream takes frames as fast as the server reads
    /// them, and the caller bounds the requests it has out (the host's `in_flight`).
    pub fn send(&self, frames: &[InferFrame], traceparent: Option<&str>) -> bool {
        frames.iter().enumerate().all(|(i, f)| {
            let mut frame = f.clone();
            if let (0, Some(traceparent)) = (i, traceparent) {
                frame.traceparent = traceparent.to_string();
            }
            self.frames.send(frame).is_ok()
        })
    }

    /// Encodes `boundary` as request `id` at cut `split` with `codec` (sealed when `sender`
    /// seals: one sender for every request of a run, so that its nonces never repeat), frames it
    /// by the server's message limit and queues it. Returns its frames, to be resent as they are
    /// on a new stream should this one break; [`StreamError::Ended`] when the stream is gone.
    pub fn send_boundary(
        &self,
        sender: &mut PayloadSender,
        id: u64,
        split: u32,
        codec: &Codec,
        boundary: &Boundary,
    ) -> Result<Vec<InferFrame>, LinkError> {
        let meta = PayloadMeta { request_id: id, split, direction: Direction::Request };
        let encoded = sender.encode(meta, codec, boundary)?;
        let frames: Vec<InferFrame> = payload_frames(id, encoded.envelope, &encoded.data, self.chunk_bytes);
        match self.send(&frames, None) {
            true => Ok(frames),
            false => Err(StreamError::Ended.into()),
        }
    }

    /// The next whole answer; an error when the stream ended, failed or broke the framing
    /// (the connection is then of no more use). Cancel-safe: frames of an answer part-way in
    /// stay in the assembler.
    pub async fn next_answer(&mut self) -> Result<InferAnswer, StreamError> {
        loop {
            let frame = match self.inbound.next().await {
                None => return Err(StreamError::Ended),
                Some(Err(status)) => return Err(StreamError::Failed(status)),
                Some(Ok(frame)) => frame,
            };
            if let Some(answer) = self.results.push(frame)? {
                return Ok(answer);
            }
        }
    }
}

/// Reassembles result payloads from their frames.
struct ResultAssembler {
    receiver: PayloadReceiver,
    frames: FrameAssembler,
}

impl ResultAssembler {
    /// Takes one result frame; returns the answer once its last frame is in. A result that
    /// cannot be reassembled is an error: the server broke the framing.
    fn push(&mut self, frame: pb::ResultFrame) -> Result<Option<InferAnswer>, StreamError> {
        let id = frame.request_id;
        if let Some(err) = &frame.error {
            self.frames.abandon();
            let output = Err(AnswerError::Refused { code: tonic::Code::from(err.code), message: err.message.clone() });
            return Ok(Some(InferAnswer { id, output, decode_ms: 0.0, copied_bytes: 0, server: None, from: None }));
        }
        let receiver = &self.receiver;
        let assembly = match self.frames.push(&frame, |f| receiver.start(f.request_id, &f.header).map(|a| (a, ()))) {
            Ok(None) => return Ok(None),
            Ok(Some((assembly, ()))) => assembly,
            Err((id, error)) => return Err(StreamError::Unassembled { id, error }),
        };
        let t = Instant::now();
        let received = self.receiver.finish(assembly).map_err(AnswerError::Undecodable);
        let copied_bytes = received.as_ref().map_or(0, |r| r.copied_bytes);
        let output = received.map(|r| r.boundary);
        let server = frame.timings.map(ServerTimes::from);
        Ok(Some(InferAnswer { id, output, decode_ms: t.elapsed().as_secs_f64() * 1e3, copied_bytes, server, from: None }))
    }
}
