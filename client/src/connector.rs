//! Connecting to a server, and again after a break, written once: a [`Connector`] tries its
//! servers in turn, waits a growing backoff after a failed pass, gives up after
//! `retry.max_attempts` failures in a row (at once for one that trying again cannot fix) and
//! keeps the count in a [`LinkHealth`] that whoever balances between servers reads.
//!
//! Every caller that connects again goes through it: [`connect_first`] and
//! [`connect_retrying`] (a run's first connection, a training or generation session continued
//! after a break) and the task behind each [`crate::server_link::ServerLink`], which also
//! counts a stream that broke before it answered anything as a failed attempt
//! ([`Connector::failed`]) and one that answered as a success ([`Connector::succeeded`]).
//! [`crate::connect`] is the one attempt each of them makes.

use std::sync::{Arc, Mutex};

use cleave_common::Bundle;
use tokio::sync::Notify;

use crate::error::LinkError;
use crate::link::{Backoff, Link, RetryPolicy};
use crate::session::{connect, ServerSession};

/// How a link to a server is doing, for the caller to tell when no server can be reached.
#[derive(Debug, Default)]
pub struct LinkHealth {
    state: Mutex<LinkState>,
}

/// A link's health at one moment.
#[derive(Debug, Default, Clone)]
pub struct LinkState {
    /// Whether the link takes requests now (its stream open, its model SERVING).
    pub ready: bool,
    /// Connection attempts in a row that failed (0 once one answers).
    pub failed_attempts: u32,
    /// Streams opened after the first.
    pub reconnects: u32,
    /// Why the last attempt failed.
    pub last_failure: Option<LinkFailure>,
    /// The link stopped trying: its server is unreachable.
    pub given_up: bool,
}

/// Why a link's last connection attempt failed.
#[derive(Debug, Clone)]
pub struct LinkFailure {
    /// The error, as it reads.
    pub message: String,
    /// Whether trying again cannot help (see [`LinkError::is_lasting`]).
    pub lasting: bool,
}

impl LinkHealth {
    /// The link's health now.
    pub fn now(&self) -> LinkState {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Changes the state and tells `changed`.
    pub(crate) fn update<T>(&self, changed: &Notify, change: impl FnOnce(&mut LinkState) -> T) -> T {
        let out = change(&mut self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        changed.notify_one();
        out
    }
}

/// Connects to the first of its servers that answers, again and again after a break, with
/// backoff between failed attempts.
#[derive(Debug)]
pub struct Connector {
    servers: Vec<String>,
    bundle: Bundle,
    link: Link,
    retry: RetryPolicy,
    /// Whether it stops once `retry.max_attempts` attempts in a row failed (a run with no
    /// other server to go to); otherwise it goes on, `max_backoff` apart: a server may come back.
    gives_up: bool,
    backoff: Backoff,
    /// Failed attempts in a row (counted as they were, even where one that cannot pass makes
    /// the health say `max_attempts`).
    attempts: u32,
    /// An attempt failed since the last success: the next one waits its backoff first.
    wait_first: bool,
    health: Arc<LinkHealth>,
    health_changed: Arc<Notify>,
}

impl Connector {
    /// A connector to the first of `servers` that serves `bundle`, reached over `link`, that
    /// gives up as `retry` says.
    pub fn new(servers: Vec<String>, bundle: Bundle, link: Link, retry: RetryPolicy) -> Self {
        let backoff = retry.backoff();
        let (health, health_changed) = (Arc::default(), Arc::default());
        Self { servers, bundle, link, retry, gives_up: true, backoff, attempts: 0, wait_first: false, health, health_changed }
    }

    /// Goes on trying after `retry.max_attempts` failures when `gives_up` is false.
    pub fn giving_up(mut self, gives_up: bool) -> Self {
        self.gives_up = gives_up;
        self
    }

    /// Keeps its count in `health`, and tells `changed` of each change.
    pub fn reporting(mut self, health: Arc<LinkHealth>, changed: Arc<Notify>) -> Self {
        (self.health, self.health_changed) = (health, changed);
        self
    }

    /// A connection to the first server that answers, tried in turn, the list again after a
    /// backoff when none does; the last error once it gives up (every server refused for a
    /// reason that stays, see [`LinkError::is_lasting`], or `retry.max_attempts` passes
    /// failed in a row). After a failure it waits its backoff before the first pass.
    pub async fn connect(&mut self) -> Result<ServerSession, LinkError> {
        if self.servers.is_empty() {
            return Err(LinkError::NoServer);
        }
        loop {
            if self.wait_first {
                // (Cleared once slept: a connect dropped while it waits waits again next time.)
                tokio::time::sleep(self.backoff.next().unwrap_or(self.retry.max_backoff)).await;
                self.wait_first = false;
            }
            let (error, lasting) = match self.pass().await {
                Ok(session) => return Ok(session),
                Err(failed) => failed,
            };
            if self.count_failure(&error, lasting) {
                return Err(match error {
                    LinkError::Connect { url, failure, .. } => LinkError::Connect { url, failure, attempts: self.attempts },
                    other => other,
                });
            }
            tracing::warn!(servers = %self.servers.join(", "), attempt = self.attempts, %error, "cannot reach the server; trying again after a backoff");
        }
    }

    /// A connection that was made failed anyway (its stream did not open, or broke before it
    /// answered anything): counted as a failed attempt, and the next [`Self::connect`] waits
    /// its backoff first. True when it gives up here.
    pub fn failed(&mut self, error: &LinkError) -> bool {
        tracing::warn!(servers = %self.servers.join(", "), %error, "a connection made failed before it answered");
        self.count_failure(error, error.is_lasting())
    }

    /// The server answered: failures are counted from none again, and the backoff starts over.
    pub fn succeeded(&mut self) {
        (self.attempts, self.wait_first, self.backoff) = (0, false, self.retry.backoff());
        self.health.update(&self.health_changed, |s| s.failed_attempts = 0);
    }

    /// Each server in turn: the first connection made, else the last error and whether every
    /// server refused for a reason that stays.
    async fn pass(&self) -> Result<ServerSession, (LinkError, bool)> {
        let mut last = None;
        let mut lasting = true;
        for url in &self.servers {
            match connect(url, &self.bundle, &self.link).await {
                Ok(session) => return Ok(session),
                Err(e) => {
                    lasting &= e.is_lasting();
                    last = Some(e);
                }
            }
        }
        Err((last.expect("one server or more was tried"), lasting))
    }

    /// Counts a failed attempt (one that cannot pass as `max_attempts` of them); true when it
    /// gives up here.
    fn count_failure(&mut self, error: &LinkError, lasting: bool) -> bool {
        self.attempts += 1;
        self.wait_first = true;
        let (max, gives_up) = (self.retry.max_attempts.max(1), self.gives_up);
        self.health.update(&self.health_changed, |s| {
            s.failed_attempts = if lasting { s.failed_attempts.max(max) } else { s.failed_attempts + 1 };
            s.last_failure = Some(LinkFailure { message: error.to_string(), lasting });
            s.given_up = gives_up && s.failed_attempts >= max;
            s.given_up
        })
    }
}

/// [`connect`], tried up to `retry.max_attempts` times with exponential backoff and jitter
/// between attempts (a caller started while its server is down, or restarting, waits for it):
/// [`connect_first`] over a list of one.
pub async fn connect_retrying(url: &str, bundle: &Bundle, link: &Link, retry: &RetryPolicy) -> Result<ServerSession, LinkError> {
    connect_first(&[url.to_string()], bundle, link, retry).await
}

/// A connection to the first of `servers` that answers, tried in turn, the whole list up to
/// `retry.max_attempts` times with backoff between passes; the last error when none answers,
/// at once when every server refused for a reason that stays (see [`LinkError::is_lasting`]:
/// a server that answers and refuses this caller, or one unreachable for good). A
/// [`Connector`] that gives up, used once.
pub async fn connect_first(servers: &[String], bundle: &Bundle, link: &Link, retry: &RetryPolicy) -> Result<ServerSession, LinkError> {
    Connector::new(servers.to_vec(), bundle.clone(), link.clone(), *retry).connect().await
}
