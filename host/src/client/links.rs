//! The streaming loop over the run's servers: one link each ([`ServerLink`], which owns the
//! server's connection and stream), every request to the less loaded of two ready servers
//! picked at random (tower's p2c balancer over the requests each has outstanding; a run over
//! one server has one link). A request whose stream is lost before it answers is sent again
//! under the same id, on whichever server is ready (the same one, reconnected, when it is the
//! only one), so every request has one outcome; each server's window answers a repeat it has
//! already computed. The list of servers may change while the run goes (a DNS name resolved
//! again): a server added gets requests, one removed gets no more and answers those it holds.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::FuturesUnordered;
use tokio::sync::{mpsc, watch, Notify};
use tokio_stream::StreamExt;
use tower::balance::p2c::Balance;
use tower::discover::Change;
use tower::load::{CompleteOnResponse, PendingRequests};
use tower::Service;

use cleave_client::server_link::{Delivered, Dispatch, LinkSetup, ServerLink};
use cleave_client::ServerSession;
use cleave_client::{LinkHealth, LinkState};

use super::prefix::Produced;
use super::{Run, StreamCounts, Unanswered, SAME_LASTING_ERRORS_TO_STOP};
use crate::config::{Fallback, MAX_SERVERS};
use crate::error::Result;

/// How often the loop looks at its links' health besides when one changes (a list of
/// servers left empty has no link to tell).
const REACHABLE_CHECK: Duration = Duration::from_millis(200);

type Discovered = std::result::Result<Change<Arc<str>, PendingRequests<ServerLink>>, std::convert::Infallible>;

impl<F: FnMut(super::RequestOutcome)> Run<F> {
    /// Streams every request over the servers `servers` lists as it changes (`session` is
    /// the connection to one of them). With `gives_up`, a link stops once its server cannot be
    /// reached (the run has no other server to go to).
    pub(super) async fn stream(
        mut self,
        session: &ServerSession,
        mut servers: watch::Receiver<Vec<String>>,
        gives_up: bool,
        mut produced: mpsc::UnboundedReceiver<Produced>,
    ) -> Result<StreamCounts> {
        // One list's changes at most wait in the channel: the balancer takes them at once.
        let (changes, discovered) = mpsc::channel::<Discovered>(2 * MAX_SERVERS);
        let mut balance = Balance::new(tokio_stream::wrappers::ReceiverStream::new(discovered));
        let health_changed = Arc::new(Notify::new());
        let setup = self.link_setup(session, gives_up, Arc::clone(&health_changed));
        let mut links = Links { setup, first: Some(session.clone()), changes, health: BTreeMap::new() };
        links.update(&servers.borrow_and_update());
        take_changes(&mut balance);
        let mut listed = true;
        let mut waiting = BTreeSet::new();
        let mut in_flight = FuturesUnordered::new();
        let mut produced_open = true;
        let mut reachable_check = tokio::time::interval(REACHABLE_CHECK);
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
                    None => {
                        produced_open = false;
                        self.prefix_thread_gone();
                    }
                    Some(Produced::Local(outcome)) => self.record(outcome),
                    Some(Produced::Remote(prepared)) => {
                        let id = prepared.id;
                        self.unanswered.insert(id, Unanswered { prepared, sent_at: None, attempt: tracing::Span::none() });
                        self.lose(id, &mut waiting);
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
                () = health_changed.notified() => if self.on_health(&links.health, &mut waiting) { break },
                _ = reachable_check.tick() => if self.on_health(&links.health, &mut waiting) { break },
            }
        }
        self.counts.reconnects = links.health.values().map(|l| u64::from(l.now().reconnects)).sum();
        drop(links);
        self.counts.never_sent = (self.total - self.outcomes.len()) as u64;
        Ok(self.counts)
    }

    /// What every server's link is made with.
    fn link_setup(&self, session: &ServerSession, gives_up: bool, health_changed: Arc<Notify>) -> Arc<LinkSetup> {
        Arc::new(LinkSetup {
            bundle: self.bundle.clone(),
            link: session.link.clone(),
            stream: self.setup.clone(),
            retry: self.resilience.retry,
            gives_up,
            health_changed,
            request_timeout: self.resilience.request_timeout,
            in_flight: self.in_flight,
        })
    }

    /// Whether the run is over: every request has its outcome, or none is left to send, or
    /// its first outcomes were one lasting error (the rest are then not sent).
    fn finished(&mut self, produced_open: bool) -> bool {
        if self.outcomes.len() == self.total || (!produced_open && self.unanswered.is_empty() && self.at_edge.is_empty()) {
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

    /// Looks at the links' health: with `fallback: edge`, requests run on the edge while no
    /// server takes them and the last attempt failed, and go back to the split once one does.
    /// Otherwise, once no server can be reached, every request not answered gets that as its
    /// outcome: true, and the run stops there.
    fn on_health(&mut self, links: &BTreeMap<String, Arc<LinkHealth>>, waiting: &mut BTreeSet<u64>) -> bool {
        let states: Vec<LinkState> = links.values().map(|l| l.now()).collect();
        let ready = states.iter().any(|s| s.ready);
        if self.resilience.fallback == Fallback::Edge {
            let failing = !ready && states.iter().any(|s| s.failed_attempts > 0);
            self.on_edge.store(failing, Ordering::Relaxed);
            if failing {
                for id in std::mem::take(waiting) {
                    let u = self.unanswered.remove(&id).expect("a waiting request is unanswered");
                    self.finish_on_edge(u);
                }
            }
            return false;
        }
        let Some(reason) = self.unreachable(&states) else { return false };
        tracing::error!("{reason}: the run stops");
        waiting.clear();
        for (_, u) in std::mem::take(&mut self.unanswered) {
            self.give_up(u, &reason);
        }
        true
    }

    /// Why no server can be reached, if none can: none takes requests, and each has failed
    /// `retry.max_attempts` connection attempts in a row (or one for a reason that stays).
    fn unreachable(&self, states: &[LinkState]) -> Option<String> {
        let max = self.resilience.retry.max_attempts;
        if states.iter().any(|s| s.ready || (!s.given_up && s.failed_attempts < max)) {
            return None;
        }
        Some(match states {
            [one] => match &one.last_failure {
                Some(f) if f.lasting => f.message.clone(),
                last => {
                    let why = last.as_ref().map_or("", |f| f.message.as_str());
                    format!("no connection to the server answered in {max} attempts in a row (`retry.max_attempts`): {why}")
                }
            },
            many => format!("none of the {} servers answered in {max} connection attempts in a row (`retry.max_attempts`)", many.len()),
        })
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

    /// A request not on a stream (new, or its stream was lost before it answered) waits to be
    /// sent; while requests run on the edge (`fallback: edge`), it runs there.
    fn lose(&mut self, id: u64, waiting: &mut BTreeSet<u64>) {
        if self.on_edge.load(Ordering::Relaxed) {
            if let Some(u) = self.unanswered.remove(&id) {
                self.finish_on_edge(u);
            }
            return;
        }
        if let Some(u) = self.unanswered.get_mut(&id) {
            u.sent_at = None;
            u.attempt = tracing::Span::none();
            waiting.insert(id);
        }
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
