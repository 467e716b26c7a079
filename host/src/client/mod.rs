//! The streaming client: runs the prefix of each request on its own thread ([`prefix`]),
//! streams the boundaries to the server and collects the results, with up to `in_flight`
//! requests travelling at once (the prefix of request i+1 runs while request i is on the
//! wire or on the server).
//!
//! Each server is reached through its one link ([`cleave_client::server_link`]), which owns
//! its connection and stream; the run keeps every request until it has its one outcome
//! ([`links`]):
//! - A stream that ends, fails, carries garbage, answers UNAVAILABLE (a server draining) or
//!   leaves a request unanswered past `request_timeout` is dropped whole, and its link
//!   reconnects after exponential backoff with jitter (`retry:`).
//! - Every request it had not answered is sent again, as it was encoded, in order, under the
//!   same id and the host's session id: one the server computed before is answered from its
//!   window of recent results rather than computed again.
//! - An id gets exactly one outcome: an answer for an id already answered is dropped (and
//!   counted). A request sent `retry.max_attempts` times gets an error, and the run stops once
//!   its server (every server) fails `retry.max_attempts` connection attempts in a row, or
//!   once for a reason that stays, unless `fallback: edge` runs requests on the edge
//!   meanwhile.
//! - A run whose first [`SAME_LASTING_ERRORS_TO_STOP`] outcomes are one error that sending
//!   again cannot fix (a wrong key, a refused input) stops there rather than send the rest.

pub mod dns;
mod links;
mod prefix;
mod request;

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use cleave_client::{AnswerError, InferAnswer, InferSetup, ServerSession, StreamError};
use cleave_common::{Boundary, Bundle};
use tokio::sync::mpsc;

pub use self::request::{ChoosesCodec, Codecs, RequestMetrics, RequestOutcome, ServedBy, Splits, StreamCounts, StreamPlan};
pub use cleave_client::ServerTimes;

use self::prefix::{run_prefixes, PrefixChannels, Prepared, ToPrefix};
use self::request::ms;
use crate::config::{Fallback, Resilience};
use crate::error::{HostError, RequestFailure, Result};

/// Sends every request and calls `on_outcome` exactly once per request id, in the order the
/// outcomes come, reconnecting as `plan.resilience` says. Results are framed by the server's
/// message limit and accepted up to its payload limit. `session` is the first connection to
/// the server; the run's link to it reconnects as it must.
pub async fn stream_requests(session: &ServerSession, plan: StreamPlan, on_outcome: impl FnMut(RequestOutcome)) -> Result<StreamCounts> {
    stream_to(session, None, plan, on_outcome).await
}

/// As [`stream_requests`], over every server `servers` lists as the list changes (`session`,
/// connected to one of them, gives the limits), each request to the less loaded of two
/// picked at random; a request whose server is lost goes to another. `fallback: edge` is not
/// offered here.
pub async fn stream_balanced(
    session: &ServerSession,
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
    session: &ServerSession,
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
    let sender = setup.sender()?;
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
        Some(servers) => run.stream(session, servers, false, produced).await,
        None => {
            // One server, and no other to go to: its link gives up when it cannot be reached,
            // unless requests run on the edge meanwhile.
            let gives_up = run.resilience.fallback != Fallback::Edge;
            run.stream(session, tokio::sync::watch::channel(vec![session.url.clone()]).1, gives_up, produced).await
        }
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

impl<F: FnMut(RequestOutcome)> Run<F> {
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

    /// The prefix thread stopped (it failed, or every request is out): requests handed to it
    /// to finish on the edge will not be.
    fn prefix_thread_gone(&mut self) {
        let ids: Vec<u64> = self.at_edge.drain().collect();
        for id in ids {
            let output = Err(RequestFailure::EdgeStopped);
            self.record(RequestOutcome { request_id: id, metrics: RequestMetrics::default(), output });
        }
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
