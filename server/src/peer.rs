//! Who a peer is, for the shares each may hold: connections, memory, generation sessions and
//! their caches.

use std::net::IpAddr;

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
