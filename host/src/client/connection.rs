//! One connection's `Infer` stream: the frames going out, the results coming back and
//! reassembled. A stream is opened per connection (with a fresh result receiver: the
//! server seals each stream's results under a new nonce prefix) and dropped whole when the
//! connection breaks, stalls or carries garbage.

use std::time::{Duration, Instant};

use cleave_common::pb::{self, InferFrame};
use cleave_common::protocol::HOST_SESSION_METADATA;
use cleave_common::wire::{CodecPolicy, Direction, FrameAssembler, KeyRing, PayloadReceiver};
use cleave_common::Boundary;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;

use super::request::{ms, ServerTimes};
use crate::error::{HostError, RequestFailure, Result};
use cleave_client::ServerSession;
use cleave_client::{ConnectFailure, LinkError, StreamError};

/// A live `Infer` stream.
pub(crate) struct Connection {
    frames: mpsc::UnboundedSender<InferFrame>,
    inbound: tonic::Streaming<pb::ResultFrame>,
    results: ResultAssembler,
}

/// A whole answer from the server.
pub(crate) struct Answer {
    pub(crate) id: u64,
    /// The boundary at the last cut, or the server's error.
    pub(crate) output: Result<Boundary, RequestFailure>,
    pub(super) decode_ms: f64,
    /// Bytes copied as they were to receive the result (frames into tensors, decoding).
    pub(super) copied_bytes: u64,
    pub(super) server: Option<ServerTimes>,
    /// The server it came from, when the run has several.
    pub(super) from: Option<std::sync::Arc<str>>,
}

impl Connection {
    /// Opens the stream on a connected session, within `timeout`. Requests carry the host's
    /// session id, so that the server answers one it already computed from its window.
    pub(crate) async fn open(session: &ServerSession, host_session: &str, ring: &KeyRing, sealed: bool, timeout: Duration) -> Result<Self> {
        let (frames, rx) = mpsc::unbounded_channel();
        let mut request = session.model_request(UnboundedReceiverStream::new(rx));
        request.metadata_mut().insert(HOST_SESSION_METADATA, host_session.parse().expect("a hex session id is a valid header value"));
        let mut client = session.client.clone();
        let opened = tokio::time::timeout(timeout, client.infer(request))
            .await
            .map_err(|_| LinkError::Connect { url: session.url.clone(), failure: ConnectFailure::StreamNotOpened(timeout), attempts: 1 })?
            .map_err(|s| HostError::rpc("Infer", &s))?;
        // Results must come back sealed when requests go sealed: a stripped seal is refused.
        let policy = CodecPolicy { require_encryption: sealed, ..CodecPolicy::default() };
        let results = ResultAssembler {
            receiver: PayloadReceiver::new(Direction::Result, session.max_payload_bytes(), policy, ring),
            frames: FrameAssembler::default(),
        };
        Ok(Self { frames, inbound: opened.into_inner(), results })
    }

    /// Queues a request's frames (the stream takes them as fast as the server reads them; at
    /// most `in_flight` requests are ever queued), its trace context in the first. False when
    /// the stream is gone.
    pub(crate) fn send(&self, frames: &[InferFrame], traceparent: Option<&str>) -> bool {
        frames.iter().enumerate().all(|(i, f)| {
            let mut frame = f.clone();
            if let (0, Some(traceparent)) = (i, traceparent) {
                frame.traceparent = traceparent.to_string();
            }
            self.frames.send(frame).is_ok()
        })
    }

    /// The next whole answer; an error when the stream ended, failed or broke the framing
    /// (the connection is then of no more use). Cancel-safe: frames of an answer part-way in
    /// stay in the assembler.
    pub(crate) async fn next_answer(&mut self) -> Result<Answer, StreamError> {
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
    fn push(&mut self, frame: pb::ResultFrame) -> Result<Option<Answer>, StreamError> {
        let id = frame.request_id;
        if let Some(err) = &frame.error {
            self.frames.abandon();
            let output = Err(RequestFailure::Refused { code: tonic::Code::from(err.code), message: err.message.clone() });
            return Ok(Some(Answer { id, output, decode_ms: 0.0, copied_bytes: 0, server: None, from: None }));
        }
        let receiver = &self.receiver;
        let assembly = match self.frames.push(&frame, |f| receiver.start(f.request_id, &f.header).map(|a| (a, ()))) {
            Ok(None) => return Ok(None),
            Ok(Some((assembly, ()))) => assembly,
            Err((id, error)) => return Err(StreamError::Unassembled { id, error }),
        };
        let t = Instant::now();
        let received = self.receiver.finish(assembly).map_err(RequestFailure::Undecodable);
        let copied_bytes = received.as_ref().map_or(0, |r| r.copied_bytes);
        let output = received.map(|r| r.boundary);
        let server = frame.timings.map(ServerTimes::from);
        Ok(Some(Answer { id, output, decode_ms: ms(t), copied_bytes, server, from: None }))
    }
}
