//! What a call's request body makes the server hold, counted as it arrives, before tonic
//! holds it.
//!
//! tonic reads each gRPC message of a call whole into one buffer: it reserves the length a
//! message's 5-byte prefix declares as soon as the prefix is in, and keeps that capacity (the
//! message in hand is a slice of it) for as long as the call lives. So each call holds, in its
//! peer's share of the memory budget, the largest message it has declared (prefix included),
//! reserved when the prefix arrives: the chunk that carries it waits for room (as a request
//! does, `limits.budget_wait`), and the call fails `RESOURCE_EXHAUSTED` when none comes. A
//! message begun must end within `limits.request_timeout`: once past it, the call fails
//! `DEADLINE_EXCEEDED` when it next waits for the message's bytes and none have come (bytes
//! already in hand are read first). Either way the stream answers the request part-way in with the
//! error and ends ([`crate::reader::Next::Refused`]), and what the call held is given back.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::Frame;
use tokio::time::{Instant, Sleep};
use tonic::Status;

use crate::budget::{MemoryBudget, OverBudget, Reservation};
use crate::error::RequestError;

/// gRPC's prefix of a message: a compression flag and a big-endian length.
const PREFIX: usize = 5;

/// What the request bodies of a peer's calls are held to.
#[derive(Debug, Clone)]
pub(crate) struct InboundLimits {
    /// The peer's view of the memory budget.
    pub(crate) budget: MemoryBudget,
    /// The largest message a call may send (a longer one is refused by tonic: no more is held).
    pub(crate) max_message_bytes: u64,
    /// How long a message begun may take to end.
    pub(crate) request_timeout: Duration,
}

/// What a call holds once its reservation has grown (or why it could not).
type Growing = Pin<Box<dyn Future<Output = Result<Reservation, OverBudget>> + Send>>;

/// A request body whose messages are counted in the budget as their prefixes arrive.
pub(crate) struct CountedBody {
    inner: tonic::body::Body,
    limits: InboundLimits,
    messages: Messages,
    /// What the call holds: its largest message so far.
    held: Reservation,
    /// A chunk waiting for room, with the call's reservation growing.
    waiting: Option<(Frame<Bytes>, Growing)>,
    /// When the message under way must have ended.
    deadline: Option<Pin<Box<Sleep>>>,
}

impl CountedBody {
    pub(crate) fn new(inner: tonic::body::Body, limits: InboundLimits) -> Self {
        Self { inner, limits, messages: Messages::default(), held: Reservation::none(), waiting: None, deadline: None }
    }

    /// Counts a data chunk: the deadline of a message begun in it, and the room its largest
    /// message declared needs (a future that grows what the call holds to it, when it holds
    /// less).
    fn count(&mut self, chunk: &[u8]) -> Option<Growing> {
        let seen = self.messages.read(chunk);
        match (seen.part_way, seen.began_part_way) {
            (false, _) => self.deadline = None,
            (true, true) => self.deadline = Some(Box::pin(tokio::time::sleep_until(Instant::now() + self.limits.request_timeout))),
            (true, false) => {}
        }
        // (A message longer than the limit is refused by tonic: nothing is held for it.)
        let largest = seen.largest_declared;
        if largest <= self.held.bytes() || largest > PREFIX as u64 + self.limits.max_message_bytes {
            return None;
        }
        // (The reservation travels with the wait; refused, the call fails and it goes.)
        let (budget, mut held) = (self.limits.budget.clone(), std::mem::take(&mut self.held));
        Some(Box::pin(async move { budget.grow(&mut held, largest).await.map(|()| held) }))
    }
}

impl http_body::Body for CountedBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = self.get_mut();
        if let Some((_, room)) = &mut this.waiting {
            let more = ready!(room.as_mut().poll(cx));
            let (frame, _) = this.waiting.take().expect("a chunk waits");
            return match more {
                Ok(held) => {
                    this.held = held;
                    Poll::Ready(Some(Ok(frame)))
                }
                Err(e) => Poll::Ready(Some(Err(RequestError::from(e).into()))),
            };
        }
        let frame = match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => frame,
            Poll::Ready(other) => return Poll::Ready(other),
            Poll::Pending => {
                let Some(deadline) = &mut this.deadline else { return Poll::Pending };
                ready!(deadline.as_mut().poll(cx));
                this.deadline = None;
                return Poll::Ready(Some(Err(RequestError::Stalled(this.limits.request_timeout).into())));
            }
        };
        let Some(room) = frame.data_ref().and_then(|chunk| this.count(chunk)) else { return Poll::Ready(Some(Ok(frame))) };
        this.waiting = Some((frame, room));
        // Polls the reservation once now (it registers the waker).
        Pin::new(this).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.waiting.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Where a call's messages stand: gRPC's framing followed across chunks.
#[derive(Debug, Default)]
struct Messages {
    prefix: [u8; PREFIX],
    /// Bytes of the prefix under way.
    prefix_read: usize,
    /// Bytes of the message body still to come.
    body_left: u64,
}

/// What one chunk showed.
#[derive(Debug, Default, PartialEq, Eq)]
struct Seen {
    /// The largest message whose prefix came in it (prefix included).
    largest_declared: u64,
    /// A message is under way at its end.
    part_way: bool,
    /// ... and it began in this chunk.
    began_part_way: bool,
}

impl Messages {
    fn read(&mut self, mut chunk: &[u8]) -> Seen {
        let mut seen = Seen::default();
        let mut began = false;
        while !chunk.is_empty() {
            if self.body_left > 0 {
                let n = chunk.len().min(usize::try_from(self.body_left).unwrap_or(usize::MAX));
                self.body_left -= n as u64;
                chunk = &chunk[n..];
                continue;
            }
            if self.prefix_read == 0 {
                began = true;
            }
            let n = chunk.len().min(PREFIX - self.prefix_read);
            self.prefix[self.prefix_read..self.prefix_read + n].copy_from_slice(&chunk[..n]);
            self.prefix_read += n;
            chunk = &chunk[n..];
            if self.prefix_read == PREFIX {
                self.prefix_read = 0;
                self.body_left = u64::from(u32::from_be_bytes([self.prefix[1], self.prefix[2], self.prefix[3], self.prefix[4]]));
                seen.largest_declared = seen.largest_declared.max(PREFIX as u64 + self.body_left);
            }
        }
        seen.part_way = self.body_left > 0 || self.prefix_read > 0;
        seen.began_part_way = seen.part_way && began;
        seen
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(len: u32) -> Vec<u8> {
        let mut m = vec![0u8];
        m.extend_from_slice(&len.to_be_bytes());
        m.extend(std::iter::repeat_n(7u8, len as usize));
        m
    }

    /// A body of the chunks sent on the returned channel, counted with a 10 s request timeout.
    fn counted(budget: &MemoryBudget) -> (tokio::sync::mpsc::Sender<Bytes>, CountedBody) {
        use tokio_stream::StreamExt;
        let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(4);
        let frames = tokio_stream::wrappers::ReceiverStream::new(rx).map(|b| Ok::<_, Status>(Frame::data(b)));
        let inner = tonic::body::Body::new(http_body_util::StreamBody::new(frames));
        let limits = InboundLimits { budget: budget.clone(), max_message_bytes: 1 << 20, request_timeout: Duration::from_secs(10) };
        (tx, CountedBody::new(inner, limits))
    }

    #[tokio::test(start_paused = true)]
    async fn a_message_is_held_from_its_prefix_and_given_up_when_it_has_not_ended_in_time() {
        use http_body_util::BodyExt;
        let budget = MemoryBudget::new(1 << 20, 1 << 20, 0, Duration::from_secs(1));
        let (tx, mut body) = counted(&budget);
        let m = message(100 << 10);
        tx.send(Bytes::copy_from_slice(&m[..1000])).await.unwrap();
        assert_eq!(body.frame().await.unwrap().unwrap().into_data().unwrap().len(), 1000, "the chunk is passed on");
        assert_eq!(budget.held_bytes(), 101 << 10, "the declared message, from its prefix");
        // More bytes 9 s in; past 10 s, bytes in hand are read first, then the call is given up.
        assert!(tokio::time::timeout(Duration::from_secs(9), body.frame()).await.is_err(), "9 s: still waiting");
        tx.send(Bytes::copy_from_slice(&m[1000..2000])).await.unwrap();
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(body.frame().await.unwrap().is_ok(), "the bytes in hand");
        let given_up = body.frame().await.unwrap().unwrap_err();
        assert_eq!(given_up.code(), tonic::Code::DeadlineExceeded, "{given_up:?}");
        drop(body);
        assert_eq!(budget.held_bytes(), 0, "what the call held comes back");
        // No room for a message: the chunk waits the budget's wait, then the call fails.
        let (tx, mut body) = counted(&budget);
        let _taken = budget.reserve(1 << 20).await.unwrap();
        tx.send(Bytes::copy_from_slice(&message(10)[..])).await.unwrap();
        let refused = body.frame().await.unwrap().unwrap_err();
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted, "{refused:?}");
    }

    #[test]
    fn messages_are_followed_across_chunks_and_their_declared_lengths_seen_at_their_prefix() {
        let mut m = Messages::default();
        let (a, b) = (message(10), message(100));
        // A whole message, then the next one's first 3 prefix bytes.
        let mut chunk = a.clone();
        chunk.extend_from_slice(&b[..3]);
        assert_eq!(m.read(&chunk), Seen { largest_declared: 15, part_way: true, began_part_way: true });
        // The rest of the prefix and part of its body: declared here, begun before.
        assert_eq!(m.read(&b[3..50]), Seen { largest_declared: 105, part_way: true, began_part_way: false });
        assert_eq!(m.read(&b[50..]), Seen { largest_declared: 0, part_way: false, began_part_way: false });
        // An empty message ends with its prefix.
        assert_eq!(m.read(&message(0)), Seen { largest_declared: 5, part_way: false, began_part_way: false });
        // A chunk that ends one message and begins another.
        let c = message(20);
        m.read(&c[..10]);
        let mut chunk = c[10..].to_vec();
        chunk.extend_from_slice(&a[..8]);
        assert_eq!(m.read(&chunk), Seen { largest_declared: 15, part_way: true, began_part_way: true });
    }
}
