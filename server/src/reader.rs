//! The one reader machinery of the `Infer`, `Train` and `Generate` streams: what a stream's reader deals
//! with next (a frame, the payload part-way in stalling, the stream idle, the server
//! draining, the host ending or breaking the stream), and the deadline of the payload
//! part-way in.

use std::future::Future;
use std::time::Duration;

use cleave_common::wire::FrameAssembler;
use tokio::time::Instant;
use tokio_stream::{Stream, StreamExt};
use tokio_util::sync::CancellationToken;
use tonic::Status;

use crate::error::RequestError;

/// What a stream's reader deals with next.
pub(crate) enum Next<F> {
    /// A frame from the host.
    Frame(F),
    /// The payload part-way in did not finish within `limits.request_timeout`.
    Stalled,
    /// Nothing came within the stream's idle timeout.
    Idle,
    /// The server is draining.
    Draining,
    /// The host closed its side of the stream.
    End,
    /// The stream failed (reset, connection lost), or nobody reads its answers any more.
    Broken,
    /// The call's request bytes were refused as they came ([`crate::inbound`]): the call ends
    /// with this error.
    Refused(RequestError),
}

/// Reads a stream's frames, keeping the deadline of the payload part-way in.
pub(crate) struct FrameReader<S> {
    inbound: S,
    draining: CancellationToken,
    request_timeout: Duration,
    /// How long the stream may say nothing between payloads (none: as long as it likes).
    idle_timeout: Option<Duration>,
    /// When the payload part-way in must be complete.
    deadline: Option<Instant>,
    /// Since when the stream counts as idle: the last frame, or with [`Self::renewed_by_work`]
    /// the last work its owner said it did ([`Self::renew`]).
    active_at: Instant,
    frames_renew: bool,
}

impl<S, F> FrameReader<S>
where
    S: Stream<Item = Result<F, Status>> + Unpin,
{
    pub(crate) fn new(inbound: S, draining: CancellationToken, request_timeout: Duration, idle_timeout: Option<Duration>) -> Self {
        Self { inbound, draining, request_timeout, idle_timeout, deadline: None, active_at: Instant::now(), frames_renew: true }
    }

    /// From now on frames do not keep the stream alive: only what its owner calls
    /// [`Self::renew`] for (a generation step that ran, not a refused one or an empty frame).
    pub(crate) fn renewed_by_work(&mut self) {
        self.frames_renew = false;
        self.renew();
    }

    /// The stream did work: its idle timeout starts again.
    pub(crate) fn renew(&mut self) {
        self.active_at = Instant::now();
    }

    /// When the stream last counted as active (its idle timeout runs from then).
    pub(crate) fn active_at(&self) -> Instant {
        self.active_at
    }

    /// Waits for what comes first: the server draining, `answers_gone` (the response
    /// dropped), the payload part-way in stalling or the stream going idle, or the next frame.
    pub(crate) async fn next(&mut self, answers_gone: impl Future<Output = ()>) -> Next<F> {
        if self.frames_renew {
            self.renew();
        }
        let wait_until = self.deadline.or_else(|| self.idle_timeout.map(|idle| self.active_at + idle));
        let quiet = async {
            match wait_until {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            () = self.draining.cancelled() => Next::Draining,
            () = answers_gone => Next::Broken,
            () = quiet => if self.deadline.take().is_some() { Next::Stalled } else { Next::Idle },
            frame = self.inbound.next() => match frame {
                Some(Ok(frame)) => Next::Frame(frame),
                Some(Err(status)) => match status.code() {
                    // (What `CountedBody` gives: tonic passes it on as it is.)
                    code @ (tonic::Code::ResourceExhausted | tonic::Code::DeadlineExceeded) => {
                        Next::Refused(RequestError::Inbound { code, message: status.message().to_string() })
                    }
                    _ => {
                        tracing::debug!(%status, "inbound stream failed");
                        Next::Broken
                    }
                },
                None => Next::End,
            },
        }
    }

    /// The stream's opening frame, which must come within `request_timeout` (as a payload
    /// part-way in must be complete): `Err(None)` when it does not, or when the server drains,
    /// the answers go, or the host ends or breaks the stream first; `Err(Some(why))` when its
    /// bytes were refused as they came.
    pub(crate) async fn first(&mut self, answers_gone: impl Future<Output = ()>) -> Result<F, Option<RequestError>> {
        self.payload_part_way(true);
        let next = self.next(answers_gone).await;
        self.payload_part_way(false);
        match next {
            Next::Frame(frame) => Ok(frame),
            Next::Refused(e) => Err(Some(e)),
            Next::Stalled | Next::Idle | Next::Draining | Next::End | Next::Broken => Err(None),
        }
    }

    /// After a frame: while a payload is part-way in (`frames`), it must be complete within
    /// `request_timeout` of the first frame that left it so; otherwise there is no deadline.
    pub(crate) fn track<T>(&mut self, frames: &FrameAssembler<T>) {
        self.payload_part_way(frames.in_progress());
    }

    fn payload_part_way(&mut self, part_way: bool) {
        if !part_way {
            self.deadline = None;
        } else if self.deadline.is_none() {
            self.deadline = Some(Instant::now() + self.request_timeout);
        }
    }

    /// The error a payload part-way in is given up with when it stalls.
    pub(crate) fn stalled(&self) -> RequestError {
        RequestError::Stalled(self.request_timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIMEOUT: Duration = Duration::from_secs(5);
    const IDLE: Duration = Duration::from_secs(60);

    /// A reader of `frames` (then a stream that stays open), the stream idle after `idle`.
    fn reading(
        frames: Vec<Result<u32, Status>>,
        idle: Option<Duration>,
    ) -> (FrameReader<impl Stream<Item = Result<u32, Status>> + Unpin>, CancellationToken) {
        let draining = CancellationToken::new();
        let inbound = tokio_stream::iter(frames).chain(tokio_stream::pending());
        (FrameReader::new(inbound, draining.clone(), TIMEOUT, idle), draining)
    }

    fn name<F>(next: &Next<F>) -> &'static str {
        match next {
            Next::Frame(_) => "frame",
            Next::Stalled => "stalled",
            Next::Idle => "idle",
            Next::Draining => "draining",
            Next::End => "end",
            Next::Broken => "broken",
            Next::Refused(_) => "refused",
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_payload_part_way_stalls_at_its_deadline_then_the_stream_goes_idle() {
        let (mut reader, _draining) = reading(vec![Ok(1)], Some(IDLE));
        let started = Instant::now();
        assert!(matches!(reader.next(std::future::pending()).await, Next::Frame(1)));
        reader.payload_part_way(true);
        // A later frame of the same payload does not move its deadline.
        tokio::time::advance(Duration::from_secs(3)).await;
        reader.payload_part_way(true);
        assert_eq!(name(&reader.next(std::future::pending()).await), "stalled");
        assert_eq!(started.elapsed(), TIMEOUT);
        assert!(matches!(reader.stalled(), RequestError::Stalled(t) if t == TIMEOUT));
        // The deadline went with the stall: what comes next is the idle timeout.
        assert_eq!(name(&reader.next(std::future::pending()).await), "idle");
        assert_eq!(started.elapsed(), TIMEOUT + IDLE);
    }

    #[tokio::test(start_paused = true)]
    async fn a_complete_payload_clears_its_deadline_and_without_an_idle_timeout_the_reader_waits() {
        let (mut reader, _draining) = reading(vec![], None);
        reader.payload_part_way(true);
        reader.payload_part_way(false);
        let waited = tokio::time::timeout(Duration::from_secs(3600), reader.next(std::future::pending())).await;
        assert!(waited.is_err(), "nothing to wait for: no deadline, no idle timeout");
    }

    #[tokio::test(start_paused = true)]
    async fn draining_comes_before_a_waiting_frame_and_a_dropped_response_before_a_stall() {
        let (mut reader, draining) = reading(vec![Ok(1)], Some(IDLE));
        draining.cancel();
        assert_eq!(name(&reader.next(std::future::pending()).await), "draining");
        let (mut reader, _draining) = reading(vec![Ok(1)], Some(IDLE));
        reader.payload_part_way(true);
        tokio::time::advance(TIMEOUT * 2).await;
        assert_eq!(name(&reader.next(std::future::ready(())).await), "broken");
        assert_eq!(name(&reader.next(std::future::pending()).await), "stalled");
    }

    #[tokio::test(start_paused = true)]
    async fn an_opening_frame_comes_within_the_request_timeout_whatever_the_idle_timeout() {
        let (mut silent, _draining) = reading(vec![], Some(IDLE));
        let started = Instant::now();
        assert!(matches!(silent.first(std::future::pending()).await, Err(None)));
        assert_eq!(started.elapsed(), TIMEOUT, "the request timeout, not the longer idle timeout");
        let (mut draining_first, draining) = reading(vec![], None);
        draining.cancel();
        assert!(matches!(draining_first.first(std::future::pending()).await, Err(None)));
        let (mut opened, _draining) = reading(vec![Ok(3)], None);
        assert!(matches!(opened.first(std::future::pending()).await, Ok(3)));
        // The opening frame's deadline went with it: without an idle timeout the reader waits.
        let waited = tokio::time::timeout(Duration::from_secs(3600), opened.next(std::future::pending())).await;
        assert!(waited.is_err());
    }

    #[tokio::test]
    async fn the_host_ending_its_side_is_the_end_a_failed_stream_is_broken_and_refused_bytes_end_the_call() {
        let draining = CancellationToken::new();
        let mut ended = FrameReader::new(tokio_stream::iter(vec![Ok::<u32, Status>(7)]), draining.clone(), TIMEOUT, None);
        assert!(matches!(ended.next(std::future::pending()).await, Next::Frame(7)));
        assert_eq!(name(&ended.next(std::future::pending()).await), "end");
        let mut failed = FrameReader::new(tokio_stream::iter(vec![Err::<u32, Status>(Status::cancelled("reset"))]), draining.clone(), TIMEOUT, None);
        assert_eq!(name(&failed.next(std::future::pending()).await), "broken");
        // The call's own bytes refused as they came (`inbound`): the call ends with why.
        let refused = Status::resource_exhausted("no room in this peer's share");
        let mut refused = FrameReader::new(tokio_stream::iter(vec![Err::<u32, Status>(refused)]), draining, TIMEOUT, None);
        match refused.next(std::future::pending()).await {
            Next::Refused(RequestError::Inbound { code, message }) => {
                assert_eq!((code, message.as_str()), (tonic::Code::ResourceExhausted, "no room in this peer's share"));
            }
            other => panic!("{}", name(&other)),
        }
    }
}
