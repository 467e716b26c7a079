//! The streaming loop over several servers: each request goes to the less loaded of two
//! ready servers picked at random (tower's p2c balancer over the requests each has
//! outstanding), one stream per server ([`super::servers`]). A request whose server is lost
//! before it answers goes to another under the same id, so every request has one outcome;
//! each server's window answers a repeat it has already computed.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::stream::FuturesUnordered;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tower::balance::p2c::Balance;
use tower::discover::Change;
use tower::load::{CompleteOnResponse, PendingRequests};
use tower::Service;

use super::prefix::Produced;
use super::servers::{Delivered, Dispatch, LinkHealth, LinkSetup, ServerLink};
use super::{Run, StreamCounts, SAME_LASTING_ERRORS_TO_STOP};
use crate::error::Result;
use crate::session::EdgeSession;

/// How often the loop checks whether any server can still be reached.
const REACHABLE_CHECK: Duration = Duration::from_millis(200);

type Discovered = std::result::Result<Change<Arc<str>, PendingRequests<ServerLink>>, std::convert::Infallible>;

impl<F: FnMut(super::RequestOutcome)> Run<F> {
    /// Streams every request over `servers` (`session` is the connection to one of them).
    pub(super) async fn stream_balanced(
        mut self,
        session: &EdgeSession,
        servers: &[String],
        mut produced: mpsc::UnboundedReceiver<Produced>,
    ) -> Result<StreamCounts> {
        let setup = Arc::new(LinkSetup {
            bundle: self.bundle.clone(),
            link: session.link.clone(),
            codecs: self.codecs.clone(),
            key_id: self.key_id,
            ring: self.ring.clone(),
            host_session: self.host_session.clone(),
            resilience: self.resilience,
            in_flight: self.in_flight,
        });
        let (changes, discovered) = mpsc::channel::<Discovered>(servers.len());
        let mut links = Vec::new();
        for url in servers {
            let first = (*url == session.url).then(|| session.clone());
            let (link, health) = ServerLink::spawn(url, first, Arc::clone(&setup));
            let _ = changes.try_send(Ok(Change::Insert(url.as_str().into(), PendingRequests::new(link, CompleteOnResponse::default()))));
            links.push(health);
        }
        let mut balance = Balance::new(tokio_stream::wrappers::ReceiverStream::new(discovered));
        let mut waiting = BTreeSet::new();
        let mut in_flight = FuturesUnordered::new();
        let mut produced_open = true;
        let mut reachable_check = tokio::time::interval(REACHABLE_CHECK);
        loop {
            if self.outcomes.len() == self.total || (!produced_open && self.unanswered.is_empty()) {
                break;
            }
            if let Some(error) = self.first_outcomes.stop_on() {
                tracing::error!("the first {SAME_LASTING_ERRORS_TO_STOP} requests all failed with {error}: the rest are not sent");
                self.stop_early(&format!("the run stopped after its first {SAME_LASTING_ERRORS_TO_STOP} requests failed alike"));
                break;
            }
            tokio::select! {
                p = produced.recv(), if produced_open => match p {
                    None => produced_open = false,
                    Some(Produced::Local(outcome)) => self.record(outcome),
                    Some(Produced::Remote(prepared)) => {
                        waiting.insert(prepared.id);
                        self.unanswered.insert(prepared.id, super::Unanswered { prepared, sent_at: None, attempt: tracing::Span::none() });
                    }
                },
                ready = std::future::poll_fn(|cx| balance.poll_ready(cx)), if !waiting.is_empty() => {
                    // The servers are discovered through a channel, which cannot fail.
                    ready.expect("discovery over a channel cannot fail");
                    let id = waiting.pop_first().expect("not empty");
                    if let Some(dispatch) = self.dispatch(id) {
                        let delivered = balance.call(dispatch);
                        in_flight.push(async move { (id, delivered.await) });
                    }
                }
                Some((id, delivered)) = in_flight.next() => match delivered {
                    Ok(Delivered::Answer { server, answer }) => {
                        let first = !self.outcomes.contains(&id);
                        match self.answered(answer) {
                            Err(e) => {
                                tracing::warn!(%server, request_id = id, "{e}: sent again");
                                self.lose(id, &mut waiting);
                            }
                            Ok(()) if first => *self.counts.by_server.entry(server.to_string()).or_default() += 1,
                            Ok(()) => {}
                        }
                    }
                    Ok(Delivered::Lost { server, reason }) => {
                        tracing::debug!(%server, request_id = id, %reason, "request lost with its stream");
                        self.lose(id, &mut waiting);
                    }
                    Err(e) => {
                        tracing::warn!(request_id = id, "{e}");
                        self.lose(id, &mut waiting);
                    }
                },
                _ = reachable_check.tick() => {
                    if self.no_server_reachable(&links) {
                        let max = self.resilience.retry.max_attempts;
                        let reason = format!("none of the {} servers answered in {max} connection attempts in a row (`retry.max_attempts`)", links.len());
                        for id in std::mem::take(&mut waiting) {
                            if let Some(u) = self.unanswered.remove(&id) {
                                self.give_up(u, &reason);
                            }
                        }
                    }
                }
            }
        }
        drop(changes);
        self.counts.never_sent = (self.total - self.outcomes.len()) as u64;
        Ok(self.counts)
    }

    /// The request `id` to send (counted as sent again if it was before), or none when it has
    /// been sent `retry.max_attempts` times: it then gets its outcome.
    fn dispatch(&mut self, id: u64) -> Option<Dispatch> {
        let max = self.resilience.retry.max_attempts;
        let u = self.unanswered.get_mut(&id)?;
        if u.prepared.metrics.attempts >= max {
            let u = self.unanswered.remove(&id).expect("just found");
            self.give_up(u, &format!("no answer after {max} sends (`retry.max_attempts`)"));
            return None;
        }
        let u = self.unanswered.get_mut(&id).expect("just found");
        let traceparent = count_attempt(&mut self.counts, u);
        Some(Dispatch { id, frames: u.prepared.frames.clone(), traceparent })
    }

    /// A request whose server was lost before it answered waits to be sent again.
    fn lose(&mut self, id: u64, waiting: &mut BTreeSet<u64>) {
        if let Some(u) = self.unanswered.get_mut(&id) {
            u.sent_at = None;
            u.attempt = tracing::Span::none();
            waiting.insert(id);
        }
    }

    /// Whether every server has failed `retry.max_attempts` connection attempts in a row.
    fn no_server_reachable(&self, links: &[Arc<LinkHealth>]) -> bool {
        let max = self.resilience.retry.max_attempts;
        links.iter().all(|l| l.failed_attempts.load(Ordering::Relaxed) >= max)
    }
}

/// Counts a send of `u` (its first or a resend) and opens its attempt's span; returns the
/// trace context it travels with.
pub(super) fn count_attempt(counts: &mut StreamCounts, u: &mut super::Unanswered) -> Option<String> {
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
