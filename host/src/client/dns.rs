//! `resolve_every`: the servers behind a name (a headless Kubernetes Service has one address
//! per ready pod), found again and again so that a server added gets requests and one gone
//! gets no more.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::sync::watch;

use crate::config::{EdgeConfig, MAX_SERVERS};

/// The servers of `config` now: with `resolve_every`, every address their names resolve to
/// (the URLs as written when none resolves, for the connection to say why); otherwise the
/// URLs as written.
pub async fn servers_now(config: &EdgeConfig) -> Vec<String> {
    if config.resolve_every.is_none() {
        return config.servers.clone();
    }
    let found = resolve(&config.servers).await;
    if found.is_empty() {
        config.servers.clone()
    } else {
        found
    }
}

/// Every address the names in `urls` resolve to, each as a URL of its scheme and port (at
/// most [`MAX_SERVERS`], sorted); a name that does not resolve is left out (and said).
pub async fn resolve(urls: &[String]) -> Vec<String> {
    let mut found = BTreeSet::new();
    for url in urls {
        let Some((scheme, authority)) = url.split_once("://") else { continue };
        let authority = authority.trim_end_matches('/');
        let with_port = if has_port(authority) { authority.to_string() } else { format!("{authority}:{}", default_port(scheme)) };
        let looked_up = tokio::net::lookup_host(with_port).await;
        match looked_up {
            Ok(addresses) => found.extend(addresses.map(|a| address_url(scheme, a))),
            Err(e) => tracing::warn!(server = %url, error = %e, "the server's name does not resolve now"),
        }
    }
    found.into_iter().take(MAX_SERVERS).collect()
}

/// The servers `urls` name, resolved now (`first`) and then every `every` in a task of its
/// own, which ends once nobody follows the list. A resolution that finds nothing keeps the
/// list before it (a DNS server that fails does not take every server away).
pub fn follow(urls: Vec<String>, first: Vec<String>, every: Duration) -> watch::Receiver<Vec<String>> {
    let (list, listed) = watch::channel(first);
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = tokio::time::sleep(every) => {}
                () = list.closed() => return,
            }
            let found = resolve(&urls).await;
            if !found.is_empty() {
                list.send_if_modified(|before| {
                    let changed = *before != found;
                    if changed {
                        tracing::info!(servers = found.len(), "the servers' names resolve to other addresses now");
                        *before = found;
                    }
                    changed
                });
            }
        }
    });
    listed
}

fn has_port(authority: &str) -> bool {
    match authority.rsplit_once(':') {
        // `[::1]` has colons and no port; `[::1]:80` and `host:80` have one.
        Some((host, port)) => port.parse::<u16>().is_ok() && (!host.contains(':') || host.ends_with(']')),
        None => false,
    }
}

fn default_port(scheme: &str) -> u16 {
    if scheme == "https" {
        443
    } else {
        80
    }
}

/// `address` as a URL of `scheme` (an IPv6 address in brackets).
fn address_url(scheme: &str, address: SocketAddr) -> String {
    format!("{scheme}://{address}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_keeps_its_port_or_takes_its_scheme_s() {
        assert!(has_port("gpu:50051") && has_port("[::1]:50051") && has_port("10.0.0.1:1"));
        assert!(!has_port("gpu") && !has_port("[::1]") && !has_port("gpu:http"));
        assert_eq!((default_port("http"), default_port("https")), (80, 443));
        assert_eq!(address_url("https", "[::1]:50051".parse().unwrap()), "https://[::1]:50051");
        assert_eq!(address_url("http", "10.1.2.3:7".parse().unwrap()), "http://10.1.2.3:7");
    }

    #[tokio::test]
    async fn a_name_resolves_to_each_of_its_addresses_and_an_address_to_itself() {
        let found = resolve(&["http://localhost:50051".to_string(), "http://127.0.0.2:7".to_string()]).await;
        assert!(found.contains(&"http://127.0.0.1:50051".to_string()), "{found:?}");
        assert!(found.contains(&"http://127.0.0.2:7".to_string()), "{found:?}");
        assert!(found.iter().all(|u| u.starts_with("http://")), "{found:?}");
        let none = resolve(&["http://no-such-name.invalid:1".to_string()]).await;
        assert!(none.is_empty(), "{none:?}");
    }
}
