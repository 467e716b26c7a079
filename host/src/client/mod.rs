//! The streaming client: runs the prefix of each request on its own thread ([`prefix`]),
//! streams the boundaries to the server and collects the results, with up to `in_flight`
//! requests travelling at once (the prefix of request i+1 runs while request i is on the
//! wire or on the server).
//!
//! Servers fail, stall and restart; the client keeps every request until it has its one
//! outcome:
//! - A connection that ends, fails, carries garbage, answers UNAVAILABLE (a server
//!   draining) or leaves a request unanswered past `request_timeout` is dropped whole.
//! - The client reconnects after exponential backoff with jitter (`retry:`) and resends
//!   every request not yet answered, as it was encoded, in order. Requests carry the host's
//!   session id: one the server computed before is answered from its window of recent
//!   results rather than computed again.
//! - An id gets exactly one outcome: an answer for an id already answered is dropped (and
//!   counted). A request sent `retry.max_attempts` times, and every request once
//!   `retry.max_attempts` connection attempts in a row fail, gets an error, unless
//!   `fallback: edge` runs it on the edge instead.
//! - A run whose first [`SAME_LASTING_ERRORS_TO_STOP`] outcomes are one error that sending
//!   again cannot fix (a wrong key, a refused input) stops there rather than send the rest.

mod balanced;
pub mod dns;
mod prefix;
mod request;

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use cleave_client::{connect, AnswerError, ConnectFailure, InferAnswer, InferSetup, InferStream, LinkError, ServerSession, StreamError};
use cleave_common::wire::PayloadSender;
use cleave_common::{Boundary, Bundle};
use tokio::sync::mpsc;

pub use self::request::{ChoosesCodec, Codecs, RequestMetrics, RequestOutcome, ServedBy, Splits, StreamCounts, StreamPlan};
pub use cleave_client::ServerTimes;

use self::prefix::{run_prefixes, PrefixChannels, Prepared, Produced, ToPrefix};
use self::request::ms;
use crate::config::{Fallback, Resilience};
use crate::error::{HostError, RequestFailure, Result};

/// Sends every request and calls `on_outcome` exactly once per request id, in the order the
/// outcomes come, reconnecting as `plan.resilience` says. Results are framed by the server's
/// message limit and accepted up to its payload limit. `session` ends as the last connection.
pub async fn stream_requests(session: &mut ServerSession, plan: StreamPlan, on_outcome: impl FnMut(RequestOutcome)) -> Result<StreamCounts> {
    stream_to(session, None, plan, on_outcome).await
}

/// As [`stream_requests`], over every server `servers` lists as the list changes (`session`,
/// connected to one of them, gives the limits), each request to the less loaded of two
/// picked at random; a request whose server is lost goes to another. `fallback: edge` is not
/// offered here.
pub async fn stream_balanced(
    session: &mut ServerSession,
    servers: tokio::sync::watch::Receiver<Vec<String>>,
    plan: StreamPlan,
    on_outcome: impl FnMut(RequestOutcome),
) -> Result<StreamCounts> {
    if plan.resilience.fallback == Fallback::Edge {
        return Err(HostError::NoRequestCanBeSent { why: "`fallback: edge` is for one server; with several, a request goes to another" });
    }
    // A sealed request moved to another server must stay within its replay window there.
    if plan.key.is_some() && plan.in_flight > (cleave_common::wire::REPLAY_WINDOW / 4) as usize {
        return Err(HostError::NoRequestCanBeSent { why: "with sealed payloads and several servers, in_flight is at most 2048" });
    }
    stream_to(session, Some(servers), plan, on_outcome).await
}

/// The run over the servers `servers` lists, or over `session`'s server alone.
async fn stream_to(
    session: &mut ServerSession,
    servers: Option<tokio::sync::watch::Receiver<Vec<String>>>,
    plan: StreamPlan,
    on_outcome: impl FnMut(RequestOutcome),
) -> Result<StreamCounts> {
    let setup = InferSetup::new(plan.codec.all(), plan.key.clone(), plan.resilience.connect_timeout);
    setup.check(session)?;
    if plan.in_flight == 0 {
        return Err(HostError::NoRequestCanBeSent { why: "in_flight must be at least 1" });
    }
    // Resends go in id order, which must be the order requests were sealed in.
    if plan.ids.windows(2).any(|w| w[0] >= w[1]) {
        return Err(HostError::NoRequestCanBeSent { why: "request ids must be strictly increasing" });
    }
    // One sender for the whole run: a request resent on a new connection goes as it was
    // sealed, and new ones continue its nonce counter.
    let sender = match setup.key_id {
        Some(id) => PayloadSender::sealed(&setup.ring, id)?,
        None => PayloadSender::plain(),
    };
    let (asks, asks_rx) = std::sync::mpsc::channel();
    for _ in 0..plan.in_flight {
        asks.send(ToPrefix::Go).expect("the receiver is here");
    }
    let (produced_tx, produced) = mpsc::unbounded_channel();
    let on_edge = Arc::new(AtomicBool::new(false));
    let run = Run {
        total: plan.ids.len(),
        in_flight: plan.in_flight,
        resilience: plan.resilience,
        bundle: plan.bundle.clone(),
        setup,
        unanswered: BTreeMap::new(),
        at_edge: HashSet::new(),
        outcomes: HashSet::new(),
        counts: StreamCounts::default(),
        first_outcomes: FirstOutcomes::default(),
        asks,
        on_edge: Arc::clone(&on_edge),
        on_outcome,
    };
    let chunk_bytes = session.chunk_bytes();
    let channels = PrefixChannels { asks: asks_rx, produced: produced_tx, on_edge };
    let producer = std::thread::Builder::new()
        .name("cleave-prefix".into())
        .spawn(move || run_prefixes(plan, sender, chunk_bytes, channels))
        .map_err(|error| HostError::ThreadStart { what: "the prefix thread", error })?;
    let counts = match servers {
        Some(servers) => run.stream_balanced(session, servers, produced).await,
        None => run.stream(session, produced).await,
    };
    let produced = producer.join().map_err(|_| HostError::ThreadPanicked { what: "the prefix thread" })?;
    produced?;
    let counts = counts?;
    if counts.never_sent > 0 || counts.failed > 0 {
        tracing::warn!(failed = counts.failed, never_sent = counts.never_sent, "not every request was answered");
    }
    Ok(counts)
}

/// After this many first outcomes, all the same lasting error, a run stops.
pub const SAME_LASTING_ERRORS_TO_STOP: u32 = 3;

/// The first outcomes of a run, watched while each is the same error that sending again
/// cannot fix.
#[derive(Debug, Default)]
enum FirstOutcomes {
    /// None yet.
    #[default]
    None,
    /// `count` outcomes so far, each this error.
    Failing { error: RequestFailure, count: u32 },
    /// One succeeded, or failed otherwise: the run goes on to its end.
    Mixed,
}

impl FirstOutcomes {
    fn observe(&mut self, output: &Result<Boundary, RequestFailure>) {
        let lasting = |e: &RequestFailure| is_lasting(e.server_code());
        *self = match (std::mem::take(self), output) {
            (Self::None, Err(error)) if lasting(error) => Self::Failing { error: error.clone(), count: 1 },
            (Self::Failing { error, count }, Err(e)) if lasting(e) && e.same_refusal(&error) => Self::Failing { error, count: count + 1 },
            _ => Self::Mixed,
        };
    }

    /// The error to stop on, once enough first outcomes are it.
    fn stop_on(&self) -> Option<&RequestFailure> {
        match self {
            Self::Failing { error, count } if *count >= SAME_LASTING_ERRORS_TO_STOP => Some(error),
            _ => None,
        }
    }
}

/// Error answers that the same request sent again would get again.
fn is_lasting(code: Option<tonic::Code>) -> bool {
    use tonic::Code::{FailedPrecondition, InvalidArgument, PermissionDenied, Unauthenticated, Unimplemented};
    matches!(code, Some(Unauthenticated | PermissionDenied | InvalidArgument | FailedPrecondition | Unimplemented))
}

/// A request sent (or waiting for a connection) and not answered yet.
struct Unanswered {
    prepared: Prepared,
    /// When it was last sent; none while it waits for a connection.
    sent_at: Option<Instant>,
    /// The span of its last sending, open until answered or lost; its context travels with
    /// the request, so that the server's spans join the trace under it.
    attempt: tracing::Span,
}

/// The streaming loop's state: every request between its prefix and its outcome.
struct Run<F> {
    total: usize,
    /// Requests between their prefix and their outcome, at most.
    in_flight: usize,
    resilience: Resilience,
    bundle: Bundle,
    /// What each stream opens with (a new connection's server must accept every codec); its
    /// session id is random per run.
    setup: InferSetup,
    /// By id: resent in order, so that sealed payloads keep increasing nonces on a stream.
    unanswered: BTreeMap<u64, Unanswered>,
    /// Handed to the prefix thread to finish on the edge.
    at_edge: HashSet<u64>,
    /// Ids with their outcome.
    outcomes: HashSet<u64>,
    counts: StreamCounts,
    first_outcomes: FirstOutcomes,
    asks: std::sync::mpsc::Sender<ToPrefix>,
    on_edge: Arc<AtomicBool>,
    on_outcome: F,
}

/// Reconnecting: attempts in a row that failed, and when the next one starts.
struct Reconnect {
    attempts: u32,
    at: Option<tokio::time::Instant>,
    backoff: cleave_client::Backoff,
}

type Connecting = std::pin::Pin<Box<dyn std::future::Future<Output = Result<(ServerSession, InferStream)>> + Send>>;

/// The run's link to the server: the connection, or the one being opened, and how
/// reconnecting goes.
struct Link {
    conn: Option<InferStream>,
    connecting: Option<Connecting>,
    reconnect: Reconnect,
    /// The caller's connection, which the first stream opens on.
    first: Option<ServerSession>,
    opened_before: bool,
    /// The connection's last sign of life: it opened, or it answered. The server answers a
    /// stream's requests in order, so while answers come nothing is stalled.
    progress: Instant,
    answered_on_conn: bool,
}

impl<F: FnMut(RequestOutcome)> Run<F> {
    async fn stream(mut self, session: &mut ServerSession, mut produced: mpsc::UnboundedReceiver<Produced>) -> Result<StreamCounts> {
        let mut link = Link {
            conn: None,
            connecting: None,
            reconnect: self.fresh_reconnect(Some(tokio::time::Instant::now())),
            first: Some(session.clone()),
            opened_before: false,
            progress: Instant::now(),
            answered_on_conn: false,
        };
        let mut produced_open = true;
        let timeout = self.resilience.request_timeout;
        loop {
            if self.outcomes.len() == self.total || (!produced_open && self.unanswered.is_empty() && self.at_edge.is_empty()) {
                break;
            }
            if let Some(error) = self.first_outcomes.stop_on() {
                tracing::error!("the first {SAME_LASTING_ERRORS_TO_STOP} requests all failed with {error}: the rest are not sent");
                self.stop_early(&format!("the run stopped after its first {SAME_LASTING_ERRORS_TO_STOP} requests failed alike"));
                break;
            }
            let now = tokio::time::Instant::now();
            if link.conn.is_none() && link.connecting.is_none() && link.reconnect.at.is_some_and(|at| at <= now) {
                link.reconnect.at = None;
                link.connecting = Some(self.connect(link.first.take(), session));
            }
            let oldest = link.conn.as_ref().and(self.unanswered.values().filter_map(|u| u.sent_at).min());
            let stalled_at = oldest.map(|t| tokio::time::Instant::from_std(t.max(link.progress)) + timeout);
            let retry_at = if link.conn.is_none() && link.connecting.is_none() { link.reconnect.at } else { None };
            let gave_up = tokio::select! {
                p = produced.recv(), if produced_open => {
                    match p {
                        None => {
                            produced_open = false;
                            self.prefix_thread_gone();
                        }
                        Some(Produced::Local(outcome)) => self.record(outcome),
                        Some(Produced::Remote(p)) => self.take(p, link.conn.as_ref()),
                    }
                    false
                }
                answer = next_answer(&mut link.conn) => self.on_answer(answer, &mut link, session),
                () = sleep_until(stalled_at) => {
                    link.conn = None;
                    self.lost(StreamError::Stalled(timeout), link.answered_on_conn, &mut link.reconnect, session)
                }
                opened = opening(&mut link.connecting) => {
                    link.connecting = None;
                    self.on_opened(opened, &mut link, session)
                }
                () = sleep_until(retry_at) => false,
            };
            if gave_up {
                break;
            }
        }
        self.counts.never_sent = (self.total - self.outcomes.len()) as u64;
        Ok(self.counts)
    }

    /// An answer on the connection, or its end; true when the run gives up.
    fn on_answer(&mut self, answer: std::result::Result<InferAnswer, StreamError>, link: &mut Link, session: &ServerSession) -> bool {
        match answer.and_then(|a| self.answered(a)) {
            Ok(()) => {
                link.progress = Instant::now();
                if !link.answered_on_conn {
                    link.answered_on_conn = true;
                    link.reconnect = self.fresh_reconnect(None);
                }
                false
            }
            Err(reason) => {
                link.conn = None;
                self.lost(reason, link.answered_on_conn, &mut link.reconnect, session)
            }
        }
    }

    /// A connection opened (what was not answered is resent on it) or failed to; true when
    /// the run gives up.
    fn on_opened(&mut self, opened: Result<(ServerSession, InferStream)>, link: &mut Link, session: &mut ServerSession) -> bool {
        match opened {
            Ok((s, c)) => {
                if link.opened_before {
                    self.counts.reconnects += 1;
                    tracing::info!(url = %s.url, unanswered = self.unanswered.len(), "reconnected: resending what was not answered");
                }
                link.opened_before = true;
                *session = s;
                // The backoff goes on until the connection answers something.
                (link.progress, link.answered_on_conn) = (Instant::now(), false);
                self.on_edge.store(false, Ordering::Relaxed);
                self.resend(&c);
                link.conn = Some(c);
                false
            }
            Err(e) => self.connect_failed(&e, &mut link.reconnect),
        }
    }
}

impl<F: FnMut(RequestOutcome)> Run<F> {
    /// Backoff from the start (the next attempt `at`), then from 100 ms doubling with jitter
    /// up to `retry.max_backoff`.
    fn fresh_reconnect(&self, at: Option<tokio::time::Instant>) -> Reconnect {
        Reconnect { attempts: 0, at, backoff: self.resilience.retry.backoff() }
    }

    /// Opens a stream: on `first` (the caller's connection) or on a new connection to the
    /// same server, which must serve the same bundle and accept the same payloads.
    fn connect(&self, first: Option<ServerSession>, last: &ServerSession) -> Connecting {
        let (url, link, bundle) = (last.url.clone(), last.link.clone(), self.bundle.clone());
        let setup = self.setup.clone();
        Box::pin(async move {
            let session = match first {
                Some(s) => s,
                None => connect(&url, &bundle, &link).await?,
            };
            let conn = setup.open(&session).await?;
            Ok((session, conn))
        })
    }

    /// Records a request's one outcome and lets the prefix thread start another.
    fn record(&mut self, outcome: RequestOutcome) {
        self.first_outcomes.observe(&outcome.output);
        let id = outcome.request_id;
        self.at_edge.remove(&id);
        if !self.outcomes.insert(id) {
            self.counts.duplicates_dropped += 1;
            tracing::warn!(request_id = id, "a second outcome for a request that has one: dropped");
            return;
        }
        match &outcome.output {
            Ok(_) => self.counts.answered += 1,
            Err(_) => self.counts.failed += 1,
        }
        if outcome.output.is_ok() && outcome.metrics.served_by == ServedBy::Edge {
            self.counts.served_by_edge += 1;
        }
        let _ = self.asks.send(ToPrefix::Go);
        (self.on_outcome)(outcome);
    }

    /// A request fresh from the prefix thread: sent at once when connected; with no
    /// connection, kept for the next one, or finished on the edge with `fallback: edge`.
    fn take(&mut self, prepared: Prepared, conn: Option<&InferStream>) {
        let mut u = Unanswered { prepared, sent_at: None, attempt: tracing::Span::none() };
        match conn {
            Some(c) => self.send(&mut u, c),
            None if self.on_edge.load(Ordering::Relaxed) => return self.finish_on_edge(u),
            None => {}
        }
        self.unanswered.insert(u.prepared.id, u);
    }

    fn send(&mut self, u: &mut Unanswered, conn: &InferStream) {
        let traceparent = count_attempt(&mut self.counts, u);
        // A stream that is gone shows on its inbound side, which ends.
        conn.send(&u.prepared.frames, traceparent.as_deref());
    }

    /// Takes a whole answer; an error when the connection is of no more use (it answered
    /// UNAVAILABLE: the server is draining; or an id it was never sent).
    fn answered(&mut self, a: InferAnswer) -> Result<(), StreamError> {
        let Some(u) = self.unanswered.remove(&a.id) else {
            if self.outcomes.contains(&a.id) || self.at_edge.contains(&a.id) {
                self.counts.duplicates_dropped += 1;
                tracing::warn!(request_id = a.id, "an answer for a request that has its outcome: dropped");
                return Ok(());
            }
            return Err(StreamError::NeverSent(a.id));
        };
        if let Err(AnswerError::Refused { code: tonic::Code::Unavailable, message }) = a.output {
            self.unanswered.insert(a.id, u);
            return Err(StreamError::Draining(message));
        }
        let mut metrics = u.prepared.metrics;
        metrics.round_trip_ms = u.sent_at.map_or(0.0, ms);
        metrics.decode_ms = a.decode_ms;
        metrics.copied_received_bytes = a.copied_bytes;
        metrics.server = a.server.unwrap_or_default();
        if let Some(url) = &a.from {
            *self.counts.by_server.entry(url.to_string()).or_default() += 1;
        }
        metrics.server_url = a.from;
        metrics.e2e_ms = ms(u.prepared.started);
        self.record(RequestOutcome { request_id: a.id, metrics, output: a.output.map_err(RequestFailure::from) });
        Ok(())
    }

    /// The connection is gone: what it had not answered waits for the next one. After a
    /// connection that answered, the next is tried at once; one that answered nothing counts
    /// as a failed attempt (backoff, fallback, giving up: true when the run gives up).
    fn lost(&mut self, reason: StreamError, answered: bool, reconnect: &mut Reconnect, session: &ServerSession) -> bool {
        tracing::warn!(unanswered = self.unanswered.len(), "connection dropped: {reason}");
        for u in self.unanswered.values_mut() {
            u.sent_at = None;
            u.attempt = tracing::Span::none();
        }
        if answered {
            *reconnect = self.fresh_reconnect(Some(tokio::time::Instant::now()));
            return false;
        }
        let failure = ConnectFailure::AnsweredNothing(Box::new(reason));
        let error = HostError::from(LinkError::Connect { url: session.url.clone(), failure, attempts: 1 });
        self.connect_failed(&error, reconnect)
    }

    /// The prefix thread stopped (it failed, or every request is out): requests handed to it
    /// to finish on the edge will not be.
    fn prefix_thread_gone(&mut self) {
        let ids: Vec<u64> = self.at_edge.drain().collect();
        for id in ids {
            let output = Err(RequestFailure::EdgeStopped);
            self.record(RequestOutcome { request_id: id, metrics: RequestMetrics::default(), output });
        }
    }

    /// Resends, in id order, every request not answered on a connection just opened; one
    /// already sent `retry.max_attempts` times gets its outcome instead.
    fn resend(&mut self, conn: &InferStream) {
        let max = self.resilience.retry.max_attempts;
        let ids: Vec<u64> = self.unanswered.keys().copied().collect();
        for id in ids {
            let mut u = self.unanswered.remove(&id).expect("listed");
            if u.prepared.metrics.attempts >= max {
                let reason = format!("no answer after {max} sends (`retry.max_attempts`)");
                self.give_up(u, &reason);
                continue;
            }
            self.send(&mut u, conn);
            self.unanswered.insert(id, u);
        }
    }

    /// A connection attempt failed. With `fallback: edge` every waiting request goes to the
    /// edge (and new ones run there) while attempts go on; otherwise the run gives up after
    /// `retry.max_attempts` in a row, or at once when trying again cannot help: true when it
    /// does.
    fn connect_failed(&mut self, error: &HostError, reconnect: &mut Reconnect) -> bool {
        reconnect.attempts += 1;
        let max = self.resilience.retry.max_attempts;
        tracing::warn!(attempt = reconnect.attempts, of = max, %error, "cannot reach the server");
        if self.resilience.fallback == Fallback::Edge {
            self.on_edge.store(true, Ordering::Relaxed);
            for (_, u) in std::mem::take(&mut self.unanswered) {
                self.finish_on_edge(u);
            }
        } else if error.is_lasting() || reconnect.attempts >= max {
            let reason = if error.is_lasting() {
                error.to_string()
            } else {
                format!("no connection to the server answered in {max} attempts in a row (`retry.max_attempts`): {error}")
            };
            for (_, u) in std::mem::take(&mut self.unanswered) {
                self.give_up(u, &reason);
            }
            return true;
        }
        let wait = reconnect.backoff.next().unwrap_or(self.resilience.retry.max_backoff);
        reconnect.at = Some(tokio::time::Instant::now() + wait);
        false
    }

    /// Hands a request to the prefix thread, which runs its suffix on the edge.
    fn finish_on_edge(&mut self, u: Unanswered) {
        self.at_edge.insert(u.prepared.id);
        if let Err(std::sync::mpsc::SendError(ToPrefix::Finish(p))) = self.asks.send(ToPrefix::Finish(Box::new(u.prepared))) {
            self.at_edge.remove(&p.id);
            self.fail(*p, "the prefix thread stopped before it could finish this request on the edge");
        }
    }

    /// A request no server answered: finished on the edge with `fallback: edge`, otherwise
    /// an error outcome.
    fn give_up(&mut self, u: Unanswered, reason: &str) {
        if self.resilience.fallback == Fallback::Edge {
            return self.finish_on_edge(u);
        }
        self.fail(u.prepared, reason);
    }

    /// Ends the run early: every request sent and not answered gets `reason` as its outcome;
    /// the rest are not sent.
    fn stop_early(&mut self, reason: &str) {
        self.counts.stopped_early = true;
        for (_, u) in std::mem::take(&mut self.unanswered) {
            let metrics = RequestMetrics { e2e_ms: ms(u.prepared.started), ..u.prepared.metrics };
            self.record(RequestOutcome { request_id: u.prepared.id, metrics, output: Err(RequestFailure::Cancelled { reason: reason.to_string() }) });
        }
    }

    /// Records an error outcome for a request.
    fn fail(&mut self, p: Prepared, reason: &str) {
        let metrics = RequestMetrics { e2e_ms: ms(p.started), ..p.metrics };
        self.record(RequestOutcome { request_id: p.id, metrics, output: Err(RequestFailure::Unavailable { reason: reason.to_string() }) });
    }
}

/// Counts a send of `u` (its first or a resend) and opens its attempt's span; returns the
/// trace context it travels with.
fn count_attempt(counts: &mut StreamCounts, u: &mut Unanswered) -> Option<String> {
    if u.prepared.metrics.attempts == 0 {
        counts.sent += 1;
    } else {
        counts.retried += 1;
    }
    u.prepared.metrics.attempts += 1;
    u.sent_at = Some(Instant::now());
    u.attempt = tracing::debug_span!(parent: &u.prepared.span, "attempt", attempt = u.prepared.metrics.attempts);
    cleave_common::telemetry::traceparent(&u.attempt)
}

/// The next answer on the connection, if there is one (never resolves otherwise).
async fn next_answer(conn: &mut Option<InferStream>) -> Result<InferAnswer, StreamError> {
    match conn {
        Some(c) => c.next_answer().await,
        None => std::future::pending().await,
    }
}

/// The connection being opened, if one is (never resolves otherwise).
async fn opening(connecting: &mut Option<Connecting>) -> Result<(ServerSession, InferStream)> {
    match connecting {
        Some(f) => f.await,
        None => std::future::pending().await,
    }
}

async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
