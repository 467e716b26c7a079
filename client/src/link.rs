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

    #[test]
    fn backoff_waits_never_exceed_max_backoff_jitter_included() {
        let retry = RetryPolicy { max_attempts: 10, max_backoff: Duration::from_secs(5) };
        let waits: Vec<Duration> = retry.backoff().take(200).collect();
        assert!(waits.iter().all(|w| *w <= retry.max_backoff), "{waits:?}");
        assert!(waits[0] >= Duration::from_millis(100) && waits[0] < Duration::from_millis(200), "{waits:?}");
        assert!(waits.iter().skip(10).any(|w| *w > Duration::from_millis(4500)), "they reach it: {waits:?}");
    }
}
