//! How to reach a server ([`Link`]) and how to try again ([`RetryPolicy`]).

use std::time::Duration;

use cleave_common::security::{ClientTls, EdgeSecurity, Token};
use cleave_common::wire::Key;

/// How to reach a server: TLS trust, bearer token, the payload key, and how long to wait.
#[derive(Debug, Clone)]
pub struct Link {
    /// TLS trust (the URL must then be https://).
    pub tls: Option<ClientTls>,
    /// Bearer token sent with every call.
    pub token: Option<Token>,
    /// The key id and key generation steps are sealed with (plaintext where absent).
    pub key: Option<(u32, Key)>,
    /// Opening the connection and its `Info` call.
    pub connect_timeout: Duration,
    /// HTTP/2 PING interval, and how long a PING may go unanswered before the connection is
    /// taken for broken: a server that stops answering is noticed even between requests.
    pub keepalive: (Duration, Duration),
    /// How long an answer may take (`request_timeout`): a server that keeps the connection
    /// alive but never answers is left, as one that went away.
    pub request_timeout: Duration,
    /// The local address connections leave from (the system's choice where absent): an edge
    /// with several interfaces picks the one its traffic goes out on.
    pub local_address: Option<std::net::IpAddr>,
}

impl Default for Link {
    /// Plaintext, no token; 5 s to connect, 30 s for an answer, a PING every 10 s answered
    /// within 10 s (edge.yaml's defaults).
    fn default() -> Self {
        Self {
            tls: None,
            token: None,
            key: None,
            connect_timeout: Duration::from_secs(5),
            keepalive: (Duration::from_secs(10), Duration::from_secs(10)),
            request_timeout: Duration::from_secs(30),
            local_address: None,
        }
    }
}

impl Link {
    /// Plaintext, no token.
    pub fn plain() -> Self {
        Self::default()
    }

    /// With the TLS trust, token and key of `security`, and the default timeouts.
    pub fn secured(security: &EdgeSecurity) -> Self {
        Self { tls: security.tls.clone(), token: security.token.clone(), key: security.key.clone(), ..Self::default() }
    }

    /// Servers reached by address (the addresses a name resolves to) are checked against the
    /// name in `url` when the TLS trust names no `domain` of its own.
    pub fn checking_name_of(mut self, url: &str) -> Self {
        if let Some(tls) = &mut self.tls {
            tls.domain = tls.domain.take().or_else(|| url_host(url));
        }
        self
    }
}

/// The host of `url` (`https://name:port/` gives `name`).
fn url_host(url: &str) -> Option<String> {
    let authority = url.split_once("://")?.1.split('/').next()?;
    let host = match authority.rsplit_once(':') {
        Some((host, port)) if port.parse::<u16>().is_ok() => host,
        _ => authority,
    };
    Some(host.trim_start_matches('[').trim_end_matches(']').to_string())
}

/// `retry:` in edge.yaml: reconnect after exponential backoff with jitter, from 100 ms up to
/// `max_backoff`; a request is sent at most `max_attempts` times, and a run gives up after
/// `max_attempts` connection attempts in a row fail or answer nothing (with the defaults, a
/// server down for about 20 s or more).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Sends of one request, and connection attempts in a row, before giving up.
    pub max_attempts: u32,
    /// The longest wait between two connection attempts.
    pub max_backoff: Duration,
}

impl RetryPolicy {
    /// The waits between connection attempts: from 100 ms, doubling with jitter, up to
    /// `max_backoff`, without end.
    pub fn backoff(&self) -> Backoff {
        use backon::BackoffBuilder;
        let waits = backon::ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(100).min(self.max_backoff))
            .with_max_delay(self.max_backoff)
            .with_jitter()
            .without_max_times()
            .build();
        Backoff { waits, max: self.max_backoff }
    }

    /// Runs `call` on a session that lives on the server (training, generation) and goes on
    /// over a new connection when its link breaks: when `call` fails with an error that
    /// `resumable` says a new connection can mend, `resume` continues the session on one and
    /// `call` is sent again, at most `max_attempts` sends in all. A `resume` that fails for
    /// such a reason is tried again after a backoff, each try counted as a send.
    pub async fn resuming<S, T, E: std::fmt::Display>(
        &self,
        session: &mut S,
        resumable: impl Fn(&E) -> bool,
        mut call: impl AsyncFnMut(&mut S) -> Result<T, E>,
        mut resume: impl AsyncFnMut(&mut S) -> Result<(), E>,
    ) -> Result<T, E> {
        let mut backoff = self.backoff();
        let mut attempts = 1;
        loop {
            let mut error = match call(session).await {
                Err(e) if resumable(&e) && attempts < self.max_attempts => e,
                done => return done,
            };
            loop {
                attempts += 1;
                tracing::warn!(%error, attempt = attempts, of = self.max_attempts, "the link broke: continuing the session on a new connection");
                match resume(session).await {
                    Ok(()) => break,
                    Err(e) if resumable(&e) && attempts < self.max_attempts => {
                        error = e;
                        tokio::time::sleep(backoff.next().unwrap_or(self.max_backoff)).await;
                    }
                    Err(e) => return Err(e),
                }
            }
        }
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self { max_attempts: 10, max_backoff: Duration::from_secs(5) }
    }
}

/// The waits of a [`RetryPolicy`], never longer than its `max_backoff` (backon's jitter adds
/// up to one more delay on top of its maximum).
#[derive(Debug)]
pub struct Backoff {
    waits: backon::ExponentialBackoff,
    max: Duration,
}

impl Iterator for Backoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        Some(self.waits.next().unwrap_or(self.max).min(self.max))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_of_a_url_is_its_name_without_port_or_brackets() {
        assert_eq!(url_host("https://gpu.example:50051/").as_deref(), Some("gpu.example"));
        assert_eq!(url_host("https://gpu.example").as_deref(), Some("gpu.example"));
        assert_eq!(url_host("https://[::1]:50051").as_deref(), Some("::1"));
        assert_eq!(url_host("gpu.example:50051"), None);
    }

    /// A session whose link breaks `breaks` times, and whose resumes fail `resume_fails` times.
    #[derive(Default)]
    struct Session {
        breaks: u32,
        resume_fails: u32,
        sends: u32,
        resumes: u32,
    }

    fn run(retry: RetryPolicy, session: &mut Session, lasting_resume: bool) -> Result<u32, String> {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        let resumable = |e: &String| e.starts_with("lost");
        let call = async |s: &mut Session| {
            s.sends += 1;
            if s.breaks > 0 {
                s.breaks -= 1;
                return Err("lost: the stream broke".to_string());
            }
            Ok(s.sends)
        };
        let resume = async |s: &mut Session| {
            s.resumes += 1;
            match s.resume_fails {
                0 => Ok(()),
                _ if lasting_resume => Err("refused: another bundle".to_string()),
                _ => {
                    s.resume_fails -= 1;
                    Err("lost: no server".to_string())
                }
            }
        };
        runtime.block_on(retry.resuming(session, resumable, call, resume))
    }

    #[test]
    fn a_session_is_resumed_and_its_call_sent_again_at_most_max_attempts_sends_in_all() {
        let retry = RetryPolicy { max_attempts: 4, max_backoff: Duration::from_millis(1) };
        let mut s = Session { breaks: 2, ..Session::default() };
        assert_eq!(run(retry, &mut s, false), Ok(3), "answered on the third send");
        assert_eq!((s.sends, s.resumes), (3, 2));
        // A resume that fails for a reason a new connection can mend counts as a send.
        let mut s = Session { breaks: 1, resume_fails: 1, ..Session::default() };
        assert_eq!(run(retry, &mut s, false), Ok(2));
        assert_eq!((s.sends, s.resumes), (2, 2));
        let mut s = Session { breaks: 10, ..Session::default() };
        assert_eq!(run(retry, &mut s, false), Err("lost: the stream broke".to_string()));
        assert_eq!((s.sends, s.resumes), (4, 3), "4 sends, the last error returned");
        let mut s = Session { breaks: 1, resume_fails: 10, ..Session::default() };
        assert_eq!(run(retry, &mut s, false), Err("lost: no server".to_string()));
        assert_eq!((s.sends, s.resumes), (1, 3), "every resume counted");
        // One that a new connection cannot mend ends it at once.
        let mut s = Session { breaks: 1, resume_fails: 1, ..Session::default() };
        assert_eq!(run(retry, &mut s, true), Err("refused: another bundle".to_string()));
        assert_eq!((s.sends, s.resumes), (1, 1));
    }

    #[test]
    fn backoff_waits_never_exceed_max_backoff_jitter_included() {
        let retry = RetryPolicy { max_attempts: 10, max_backoff: Duration::from_secs(5) };
        let waits: Vec<Duration> = retry.backoff().take(200).collect();
        assert!(waits.iter().all(|w| *w <= retry.max_backoff), "{waits:?}");
        assert!(waits[0] >= Duration::from_millis(100) && waits[0] < Duration::from_millis(200), "{waits:?}");
        assert!(waits.iter().skip(10).any(|w| *w > Duration::from_millis(4500)), "they reach it: {waits:?}");
    }
}
