//! Who a peer is, for the shares each may hold: connections by address ([`PeerGroup`]);
//! memory, generation sessions and their caches, and training sessions by [`Peer`]: the client
//! its named token says, else its address.

use std::net::IpAddr;
use std::sync::Arc;

use cleave_common::security::ServerTokens;

/// Who spends a share of what the server holds for its peers (memory, generation sessions and
/// their caches, training sessions): the client a named bearer token (`auth.tokens`) says,
/// wherever it connects from; else its address group. (Connections are counted by address
/// alone: one is counted before any call on it says whose it is.)
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Peer {
    Address(PeerGroup),
    Client(Arc<str>),
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Address(group) => group.fmt(f),
            Self::Client(name) => write!(f, "client `{name}`"),
        }
    }
}

/// A call's peer, in its request's extensions (put there by `connections::CallTracking`).
#[derive(Debug, Clone)]
pub(crate) struct CallPeer(pub(crate) Option<Peer>);

impl CallPeer {
    /// The peer of the call whose extensions these are.
    pub(crate) fn of(extensions: &http::Extensions) -> Option<Peer> {
        extensions.get::<Self>().and_then(|call| call.0.clone())
    }
}

impl Peer {
    /// The peer of a call with these headers over a connection from `address`: the client
    /// whose named token it carries, else the address (none in-process).
    pub(crate) fn of_call(tokens: &ServerTokens, headers: &http::HeaderMap, address: Option<PeerGroup>) -> Option<Self> {
        let client = headers.get("authorization").and_then(|value| tokens.name_of(value.as_bytes()));
        match client {
            Some(name) => Some(Self::Client(name.into())),
            None => address.map(Self::Address),
        }
    }
}

/// The peers that count as one: an IPv4 address, or an IPv6 peer's /64 (what one host or one
/// subscriber is usually given). Shares per peer (connections, memory, generation sessions and
/// their caches) are counted by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum PeerGroup {
    V4(std::net::Ipv4Addr),
    V6Prefix(u64),
}

impl std::fmt::Display for PeerGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::V4(v4) => write!(f, "{v4}"),
            Self::V6Prefix(prefix) => write!(f, "{}/64", std::net::Ipv6Addr::from_bits(u128::from(*prefix) << 64)),
        }
    }
}

impl PeerGroup {
    pub(crate) fn of(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(v4) => Self::V4(v4),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => Self::V4(v4),
                None => Self::V6Prefix((v6.to_bits() >> 64) as u64),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ipv6_peer_counts_by_its_64_and_a_mapped_ipv4_peer_as_ipv4() {
        let group = |ip: &str| PeerGroup::of(ip.parse().unwrap());
        assert_eq!(group("2001:db8:1:2::1"), group("2001:db8:1:2:ffff:ffff:ffff:ffff"));
        assert_ne!(group("2001:db8:1:2::1"), group("2001:db8:1:3::1"));
        assert_eq!(group("::ffff:192.0.2.7"), group("192.0.2.7"));
        assert_ne!(group("192.0.2.7"), group("192.0.2.8"));
        assert_eq!((group("2001:db8:1:2::1").to_string(), group("::ffff:192.0.2.7").to_string()), ("2001:db8:1:2::/64".into(), "192.0.2.7".into()));
    }
}
