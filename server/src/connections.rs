//! The server's connections: how many are open, which calls each has open, and when one is
//! closed whatever its peer does.
//!
//! - [`Connections::admit`] wraps each accepted socket in a [`TrackedIo`], or closes it at
//!   once when `limits.max_connections` are open.
//! - [`TrackedIo`] fails its reads and writes (so hyper drops the connection) when it has had
//!   no call open for `limits.idle_connection_timeout`, or when [`Connections::close_all`]
//!   is called at the end of the drain.
//! - [`CallTracking`], a tower layer under tonic, counts each connection's open calls, keeps
//!   what a response holds (an `Echo` reply's share of its connection's budget) until its
//!   body is sent or dropped, and turns a panicking handler into INTERNAL for that call.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tonic::transport::server::{Connected, TlsConnectInfo};

use crate::config::PeerLimits;

/// Every connection of a server.
pub(crate) struct Connections {
    slots: Arc<Semaphore>,
    max: usize,
    closing: CancellationToken,
    idle_timeout: Duration,
    echo_units: usize,
}

impl Connections {
    pub(crate) fn new(limits: &PeerLimits) -> Self {
        Self {
            slots: Arc::new(Semaphore::new(limits.max_connections as usize)),
            max: limits.max_connections as usize,
            closing: CancellationToken::new(),
            idle_timeout: limits.idle_connection_timeout,
            echo_units: echo_units(limits.max_echo_bytes_per_connection) as usize,
        }
    }

    /// Tracks an accepted socket; `None` when every slot is taken (dropping the socket closes
    /// it, so the peer learns at once instead of hanging in the backlog).
    pub(crate) fn admit(&self, io: TcpStream) -> Option<TrackedIo> {
        let slot = Arc::clone(&self.slots).try_acquire_owned().ok()?;
        let connection = Arc::new(Connection {
            open_calls: AtomicUsize::new(0),
            last_active: Mutex::new(Instant::now()),
            echo: Arc::new(Semaphore::new(self.echo_units)),
        });
        Some(TrackedIo {
            io,
            connection,
            _slot: slot,
            idle_timeout: self.idle_timeout,
            idle: Box::pin(tokio::time::sleep(self.idle_timeout)),
            closing: Box::pin(self.closing.clone().cancelled_owned()),
        })
    }

    /// Connections open now.
    pub(crate) fn open(&self) -> usize {
        self.max - self.slots.available_permits()
    }

    /// Closes every connection: their next read or write fails.
    pub(crate) fn close_all(&self) {
        self.closing.cancel();
    }
}

/// `Echo` bytes are counted in KiB (a semaphore takes at most `u32` permits at once).
pub(crate) fn echo_units(bytes: u64) -> u64 {
    bytes.div_ceil(1024)
}

/// One connection's state, shared with the calls on it.
#[derive(Debug)]
pub(crate) struct Connection {
    open_calls: AtomicUsize,
    /// When a call last opened or closed.
    last_active: Mutex<Instant>,
    /// `Echo` reply KiB this connection may still have outstanding.
    pub(crate) echo: Arc<Semaphore>,
}

impl Connection {
    fn touch(&self) {
        *self.last_active.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }

    fn call_opened(self: &Arc<Self>) -> OpenCall {
        self.open_calls.fetch_add(1, Ordering::SeqCst);
        self.touch();
        OpenCall(Arc::clone(self))
    }

    /// When it became idle, if it is.
    fn idle_since(&self) -> Option<Instant> {
        (self.open_calls.load(Ordering::SeqCst) == 0).then(|| *self.last_active.lock().unwrap_or_else(|p| p.into_inner()))
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
    _slot: OwnedSemaphorePermit,
    idle_timeout: Duration,
    idle: Pin<Box<Sleep>>,
    closing: Pin<Box<WaitForCancellationFutureOwned>>,
}

impl TrackedIo {
    /// Whether the connection must end now; registers the wake-ups otherwise.
    fn must_close(&mut self, cx: &mut Context<'_>) -> Option<io::Error> {
        if self.closing.as_mut().poll(cx).is_ready() {
            return Some(io::Error::new(io::ErrorKind::ConnectionAborted, "the server is closing every connection"));
        }
        while self.idle.as_mut().poll(cx).is_ready() {
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

/// Something a response holds until its body is sent or dropped (an `Echo` reply's bytes),
/// put in the response's extensions by the handler.
#[derive(Clone)]
#[expect(dead_code, reason = "held until the body is done, never read")]
pub(crate) struct HeldUntilSent(pub(crate) Arc<OwnedSemaphorePermit>);

/// The tower layer that tracks calls (see the module doc).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CallTracking;

impl<S> tower::Layer<S> for CallTracking {
    type Service = TrackedCalls<S>;

    fn layer(&self, inner: S) -> TrackedCalls<S> {
        TrackedCalls { inner }
    }
}

/// The service [`CallTracking`] makes.
#[derive(Debug, Clone)]
pub(crate) struct TrackedCalls<S> {
    inner: S,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B> tower::Service<http::Request<B>> for TrackedCalls<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let call = connection_of(request.extensions()).map(|c| c.call_opened());
        let path = request.uri().path().to_string();
        let response = self.inner.call(request);
        Box::pin(async move {
            let mut response = match std::panic::AssertUnwindSafe(response).catch_unwind().await {
                Ok(response) => response?,
                Err(panic) => {
                    let message = crate::error::panic_message(panic.as_ref());
                    tracing::error!(call = %path, panic = %message, "a handler panicked");
                    return Ok(tonic::Status::internal(format!("internal error: the {path} handler panicked: {message}")).into_http());
                }
            };
            let held = response.extensions_mut().remove::<HeldUntilSent>();
            Ok(response.map(|inner| tonic::body::Body::new(TrackedBody { inner, _call: call, _held: held })))
        })
    }
}

/// A response body that keeps its call open, and what it holds, until it is done.
struct TrackedBody {
    inner: tonic::body::Body,
    _call: Option<OpenCall>,
    _held: Option<HeldUntilSent>,
}

impl http_body::Body for TrackedBody {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<http_body::Frame<Bytes>, tonic::Status>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}
