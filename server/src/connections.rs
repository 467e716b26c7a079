//! The server's connections: how many are open, which calls each has open, and when one is
//! closed whatever its peer does.
//!
//! A connection is first *handshaking*: accepted, its TLS handshake (when TLS is on), HTTP/2
//! preface and first call still to come. It counts against `limits.max_handshaking_connections`
//! only, so sockets that say nothing cannot take the places of peers that call, and it is
//! closed when no call has come within `limits.handshake_timeout`; when every handshaking place
//! is taken, the oldest handshaking socket is closed to make room for the new one (a flood of
//! sockets that say nothing then turns over, and a peer that calls at once gets through). Its
//! first call makes it *established*: it then takes one of `limits.max_connections` places, or
//! that call is refused with RESOURCE_EXHAUSTED naming the limit. One peer address (an IPv6
//! peer's /64) holds at most `limits.max_connections_per_address` sockets in either state (a
//! quarter of `max_connections` by default), so no one address takes every place.
//!
//! - [`Connections::admit`] wraps each accepted socket in a [`TrackedIo`], or closes it at
//!   once when its address's share is taken.
//! - [`TrackedIo`] fails its reads and writes (so hyper drops the connection) when its
//!   handshake deadline passes before a call, when it has had no call open for
//!   `limits.idle_connection_timeout`, when an answer on it has not been written within
//!   `limits.answer_timeout` (its peer does not read), or when [`Connections::close_all`] is
//!   called at the end of the drain.
//! - [`CallTracking`], a tower layer under tonic, establishes a connection at its first call,
//!   counts each connection's open calls, ties the reservations of a response's messages to
//!   the chunks that carry them (see [`crate::unsent`]), counts what each call's request body
//!   holds in its peer's share of the budget as it arrives (see [`crate::inbound`]), and turns
//!   a panicking handler into INTERNAL for that call.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tonic::transport::server::{Connected, TlsConnectInfo};

use crate::budget::MemoryBudget;
use crate::config::PeerLimits;
use crate::error::{lock, RequestError};
use crate::inbound::{CountedBody, InboundLimits};
use crate::metrics::Metrics;
use crate::peer::{CallPeer, Peer, PeerGroup};
use crate::unsent::{AnswerClocks, Unsent};
use cleave_common::security::ServerTokens;

/// Every connection of a server.
pub(crate) struct Connections {
    /// Places of established connections (`limits.max_connections`).
    slots: Arc<Semaphore>,
    max: usize,
    /// Places of handshaking connections (`limits.max_handshaking_connections`).
    handshakes: Arc<Semaphore>,
    /// The connections admitted, oldest first: the oldest still handshaking gives its place up
    /// when none is free.
    admitted: Mutex<VecDeque<Weak<Connection>>>,
    max_handshakes: usize,
    /// Sockets per peer address (`limits.max_connections_per_address`).
    per_address: Arc<AddressShares>,
    closing: CancellationToken,
    handshake_timeout: Duration,
    idle_timeout: Duration,
    answer_timeout: Duration,
    metrics: Metrics,
}

/// Why an accepted socket was closed at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// `limits.max_handshaking_connections` sockets are waiting for their first call, and
    /// none of them could give its place up.
    Handshakes(usize),
    /// Its address holds `limits.max_connections_per_address` sockets already.
    AddressShare(u32),
}

impl Refusal {
    /// Its label in `cleave_connections_refused_total`.
    fn reason(self) -> &'static str {
        match self {
            Self::Handshakes(_) => "handshakes",
            Self::AddressShare(_) => "address_share",
        }
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Handshakes(n) => write!(f, "{n} connections are waiting for their first call (`limits.max_handshaking_connections`)"),
            Self::AddressShare(n) => write!(f, "its address holds {n} connections already (`limits.max_connections_per_address`)"),
        }
    }
}

impl Connections {
    pub(crate) fn new(limits: &PeerLimits, metrics: Metrics) -> Self {
        Self {
            slots: Arc::new(Semaphore::new(limits.max_connections as usize)),
            max: limits.max_connections as usize,
            handshakes: Arc::new(Semaphore::new(limits.max_handshaking_connections as usize)),
            admitted: Mutex::default(),
            max_handshakes: limits.max_handshaking_connections as usize,
            per_address: Arc::new(AddressShares { max: limits.max_connections_per_address, held: Mutex::default() }),
            closing: CancellationToken::new(),
            handshake_timeout: limits.handshake_timeout,
            idle_timeout: limits.idle_connection_timeout,
            answer_timeout: limits.answer_timeout,
            metrics,
        }
    }

    /// Tracks an accepted socket as handshaking, or says why it must be closed (dropping the
    /// socket closes it, so the peer learns at once instead of hanging in the backlog).
    pub(crate) fn admit(&self, io: TcpStream) -> Result<TrackedIo, Refusal> {
        let admitted = self.track(io);
        if let Err(refusal) = &admitted {
            self.metrics.connection_refused(refusal.reason());
        }
        admitted
    }

    fn track(&self, io: TcpStream) -> Result<TrackedIo, Refusal> {
        let peer = io.peer_addr().ok().map(|a| PeerGroup::of(a.ip()));
        let share = match peer {
            Some(peer) => Some(AddressShares::take(&self.per_address, peer).ok_or(Refusal::AddressShare(self.per_address.max))?),
            None => None,
        };
        let handshake = match Arc::clone(&self.handshakes).try_acquire_owned() {
            Ok(place) => place,
            Err(_) => self.oldest_handshake_gives_way().ok_or(Refusal::Handshakes(self.max_handshakes))?,
        };
        let connection = Arc::new(Connection {
            open_calls: AtomicUsize::new(0),
            last_active: Mutex::new(Instant::now()),
            answers: Arc::default(),
            place: Mutex::new(Place::Handshaking(handshake)),
            slots: Arc::clone(&self.slots),
            max_connections: self.max,
            given_way: CancellationToken::new(),
            peer,
            _share: share,
        });
        self.remember(&connection);
        let given_way = Box::pin(connection.given_way.clone().cancelled_owned());
        Ok(TrackedIo {
            io,
            connection,
            established: false,
            idle_timeout: self.idle_timeout,
            // The handshake deadline first; the idle timeout once established.
            idle: Box::pin(tokio::time::sleep(self.handshake_timeout)),
            closing: Box::pin(self.closing.clone().cancelled_owned()),
            given_way,
            answer_timeout: self.answer_timeout,
            answer_check: Box::pin(tokio::time::sleep(self.answer_timeout)),
            metrics: self.metrics.clone(),
        })
    }

    /// Closes the oldest connection still handshaking and takes its place, if there is one.
    fn oldest_handshake_gives_way(&self) -> Option<OwnedSemaphorePermit> {
        let mut admitted = lock(&self.admitted);
        while let Some(oldest) = admitted.pop_front() {
            let Some(connection) = oldest.upgrade() else { continue };
            let mut place = lock(&connection.place);
            if !matches!(*place, Place::Handshaking(_)) {
                continue;
            }
            let Place::Handshaking(handshake) = std::mem::replace(&mut *place, Place::Closed) else { unreachable!("matched above") };
            connection.given_way.cancel();
            self.metrics.handshake_given_way();
            return Some(handshake);
        }
        None
    }

    /// Keeps `connection` in the admission order; the connections no longer handshaking are
    /// forgotten whenever they outnumber the handshaking places, so the list stays bounded.
    fn remember(&self, connection: &Arc<Connection>) {
        let mut admitted = lock(&self.admitted);
        if admitted.len() >= 2 * self.max_handshakes {
            admitted.retain(|c| c.upgrade().is_some_and(|c| matches!(*lock(&c.place), Place::Handshaking(_))));
        }
        admitted.push_back(Arc::downgrade(connection));
    }

    /// Established connections open now.
    pub(crate) fn open(&self) -> usize {
        self.max - self.slots.available_permits()
    }

    /// Closes every connection: their next read or write fails.
    pub(crate) fn close_all(&self) {
        self.closing.cancel();
    }
}

/// How many sockets each peer address (group) holds, against its share.
struct AddressShares {
    max: u32,
    held: Mutex<HashMap<PeerGroup, u32>>,
}

impl AddressShares {
    fn take(shares: &Arc<Self>, group: PeerGroup) -> Option<AddressShare> {
        let mut held = lock(&shares.held);
        let n = held.entry(group).or_insert(0);
        if *n >= shares.max {
            return None;
        }
        *n += 1;
        Some(AddressShare { shares: Arc::clone(shares), group })
    }
}

/// One socket of an address, given back when its connection is gone.
#[derive(Debug)]
struct AddressShare {
    shares: Arc<AddressShares>,
    group: PeerGroup,
}

impl std::fmt::Debug for AddressShares {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AddressShares").field("max", &self.max).finish_non_exhaustive()
    }
}

impl Drop for AddressShare {
    fn drop(&mut self) {
        let mut held = lock(&self.shares.held);
        if let Some(n) = held.get_mut(&self.group) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.group);
            }
        }
    }
}

/// The place a connection holds.
#[derive(Debug)]
enum Place {
    /// Waiting for its first call.
    Handshaking(OwnedSemaphorePermit),
    /// One of `limits.max_connections`.
    Established(#[expect(dead_code, reason = "held, never read")] OwnedSemaphorePermit),
    /// Its socket is gone.
    Closed,
}

/// One connection's state, shared with the calls on it.
#[derive(Debug)]
pub(crate) struct Connection {
    open_calls: AtomicUsize,
    /// When a call last opened or closed.
    last_active: Mutex<Instant>,
    /// When each answer not yet written on it was handed over.
    pub(crate) answers: Arc<AnswerClocks>,
    /// The place it holds: handshaking, established or none.
    place: Mutex<Place>,
    /// The places of established connections, one of which its first call takes.
    slots: Arc<Semaphore>,
    max_connections: usize,
    /// Cancelled when it gave its handshaking place up to a newer socket: it closes.
    given_way: CancellationToken,
    /// Who it is from (none where the socket could not tell).
    pub(crate) peer: Option<PeerGroup>,
    _share: Option<AddressShare>,
}

impl Connection {
    fn touch(&self) {
        *lock(&self.last_active) = Instant::now();
    }

    /// Takes one of `limits.max_connections` places at its first call (giving back its
    /// handshaking place); an error names the limit when none is free.
    fn establish(&self) -> Result<(), tonic::Status> {
        let mut place = lock(&self.place);
        match *place {
            Place::Established(_) => Ok(()),
            Place::Handshaking(_) => {
                let slot = Arc::clone(&self.slots).try_acquire_owned().map_err(|_| RequestError::ConnectionLimit { open: self.max_connections })?;
                *place = Place::Established(slot);
                Ok(())
            }
            Place::Closed => Err(RequestError::ConnectionClosing.into()),
        }
    }

    fn is_established(&self) -> bool {
        matches!(*lock(&self.place), Place::Established(_))
    }

    fn call_opened(self: &Arc<Self>) -> OpenCall {
        self.open_calls.fetch_add(1, Ordering::SeqCst);
        self.touch();
        OpenCall(Arc::clone(self))
    }

    /// When it became idle, if it is.
    fn idle_since(&self) -> Option<Instant> {
        (self.open_calls.load(Ordering::SeqCst) == 0).then(|| *lock(&self.last_active))
    }
}

/// A call open on a connection, until its response body is done.
struct OpenCall(Arc<Connection>);

impl Drop for OpenCall {
    fn drop(&mut self) {
        self.0.touch();
        self.0.open_calls.fetch_sub(1, Ordering::SeqCst);
    }
}

/// What each call's request carries: its connection (see [`connection_of`]).
#[derive(Debug, Clone)]
pub(crate) struct ConnectionInfo(pub(crate) Arc<Connection>);

/// The connection a call came on, over plaintext or TLS.
pub(crate) fn connection_of(extensions: &http::Extensions) -> Option<Arc<Connection>> {
    extensions.get::<ConnectionInfo>().or_else(|| extensions.get::<TlsConnectInfo<ConnectionInfo>>().map(|t| t.get_ref())).map(|c| Arc::clone(&c.0))
}

/// An accepted socket that closes itself when idle too long or when the server closes all.
pub(crate) struct TrackedIo {
    io: TcpStream,
    connection: Arc<Connection>,
    /// Whether its first call has come (its deadline is then the idle timeout's).
    established: bool,
    idle_timeout: Duration,
    idle: Pin<Box<Sleep>>,
    closing: Pin<Box<WaitForCancellationFutureOwned>>,
    given_way: Pin<Box<WaitForCancellationFutureOwned>>,
    answer_timeout: Duration,
    /// When to look at the oldest answer not yet written next.
    answer_check: Pin<Box<Sleep>>,
    metrics: Metrics,
}

impl TrackedIo {
    /// Whether the connection must end now; registers the wake-ups otherwise.
    fn must_close(&mut self, cx: &mut Context<'_>) -> Option<io::Error> {
        if self.closing.as_mut().poll(cx).is_ready() {
            return Some(io::Error::new(io::ErrorKind::ConnectionAborted, "the server is closing every connection"));
        }
        if self.given_way.as_mut().poll(cx).is_ready() {
            tracing::debug!("closing the oldest handshaking connection: every handshaking place is taken");
            return Some(io::Error::new(io::ErrorKind::TimedOut, "a newer connection took its handshaking place"));
        }
        if !self.established && self.connection.is_established() {
            self.established = true;
            let idle_deadline = Instant::now() + self.idle_timeout;
            self.idle.as_mut().reset(idle_deadline);
        }
        if let Some(e) = self.answer_overdue(cx) {
            return Some(e);
        }
        while self.idle.as_mut().poll(cx).is_ready() {
            if !self.established {
                tracing::debug!("closing a connection that made no call within `limits.handshake_timeout`");
                return Some(io::Error::new(io::ErrorKind::TimedOut, "no call came within the handshake timeout"));
            }
            match self.connection.idle_since() {
                Some(since) if since.elapsed() >= self.idle_timeout => {
                    tracing::debug!("closing a connection idle for {:?}", self.idle_timeout);
                    return Some(io::Error::new(io::ErrorKind::TimedOut, "the connection was idle too long"));
                }
                Some(since) => self.idle.as_mut().reset(since + self.idle_timeout),
                None => self.idle.as_mut().reset(Instant::now() + self.idle_timeout),
            }
        }
        None
    }
}

impl TrackedIo {
    /// Whether an answer has waited `limits.answer_timeout` to be written; looks again at the
    /// oldest one's deadline, or a quarter of the timeout from now when none waits.
    fn answer_overdue(&mut self, cx: &mut Context<'_>) -> Option<io::Error> {
        while self.answer_check.as_mut().poll(cx).is_ready() {
            let now = Instant::now();
            match self.connection.answers.oldest() {
                Some(since) if now >= since + self.answer_timeout => {
                    tracing::warn!(
                        "closing a connection whose peer took no answer for {:?} (`limits.answer_timeout`): what its streams held is freed",
                        self.answer_timeout
                    );
                    self.metrics.answer_timeout();
                    return Some(io::Error::new(io::ErrorKind::TimedOut, "an answer was not taken within the answer timeout"));
                }
                Some(since) => self.answer_check.as_mut().reset(since + self.answer_timeout),
                None => self.answer_check.as_mut().reset(now + self.answer_timeout / 4),
            }
        }
        None
    }
}

impl Drop for TrackedIo {
    /// Gives its place back at once: calls may hold the connection's state a little longer.
    fn drop(&mut self) {
        *lock(&self.connection.place) = Place::Closed;
    }
}

impl Connected for TrackedIo {
    type ConnectInfo = ConnectionInfo;

    fn connect_info(&self) -> ConnectionInfo {
        ConnectionInfo(Arc::clone(&self.connection))
    }
}

impl AsyncRead for TrackedIo {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        if let Some(e) = self.must_close(cx) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for TrackedIo {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        if let Some(e) = self.must_close(cx) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        if let Some(e) = self.must_close(cx) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// The tower layer that tracks calls (see the module doc), and counts what their request
/// bodies hold in their peer's share of the budget ([`CountedBody`]).
#[derive(Debug, Clone)]
pub(crate) struct CallTracking {
    budget: MemoryBudget,
    max_message_bytes: u64,
    request_timeout: Duration,
    /// The bearer tokens: a named one says whose a call is.
    tokens: Arc<ServerTokens>,
}

impl CallTracking {
    pub(crate) fn new(budget: MemoryBudget, max_message_bytes: u64, request_timeout: Duration, tokens: ServerTokens) -> Self {
        Self { budget, max_message_bytes, request_timeout, tokens: Arc::new(tokens) }
    }
}

impl<S> tower::Layer<S> for CallTracking {
    type Service = TrackedCalls<S>;

    fn layer(&self, inner: S) -> TrackedCalls<S> {
        TrackedCalls { inner, tracking: self.clone() }
    }
}

/// The service [`CallTracking`] makes.
#[derive(Debug, Clone)]
pub(crate) struct TrackedCalls<S> {
    inner: S,
    tracking: CallTracking,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S> tower::Service<http::Request<tonic::body::Body>> for TrackedCalls<S>
where
    S: tower::Service<http::Request<tonic::body::Body>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let connection = connection_of(request.extensions());
        if let Some(Err(refused)) = connection.as_ref().map(|c| c.establish()) {
            return Box::pin(async move { Ok(refused.into_http()) });
        }
        let t = &self.tracking;
        // Whose call it is, and that peer's view of the budget, made once for the call: its
        // body and its handler (through the request's extensions, see `service::budget_of`)
        // spend the same share.
        let peer = Peer::of_call(&t.tokens, request.headers(), connection.as_ref().and_then(|c| c.peer));
        let budget = t.budget.for_peer(peer.clone());
        let mut request = request.map(|body| {
            let limits = InboundLimits { budget: budget.clone(), max_message_bytes: t.max_message_bytes, request_timeout: t.request_timeout };
            tonic::body::Body::new(CountedBody::new(body, limits))
        });
        request.extensions_mut().insert(budget);
        request.extensions_mut().insert(CallPeer(peer));
        let call = connection.map(|c| c.call_opened());
        let path = request.uri().path().to_string();
        let response = self.inner.call(request);
        Box::pin(async move {
            let mut response = match std::panic::AssertUnwindSafe(response).catch_unwind().await {
                Ok(response) => response?,
                Err(panic) => {
                    let message = crate::error::panic_message(panic.as_ref());
                    tracing::error!(call = %path, panic = %message, "a handler panicked");
                    return Ok(tonic::Status::from(RequestError::Panicked(format!("the {path} handler panicked: {message}"))).into_http());
                }
            };
            let unsent = response.extensions_mut().remove::<Unsent>();
            Ok(response.map(|inner| tonic::body::Body::new(TrackedBody { inner, _call: call, unsent })))
        })
    }
}

/// A response body that keeps its call open until it is done, and ties what its messages
/// hold to the chunks that carry them.
struct TrackedBody {
    inner: tonic::body::Body,
    _call: Option<OpenCall>,
    unsent: Option<Unsent>,
}

impl http_body::Body for TrackedBody {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<http_body::Frame<Bytes>, tonic::Status>>> {
        let frame = ready!(Pin::new(&mut self.inner).poll_frame(cx));
        let Some(unsent) = &self.unsent else { return Poll::Ready(frame) };
        Poll::Ready(frame.map(|frame| frame.map(|frame| frame.map_data(|chunk| unsent.attach(chunk)))))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}
