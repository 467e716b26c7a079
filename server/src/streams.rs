//! What every stream (`Infer`, `Train`, `Generate`) is made of once opened: the model its
//! call names, the reader of its frames with the stream's deadlines (the wait for an opening
//! frame among them), the channel of its answers, and what says the peer is gone. The one
//! function that opens them is `Service::open_stream`; each kind brings only its context and
//! its serving task.

use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_util::sync::CancellationToken;
use tonic::{Status, Streaming};

use crate::budget::MemoryBudget;
use crate::models::Model;
use crate::peer::Peer;
use crate::reader::FrameReader;
use crate::unsent::Unsent;

/// The answers of a stream, as tonic sends them.
pub(crate) type Answers<R> = Pin<Box<dyn Stream<Item = Result<R, Status>> + Send>>;

/// The kinds of stream, and what the skeleton does differently for each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StreamKind {
    Infer,
    Train,
    Generate,
}

impl StreamKind {
    /// How many answers (result frames for `Infer`) wait for the peer to read them before the
    /// stream's task waits: with one answer being made, what a peer that does not read can
    /// make the server hold.
    pub(crate) fn answers_queued(self) -> usize {
        match self {
            Self::Infer | Self::Generate => 4,
            Self::Train => 16,
        }
    }
}

/// One stream, opened: what its serving task starts with.
pub(crate) struct OpenStream<F, R> {
    /// The model its call names.
    pub(crate) model: Arc<Model>,
    /// Its frames, read with its deadlines (a payload part-way in, the stream idle, a drain).
    pub(crate) reader: FrameReader<Streaming<F>>,
    /// Where its answers go; a failed send means nobody reads them any more.
    pub(crate) answers: mpsc::Sender<Result<R, Status>>,
    /// Where each answer's share of the budget waits for its bytes to be written.
    pub(crate) unsent: Unsent,
    /// Cancelled when tonic drops the response: the peer reset the stream or its connection
    /// closed (or the stream ended with nothing left to answer).
    pub(crate) peer_gone: CancellationToken,
    /// Who the peer is, for its shares (none where its connection could not tell).
    pub(crate) peer: Option<Peer>,
    /// The peer's view of the memory budget, the one the call's body counts in.
    pub(crate) budget: MemoryBudget,
}

impl<F, R> OpenStream<F, R> {
    /// The stream's opening frame. It comes within the request timeout or not at all: a
    /// stream that says nothing should hold neither a place nor a task for long, nor delay a
    /// drain. `None` when it does not come, the server drains, or the host ends or breaks the
    /// stream or stops reading its answers; or when its bytes were refused as they came, and
    /// then the call ends with why.
    pub(crate) async fn opening_frame(&mut self) -> Option<F>
    where
        Streaming<F>: Stream<Item = Result<F, Status>> + Unpin,
    {
        match self.reader.first(self.answers.closed()).await {
            Ok(frame) => Some(frame),
            Err(refused) => {
                // Its bytes refused as they came (`inbound`): the call ends with why.
                if let Some(e) = refused {
                    let _ = self.answers.send(Err(e.into())).await;
                }
                None
            }
        }
    }
}
