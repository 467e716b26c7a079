//! Answers on their way out: what each holds in the memory budget until its bytes are written
//! to its connection, and since when it has waited.
//!
//! A handler registers each message in its call's [`Unsent`] just before handing it to tonic
//! (its reservation and its length on the wire). tonic encodes messages into chunks of whole
//! messages; [`Unsent::attach`] ties the reservations of the messages a chunk carries to the
//! chunk itself (`Bytes::from_owner`), so they are given back only when hyper and h2 drop the
//! chunk: when its last byte is written to the socket, or when the stream or connection is
//! gone. What h2 buffers for a peer that does not read therefore counts against the budget.
//!
//! Each message also starts a [`Waiting`] clock on its connection, stopped the same way; the
//! connection closes itself when one has run for `limits.answer_timeout` (see
//! [`crate::connections`]): a peer that does not read cannot be sent a status, and closing is
//! the one way to free what h2 holds for its streams.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::time::Instant;

use crate::budget::Reservation;
use crate::error::lock;

/// gRPC's length prefix before each message.
const GRPC_PREFIX: usize = 5;

/// A message's bytes on the wire: gRPC's prefix and the message.
pub(crate) fn wire_bytes(message: &impl prost::Message) -> u64 {
    (GRPC_PREFIX + message.encoded_len()) as u64
}

/// What an answer of `tensor_bytes` can take on the wire: its tensors at a codec's worst
/// case (a block that does not shrink is stored; sealing adds a tag per block), and 64 KiB
/// for the envelope and the frames' headers.
pub(crate) fn answer_bytes(tensor_bytes: u64) -> u64 {
    tensor_bytes.saturating_add(tensor_bytes / 64).saturating_add(64 << 10)
}

/// The messages of one call handed to tonic and not yet in a chunk, in order. Cloned into
/// the response's extensions, where [`crate::connections::CallTracking`] finds it.
#[derive(Clone, Default)]
pub(crate) struct Unsent {
    queue: Arc<Mutex<VecDeque<Message>>>,
    clocks: Option<Arc<AnswerClocks>>,
}

/// One message handed to tonic.
struct Message {
    wire_bytes: usize,
    _held: Reservation,
    _waiting: Option<Waiting>,
}

impl Unsent {
    /// Messages of a call on a connection with `clocks` (none for a call without one, as in
    /// tests that call the service directly).
    pub(crate) fn new(clocks: Option<Arc<AnswerClocks>>) -> Self {
        Self { queue: Arc::default(), clocks }
    }

    /// Registers `message`, about to be handed to tonic, with its share of `from` (its bytes
    /// on the wire, or what `from` has left) held until it is written.
    pub(crate) fn hold(&self, message: &impl prost::Message, from: &mut Reservation) {
        let wire_bytes = wire_bytes(message);
        let waiting = self.clocks.as_ref().map(AnswerClocks::start);
        lock(&self.queue).push_back(Message { wire_bytes: wire_bytes as usize, _held: from.split_off(wire_bytes), _waiting: waiting });
    }

    /// `chunk`, holding the reservations and clocks of the messages it carries (the next
    /// ones registered, as many as its length covers) until it is dropped.
    pub(crate) fn attach(&self, chunk: Bytes) -> Bytes {
        let mut carried = Vec::new();
        let mut covered = 0;
        {
            let mut queue = lock(&self.queue);
            while covered < chunk.len() {
                let Some(message) = queue.pop_front() else { break };
                covered += message.wire_bytes;
                carried.push(message);
            }
        }
        if carried.is_empty() {
            return chunk;
        }
        Bytes::from_owner(Carried { chunk, _messages: carried })
    }

    /// Messages registered and not yet in a chunk.
    #[cfg(test)]
    fn queued(&self) -> usize {
        lock(&self.queue).len()
    }
}

/// A chunk and what its messages hold.
struct Carried {
    chunk: Bytes,
    _messages: Vec<Message>,
}

impl AsRef<[u8]> for Carried {
    fn as_ref(&self) -> &[u8] {
        &self.chunk
    }
}

/// When each answer not yet written on a connection was handed to tonic.
#[derive(Debug, Default)]
pub(crate) struct AnswerClocks {
    running: Mutex<BTreeMap<u64, Instant>>,
    next: AtomicU64,
}

impl AnswerClocks {
    fn start(self: &Arc<Self>) -> Waiting {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        lock(&self.running).insert(id, Instant::now());
        Waiting { clocks: Arc::clone(self), id }
    }

    /// Since when the oldest answer not yet written has waited.
    pub(crate) fn oldest(&self) -> Option<Instant> {
        lock(&self.running).first_key_value().map(|(_, since)| *since)
    }
}

/// An answer's clock, stopped when dropped.
struct Waiting {
    clocks: Arc<AnswerClocks>,
    id: u64,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        lock(&self.clocks.running).remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::MemoryBudget;
    use std::time::Duration;

    #[tokio::test]
    async fn a_chunk_holds_the_reservations_and_clocks_of_the_messages_it_carries_until_dropped() {
        let budget = MemoryBudget::new(1 << 20, 1 << 20, 1 << 10, Duration::from_secs(1));
        let clocks = Arc::new(AnswerClocks::default());
        let unsent = Unsent::new(Some(Arc::clone(&clocks)));
        // 10 KiB on the wire each: 5 bytes of prefix, 3 of field tag and length, the payload.
        let messages: Vec<_> = (0..3).map(|i| cleave_common::pb::EchoReply { payload: Bytes::from(vec![i; (10 << 10) - 8]) }).collect();
        for m in &messages {
            unsent.hold(m, &mut budget.reserve(10 << 10).await.unwrap());
        }
        assert_eq!((budget.held_bytes(), unsent.queued()), (30 << 10, 3));
        // tonic puts the first two messages in one chunk: it carries both.
        let wire = |m: &cleave_common::pb::EchoReply| wire_bytes(m) as usize;
        let first = unsent.attach(Bytes::from(vec![0u8; wire(&messages[0]) + wire(&messages[1])]));
        assert_eq!(unsent.queued(), 1);
        assert!(clocks.oldest().is_some());
        let second = unsent.attach(Bytes::from(vec![0u8; wire(&messages[2])]));
        assert_eq!((budget.held_bytes(), unsent.queued()), (30 << 10, 0), "held until written");
        // A chunk split by h2 holds until its last part is dropped.
        let part = first.slice(0..10);
        drop(first);
        assert_eq!(budget.held_bytes(), 30 << 10);
        drop(part);
        assert_eq!(budget.held_bytes(), 10 << 10);
        drop(second);
        assert_eq!(budget.held_bytes(), 0);
        assert_eq!(clocks.oldest(), None, "every clock stopped");
        // A chunk with nothing registered (a status, a message of another kind) passes as is.
        assert_eq!(unsent.attach(Bytes::from_static(b"abc")), Bytes::from_static(b"abc"));
    }
}
