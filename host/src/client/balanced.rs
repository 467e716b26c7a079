//! The streaming loop over several servers: each request goes to the less loaded of two
//! ready servers picked at random (tower's p2c balancer over the requests each has
//! outstanding), one stream per server ([`super::servers`]). A request whose server is lost
//! before it answers goes to another under the same id, so every request has one outcome;
//! each server's window answers a repeat it has already computed. The list of servers may
//! change while the run goes (a DNS name resolved again): a server added gets requests, one
//! removed gets no more and answers those it holds.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::stream::FuturesUnordered;
use tokio::sync::{mpsc, watch};
use tokio_stream::StreamExt;
use tower::balance::p2c::Balance;
use tower::discover::Change;
use tower::load::{CompleteOnResponse, PendingRequests};
use tower::Service;

use cleave_client::server_link::{Delivered, Dispatch, LinkHealth, LinkSetup, ServerLink};
use cleave_client::ServerSession;

use super::prefix::Produced;
use super::{Run, StreamCounts, SAME_LASTING_ERRORS_TO_STOP};
use crate::config::MAX_SERVERS;
use crate::error::Result;

/// How often the loop checks whether any server can still be reached.
const REACHABLE_CHECK: Duration = Duration::from_millis(200);

type Discovered = std::result::Result<Change<Arc<str>, PendingRequests<ServerLink>>, std::convert::Infallible>;

impl<F: FnMut(super::RequestOutcome)> Run<F> {
    /// Streams every request over the servers `servers` lists as it changes (`session` is
    /// the connection to one of them).
    pub(super) async fn stream_balanced(
        mut self,
        session: &ServerSession,
        mut servers: watch::Receiver<Vec<String>>,
        mut produced: mpsc::UnboundedReceiver<Produced>,
    ) -> Result<StreamCounts> {
        // One list's changes at most wait in the channel: the balancer takes them at once.
        let (changes, discovered) = mpsc::channel::<Discovered>(2 * MAX_SERVERS);
        let mut balance = Balance::new(tokio_stream::wrappers::ReceiverStream::new(discovered));
        let mut links = Links { setup: self.link_setup(session), first: Some(session.clone()), changes, health: BTreeMap::new() };
        links.update(&servers.borrow_and_update());
        take_changes(&mut balance);
        let mut listed = true;
        let mut waiting = BTreeSet::new();
        let mut in_flight = FuturesUnordered::new();
        let mut produced_open = true;
        let mut reachable_check = tokio::time::interval(REACHABLE_CHECK);
        let mut none_ready_since: Option<Instant> = None;
        while !self.finished(produced_open) {
            tokio::select! {
                changed = servers.changed(), if listed => match changed {
                    Ok(()) => {
                        links.update(&servers.borrow_and_update());
                        take_changes(&mut balance);
                    }
                    Err(_) => listed = false,
                },
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
                Some((id, delivered)) = in_flight.next() => self.delivered(id, delivered, &mut waiting),
                _ = reachable_check.tick() => {
                    let none_ready = !links.health.values().any(|l| l.ready.load(Ordering::Relaxed));
                    let since = if none_ready { *none_ready_since.get_or_insert_with(Instant::now) } else { Instant::now() };
                    none_ready_since = none_ready.then_some(since);
                    if let Some(reason) = self.no_server_takes_requests(&links.health, since.elapsed()) {
                        self.give_up_waiting(&mut waiting, &reason);
                    }
                }
            }
        }
        self.counts.reconnects = links.health.values().map(|l| u64::from(l.reconnects.load(Ordering::Relaxed))).sum();
        drop(links);
        self.counts.never_sent = (self.total - self.outcomes.len()) as u64;
        Ok(self.counts)
    }

    /// What every server's link is made with.
    fn link_setup(&self, session: &ServerSession) -> Arc<LinkSetup> {
        Arc::new(LinkSetup {
            bundle: self.bundle.clone(),
            link: session.link.clone(),
            stream: self.setup.clone(),
            retry: self.resilience.retry,
            request_timeout: self.resilience.request_timeout,
            in_flight: self.in_flight,
        })
    }

    /// Whether the run is over: every request has its outcome, or none is left to send, or
    /// its first outcomes were one lasting error (the rest are then not sent).
    fn finished(&mut self, produced_open: bool) -> bool {
        if self.outcomes.len() == self.total || (!produced_open && self.unanswered.is_empty()) {
            return true;
        }
        let Some(error) = self.first_outcomes.stop_on() else { return false };
        tracing::error!("the first {SAME_LASTING_ERRORS_TO_STOP} requests all failed with {error}: the rest are not sent");
        self.stop_early(&format!("the run stopped after its first {SAME_LASTING_ERRORS_TO_STOP} requests failed alike"));
        true
    }

    /// What became of request `id` on its server: its outcome, or it waits to be sent again.
    fn delivered(&mut self, id: u64, delivered: std::result::Result<Delivered, tower::BoxError>, waiting: &mut BTreeSet<u64>) {
        match delivered {
            Ok(Delivered::Answer { server, answer }) => {
                if let Err(e) = self.answered(answer) {
                    tracing::warn!(%server, request_id = id, "{e}: sent again");
                    self.lose(id, waiting);
                }
            }
            Ok(Delivered::Lost { server, reason }) => {
                tracing::debug!(%server, request_id = id, %reason, "request lost with its stream");
                self.lose(id, waiting);
            }
            Err(e) => {
                tracing::warn!(request_id = id, "{e}");
                self.lose(id, waiting);
            }
        }
    }

    /// Every request waiting for a server gets `reason` as its outcome.
    fn give_up_waiting(&mut self, waiting: &mut BTreeSet<u64>, reason: &str) {
        for id in std::mem::take(waiting) {
            if let Some(u) = self.unanswered.remove(&id) {
                self.give_up(u, reason);
            }
        }
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
        let traceparent = super::count_attempt(&mut self.counts, u);
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

    /// Why no server will take the waiting requests, if none will: every server has failed
    /// `retry.max_attempts` connection attempts in a row, or none has taken requests (its
    /// stream open, its model SERVING) for `request_timeout`, `none_ready` so far.
    fn no_server_takes_requests(&self, links: &BTreeMap<String, Arc<LinkHealth>>, none_ready: Duration) -> Option<String> {
        let (max, timeout) = (self.resilience.retry.max_attempts, self.resilience.request_timeout);
        let ready = links.values().any(|l| l.ready.load(Ordering::Relaxed));
        if !ready && links.values().all(|l| l.failed_attempts.load(Ordering::Relaxed) >= max) {
            return Some(format!("none of the {} servers answered in {max} connection attempts in a row (`retry.max_attempts`)", links.len()));
        }
        (!ready && none_ready >= timeout)
            .then(|| format!("none of the {} servers took requests for {timeout:?} (`request_timeout`): unreachable or not SERVING", links.len()))
    }
}

/// The servers of the run, each with its link, told to the balancer as they come and go.
struct Links {
    setup: Arc<LinkSetup>,
    /// The caller's connection, for the link to its server.
    first: Option<ServerSession>,
    changes: mpsc::Sender<Discovered>,
    health: BTreeMap<String, Arc<LinkHealth>>,
}

impl Links {
    /// Links to the servers `listed` adds (up to [`MAX_SERVERS`]); those it no longer has are
    /// removed (they answer what they hold).
    fn update(&mut self, listed: &[String]) {
        if listed.len() > MAX_SERVERS {
            tracing::warn!(listed = listed.len(), "more servers than a run takes (`MAX_SERVERS`): the first {MAX_SERVERS} are used");
        }
        let listed: BTreeSet<&String> = listed.iter().take(MAX_SERVERS).collect();
        let gone: Vec<String> = self.health.keys().filter(|url| !listed.contains(url)).cloned().collect();
        for url in gone {
            tracing::info!(server = %url, "the server left the list: it is given no more requests");
            self.health.remove(&url);
            let _ = self.changes.try_send(Ok(Change::Remove(url.as_str().into())));
        }
        for url in listed {
            if self.health.contains_key(url) {
                continue;
            }
            let first = self.first.take_if(|s| s.url == *url);
            let (link, health) = ServerLink::spawn(url, first, Arc::clone(&self.setup));
            let _ = self.changes.try_send(Ok(Change::Insert(url.as_str().into(), PendingRequests::new(link, CompleteOnResponse::default()))));
            self.health.insert(url.clone(), health);
        }
    }
}

/// Lets the balancer take the changes waiting in its channel now (polling it for readiness
/// reads every change first), so that they never fill it.
fn take_changes<S: Service<Dispatch>>(balance: &mut S) {
    let waker = std::task::Waker::noop();
    let _ = balance.poll_ready(&mut std::task::Context::from_waker(waker));
}
