//! The link to one server: [`ServerLink`], a tower service a balancer picks between (the
//! host's p2c over the requests each has outstanding; a run over one server has one), and the
//! task behind it that alone owns the server's connection and `Infer` stream.
//!
//! The task connects (again after a break, with backoff), opens the stream, follows the
//! model's status on the server's health service, sends what it is given and hands each
//! answer back to the request's caller. The service is ready while the stream is open and
//! the model SERVING: a server that drains (NOT_SERVING) is given no new requests. When the
//! stream is lost (it ended, failed, stalled, answered UNAVAILABLE, or the model was not
//! SERVING for `request_timeout`) every request on it comes back [`Delivered::Lost`] for the
//! caller to send again, here or elsewhere, under the same id. A connection attempt that fails,
//! or a stream lost before it answered anything, is a failed attempt: the task waits its
//! backoff, and its [`LinkHealth`] says so.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use cleave_common::pb::InferFrame;
use cleave_common::Bundle;
use tokio::sync::{mpsc, oneshot, watch, Notify};
use tokio_stream::StreamExt;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

pub use crate::connector::{LinkFailure, LinkHealth, LinkState};

use crate::connector::Connector;
use crate::error::{ConnectFailure, LinkError, StreamError};
use crate::infer::{AnswerError, InferAnswer, InferSetup, InferStream};
use crate::link::{Link, RetryPolicy};
use crate::session::ServerSession;

/// What every server's task needs to connect and open its stream.
#[derive(Debug)]
pub struct LinkSetup {
    /// The bundle each server must serve.
    pub bundle: Bundle,
    /// How to reach each server.
    pub link: Link,
    /// What its stream opens with (each server must accept every codec and the key); its
    /// `open_timeout` also bounds the wait for the server's health service.
    pub stream: InferSetup,
    /// Reconnecting after a break: backoff between attempts, and the attempts in a row after
    /// which the server counts as unreachable.
    pub retry: RetryPolicy,
    /// Whether a task stops once its server is unreachable (`retry.max_attempts` failed
    /// attempts in a row, or one that trying again cannot fix): a run with no other server to
    /// go to. Otherwise it goes on trying, `max_backoff` apart: a server may come back.
    pub gives_up: bool,
    /// Told whenever a task's [`LinkHealth`] changes.
    pub health_changed: Arc<Notify>,
    /// A stream that leaves its oldest request unanswered this long is dropped as stalled.
    pub request_timeout: Duration,
    /// Requests in flight at most, over every server: no link holds more jobs than that.
    pub in_flight: usize,
}

/// A request to send: its frames as encoded (and sealed) once for every server.
#[derive(Debug)]
pub struct Dispatch {
    /// The request's id, the same on whichever server it goes to.
    pub id: u64,
    /// Its frames.
    pub frames: Vec<InferFrame>,
    /// Its trace context, put in its first frame.
    pub traceparent: Option<String>,
}

/// What became of a request given to a server.
#[derive(Debug)]
pub enum Delivered {
    /// The server answered it (a result or an error).
    Answer {
        /// The server's URL.
        server: Arc<str>,
        /// Its answer.
        answer: InferAnswer,
    },
    /// Its stream was lost before it answered: send it elsewhere.
    Lost {
        /// The server's URL.
        server: Arc<str>,
        /// Why its stream was lost.
        reason: String,
    },
}

struct Job {
    dispatch: Dispatch,
    answer: oneshot::Sender<Delivered>,
}

/// A server, as the balancer sees it: ready while its stream is open and its model serving.
pub struct ServerLink {
    url: Arc<str>,
    jobs: mpsc::Sender<Job>,
    ready: watch::Receiver<bool>,
    changed: Option<ReadyChanged>,
}

/// Resolves when the link's readiness changes (an error once its task has ended).
type ReadyChanged = Pin<Box<dyn Future<Output = std::result::Result<(), watch::error::RecvError>> + Send>>;

impl ServerLink {
    /// Starts the task for `url` (on `first` when that is already its connection).
    pub fn spawn(url: &str, first: Option<ServerSession>, setup: Arc<LinkSetup>) -> (Self, Arc<LinkHealth>) {
        Self::start(url, first.map(|session| (session, None)), setup)
    }

    /// Starts the task for `session`'s server on `stream`, already open on it (the caller
    /// opened it to see any refusal as it is).
    pub fn on_stream(session: ServerSession, stream: InferStream, setup: Arc<LinkSetup>) -> (Self, Arc<LinkHealth>) {
        let url = session.url.clone();
        Self::start(&url, Some((session, Some(stream))), setup)
    }

    fn start(url: &str, first: Option<First>, setup: Arc<LinkSetup>) -> (Self, Arc<LinkHealth>) {
        let (jobs, jobs_rx) = mpsc::channel(setup.in_flight);
        let (ready_tx, ready) = watch::channel(false);
        let health = Arc::new(LinkHealth::default());
        let connector = Connector::new(vec![url.to_string()], setup.bundle.clone(), setup.link.clone(), setup.retry)
            .giving_up(setup.gives_up)
            .reporting(Arc::clone(&health), Arc::clone(&setup.health_changed));
        let url: Arc<str> = url.into();
        let task = LinkTask { url: Arc::clone(&url), setup, connector, jobs: jobs_rx, ready: ready_tx, health: Arc::clone(&health) };
        tokio::spawn(task.run(first));
        (Self { url, jobs, ready, changed: None }, health)
    }
}

impl tower::Service<Dispatch> for ServerLink {
    type Response = Delivered;
    type Error = tower::BoxError;
    type Future = Pin<Box<dyn Future<Output = std::result::Result<Delivered, tower::BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<std::result::Result<(), tower::BoxError>> {
        loop {
            if let Some(changed) = &mut self.changed {
                match changed.as_mut().poll(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Err(_)) => return Poll::Ready(Err(format!("{}: its task ended", self.url).into())),
                    Poll::Ready(Ok(())) => self.changed = None,
                }
            }
            if *self.ready.borrow_and_update() {
                return Poll::Ready(Ok(()));
            }
            let mut ready = self.ready.clone();
            self.changed = Some(Box::pin(async move { ready.changed().await }));
        }
    }

    fn call(&mut self, dispatch: Dispatch) -> Self::Future {
        let (answer, answered) = oneshot::channel();
        let server = Arc::clone(&self.url);
        // A task that is gone loses the request: the caller sends it elsewhere. (The channel
        // holds as many jobs as may be in flight: it is never full.)
        let _ = self.jobs.try_send(Job { dispatch, answer });
        Box::pin(async move { Ok(answered.await.unwrap_or(Delivered::Lost { server, reason: StreamError::Ended.to_string() })) })
    }
}

/// The task behind a [`ServerLink`]; it ends when the link is dropped.
struct LinkTask {
    url: Arc<str>,
    setup: Arc<LinkSetup>,
    /// Connects, and counts the failed attempts in `health`.
    connector: Connector,
    jobs: mpsc::Receiver<Job>,
    ready: watch::Sender<bool>,
    health: Arc<LinkHealth>,
}

/// How a stream ended.
enum StreamEnd {
    /// The link was dropped, and the stream answered what it had.
    Dropped,
    /// The server ended it with nothing on it.
    Quiet,
    /// It was lost: why, and whether it answered anything.
    Lost { reason: StreamError, answered: bool },
}

/// Sends a request on the stream and keeps who waits for its answer.
fn send_job(conn: &InferStream, job: Job, sent_at: &mut BTreeMap<u64, Instant>, on_stream: &mut OnStream) {
    let id = job.dispatch.id;
    conn.send(&job.dispatch.frames, job.dispatch.traceparent.as_deref());
    sent_at.insert(id, Instant::now());
    on_stream.insert(id, job.answer);
}

/// Gives a request back to its caller, to be sent again.
fn lose(server: &Arc<str>, job: Job, reason: &str) {
    let _ = job.answer.send(Delivered::Lost { server: Arc::clone(server), reason: reason.to_string() });
}

/// What a task starts on: a connection, and perhaps a stream already open on it.
type First = (ServerSession, Option<InferStream>);

/// Requests on the stream, by id: who waits for each.
type OnStream = BTreeMap<u64, oneshot::Sender<Delivered>>;

impl LinkTask {
    async fn run(mut self, mut first: Option<First>) {
        let mut opened_before = false;
        // A request that came while no stream was open, for the next one.
        let mut waiting: Option<Job> = None;
        loop {
            let opened = match first.take() {
                Some((session, Some(stream))) => Ok((session, stream)),
                Some((session, None)) => self.open_stream(session).await,
                None => match self.connect().await {
                    Some(Ok(session)) => self.open_stream(session).await,
                    Some(Err(e)) => {
                        tracing::warn!(server = %self.url, error = %e, "giving up on the server");
                        return;
                    }
                    None => return,
                },
            };
            let failure = match opened {
                Ok((session, conn)) => {
                    if std::mem::replace(&mut opened_before, true) && waiting.is_none() {
                        self.update(|s| s.reconnects += 1);
                    }
                    match self.serve_until_lost(&session, conn, waiting.take()).await {
                        StreamEnd::Dropped => return,
                        StreamEnd::Quiet => {
                            // The server ended a stream with nothing on it (no request in
                            // progress for its `limits.idle_stream_timeout`): the next request
                            // opens another on the same connection.
                            let Some(job) = self.jobs.recv().await else { return };
                            (waiting, first) = (Some(job), Some((session, None)));
                            continue;
                        }
                        // A stream that answered is followed by another at once; one lost
                        // before it answered anything counts as a failed attempt.
                        StreamEnd::Lost { reason, answered } => (!answered).then(|| LinkError::Connect {
                            url: self.url.to_string(),
                            failure: ConnectFailure::AnsweredNothing(Box::new(reason)),
                            attempts: 1,
                        }),
                    }
                }
                Err(e) => {
                    // (After a quiet end the link was still taking requests.)
                    self.set_ready(false);
                    if let Some(job) = waiting.take() {
                        self.lose(job, &e.to_string());
                    }
                    Some(e)
                }
            };
            // A link dropped (the run ended, or its server left the list) does not reconnect.
            if self.jobs.is_closed() {
                return;
            }
            if failure.is_some_and(|error| self.connector.failed(&error)) {
                return;
            }
        }
    }

    /// Connects (after the connector's backoff when an attempt failed before), losing the
    /// requests given meanwhile (the balancer gave them before it saw the link not ready):
    /// none once the link is dropped, the last error once the connector gives up.
    async fn connect(&mut self) -> Option<Result<ServerSession, LinkError>> {
        let connecting = self.connector.connect();
        tokio::pin!(connecting);
        loop {
            tokio::select! {
                connected = &mut connecting => return Some(connected),
                job = self.jobs.recv() => match job {
                    None => return None,
                    Some(job) => lose(&self.url, job, "no stream open to this server"),
                },
            }
        }
    }

    /// Checks the server accepts what this run sends and opens the stream on `session`.
    async fn open_stream(&self, session: ServerSession) -> Result<(ServerSession, InferStream), LinkError> {
        let conn = self.setup.stream.open(&session).await?;
        Ok((session, conn))
    }

    /// Serves on an open stream (`waiting` first) until it ends: every request on it then
    /// comes back lost.
    async fn serve_until_lost(&mut self, session: &ServerSession, conn: InferStream, waiting: Option<Job>) -> StreamEnd {
        let mut on_stream = OnStream::new();
        let (reason, answered) = self.serve(session, conn, &mut on_stream, waiting).await;
        let Some(reason) = reason else { return StreamEnd::Dropped };
        // (Not while the model is not SERVING: no request would come to reopen it.)
        if matches!(reason, StreamError::Ended) && on_stream.is_empty() && *self.ready.borrow() {
            tracing::debug!(server = %self.url, "the server ended a stream with nothing on it");
            return StreamEnd::Quiet;
        }
        self.set_ready(false);
        tracing::warn!(server = %self.url, unanswered = on_stream.len(), "stream lost: {reason}; its requests are sent again");
        for (_, job) in on_stream {
            let _ = job.send(Delivered::Lost { server: Arc::clone(&self.url), reason: reason.to_string() });
        }
        StreamEnd::Lost { reason, answered }
    }

    /// Gives a request back to its caller, to be sent again.
    fn lose(&self, job: Job, reason: &str) {
        lose(&self.url, job, reason);
    }

    fn update<T>(&self, change: impl FnOnce(&mut LinkState) -> T) -> T {
        self.health.update(&self.setup.health_changed, change)
    }

    fn set_ready(&self, ready: bool) {
        self.update(|s| s.ready = ready);
        self.ready.send_replace(ready);
    }

    /// Sends and answers on an open stream until it is lost (the reason, and whether it
    /// answered anything) or the link is dropped (no reason).
    async fn serve(
        &mut self,
        session: &ServerSession,
        mut conn: InferStream,
        on_stream: &mut OnStream,
        waiting: Option<Job>,
    ) -> (Option<StreamError>, bool) {
        let timeout = self.setup.request_timeout;
        // Ready only once the health service says SERVING (a server reached while it drains
        // is given nothing), or at once where it has none.
        let (mut statuses, first) = self.follow_health(session).await;
        let mut serving = first != Some(ServingStatus::NotServing) && first != Some(ServingStatus::ServiceUnknown);
        self.set_ready(serving);
        // A model not SERVING for `request_timeout` loses the stream: the server may be one
        // that never serves it again (it drains, its device failed), and a new connection may
        // reach one that does.
        let mut not_serving_since = Instant::now();
        let (mut answered, mut progress) = (false, Instant::now());
        let mut sent_at = BTreeMap::<u64, Instant>::new();
        if let Some(job) = waiting {
            send_job(&conn, job, &mut sent_at, on_stream);
        }
        // Once the link is dropped (the run ended, or the server left the list), the requests
        // on the stream are still answered here.
        let mut closing = false;
        loop {
            if closing && on_stream.is_empty() {
                return (None, answered);
            }
            let oldest = sent_at.values().min().map(|t| *t.max(&progress));
            let stalled_at = oldest.map(|t| tokio::time::Instant::from_std(t) + timeout);
            let not_serving_until = (!serving).then(|| tokio::time::Instant::from_std(not_serving_since.max(progress)) + timeout);
            tokio::select! {
                job = self.jobs.recv(), if !closing => {
                    let Some(job) = job else {
                        closing = true;
                        continue;
                    };
                    send_job(&conn, job, &mut sent_at, on_stream);
                }
                answer = conn.next_answer() => {
                    let answer = match answer {
                        Ok(a) => a,
                        Err(e) => return (Some(e), answered),
                    };
                    if let Err(AnswerError::Refused { code: tonic::Code::Unavailable, message }) = &answer.output {
                        return (Some(StreamError::Draining(message.clone())), answered);
                    }
                    let Some(waiting) = on_stream.remove(&answer.id) else {
                        return (Some(StreamError::NeverSent(answer.id)), answered);
                    };
                    sent_at.remove(&answer.id);
                    progress = Instant::now();
                    if !std::mem::replace(&mut answered, true) {
                        self.connector.succeeded();
                    }
                    let answer = InferAnswer { from: Some(Arc::clone(&self.url)), ..answer };
                    let _ = waiting.send(Delivered::Answer { server: Arc::clone(&self.url), answer });
                }
                () = sleep_until(stalled_at) => return (Some(StreamError::Stalled(timeout)), answered),
                () = sleep_until(not_serving_until) => return (Some(StreamError::NotServing(timeout)), answered),
                status = next_status(&mut statuses) => {
                    // A health stream that ends leaves the stream alone to tell: serving.
                    let now_serving = status.is_none_or(|s| s == ServingStatus::Serving);
                    if status.is_none() {
                        statuses = None;
                    }
                    if now_serving != serving {
                        tracing::info!(server = %self.url, serving = now_serving, "the server's health changed");
                        serving = now_serving;
                        not_serving_since = Instant::now();
                        self.set_ready(serving);
                    }
                },
            }
        }
    }

    /// The model's status on the server's health service as it changes, and its first
    /// status; none where the server has no health service or says nothing within
    /// `connect_timeout` (the stream alone then tells).
    async fn follow_health(
        &self,
        session: &ServerSession,
    ) -> (Option<tonic::Streaming<tonic_health::pb::HealthCheckResponse>>, Option<ServingStatus>) {
        let mut client = HealthClient::new(session.channel.clone());
        let request = HealthCheckRequest { service: session.model.bundle_id.clone() };
        let watch = async {
            let mut statuses = client.watch(request).await.ok()?.into_inner();
            let first = match statuses.next().await {
                Some(Ok(reply)) => Some(reply.status()),
                _ => None,
            };
            Some((statuses, first))
        };
        match tokio::time::timeout(self.setup.stream.open_timeout, watch).await {
            Ok(Some((statuses, first))) => (Some(statuses), first),
            _ => {
                tracing::debug!(server = %self.url, "no health service to follow");
                (None, None)
            }
        }
    }
}

/// The next status the health service reports: `None` once it stops reporting (the server
/// is then taken as serving, and the stream alone tells).
async fn next_status(statuses: &mut Option<tonic::Streaming<tonic_health::pb::HealthCheckResponse>>) -> Option<ServingStatus> {
    match statuses {
        Some(s) => match s.next().await {
            Some(Ok(reply)) => Some(reply.status()),
            _ => None,
        },
        None => std::future::pending().await,
    }
}

async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
