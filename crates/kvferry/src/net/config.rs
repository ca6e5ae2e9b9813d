//! Transport settings, validated once at start-up.

use std::time::Duration;

use super::{NetError, TlsConfig};
use crate::wire::auth::MIN_SECRET_BYTES;
use crate::wire::Limits;

/// Settings shared by clients and servers.
#[derive(Clone)]
pub struct NetConfig {
    /// This node's stable identity.
    pub peer_id: String,
    /// Changes every time this process starts (a restarted peer is a new incarnation).
    pub incarnation: u64,
    /// Shared secret; when set, both sides must prove it (HMAC challenge-response over
    /// keys derived from it). At least [`MIN_SECRET_BYTES`] bytes, e.g. the output of
    /// `head -c 32 /dev/urandom | base64`.
    pub secret: Option<Vec<u8>>,
    /// The local address a client connects from (`None`: the system's choice), e.g.
    /// another loopback address to stand for another host.
    pub local_addr: Option<std::net::IpAddr>,
    /// Bound on TCP connect.
    pub connect_timeout: Duration,
    /// Bound on the whole handshake (on a server: how long an unauthenticated connection
    /// may live).
    pub handshake_timeout: Duration,
    /// Progress timeout of frame reads and writes: one fails when *no byte* has moved
    /// for this long, however long the whole frame takes (a 256 MiB chunk over a slow
    /// link is fine as long as it keeps moving). It also bounds the wait for the first
    /// byte of a reply. The total time of an operation is bounded by the caller's
    /// deadline, not by this. Progress is what the socket accepts or delivers: a writer
    /// whose socket buffer is full sees progress only as the buffer drains (by about a
    /// third of it at a time), so on a slow link keep this above
    /// `send buffer / 3 / throughput`.
    pub io_timeout: Duration,
    /// On a server: the rate, in bytes per second, below which a frame being read or
    /// written fails once it has taken longer than `min_rate_grace` (cumulative: the
    /// bytes moved must keep up with `min_rate` × the time past the grace). A client
    /// trickling a byte now and then resets the progress timeout every time; this
    /// ends its frame (and frees what it holds) after the grace. 0 turns it off.
    pub min_rate: u64,
    /// The grace of `min_rate`.
    pub min_rate_grace: Duration,
    /// How long an idle accepted connection may wait for its next request.
    pub idle_timeout: Duration,
    /// TCP keepalive interval.
    pub keepalive: Duration,
    /// Connections per peer in a client pool (transfers are striped over them).
    pub connections_per_peer: usize,
    /// Authenticated (handshaken) connections a server keeps at once; a client that
    /// completes its handshake beyond this is refused with `Busy`. Connections still
    /// handshaking do not count here (see `max_unauthenticated`).
    pub max_connections: usize,
    /// Connections a server keeps handshaking (not yet authenticated, having sent their
    /// first byte) at once; connections that have sent nothing yet have a budget of
    /// `SILENT_PER_PLACE` times this, the oldest closed at once when it is full. See
    /// [`server`](super::server) for who is closed to make room: idle strangers cannot
    /// keep peers with the secret out, sources that proved the secret before keep their
    /// share, and a burst of honest peers, each done in a round trip or two, waits its
    /// turn instead of closing each other.
    pub max_unauthenticated: usize,
    /// Failed authentications from one source address (IPv6: one /64) within
    /// `auth_failure_window` after which the server treats that address's connections
    /// as suspect for `auth_failure_window`: the first closed when handshake places run
    /// out, but still served when they prove the secret (which lifts the block).
    pub auth_failure_limit: u32,
    /// The window of `auth_failure_limit`, and how long an address stays suspect.
    pub auth_failure_window: Duration,
    /// Frame and message limits.
    pub limits: Limits,
    /// Mutual TLS between peers (`None`: plain TCP). Servers then require a client
    /// certificate from the CA, clients check the server's; both directions encrypted.
    pub tls: Option<TlsConfig>,
}

impl NetConfig {
    /// Defaults for `peer_id` with a fresh random incarnation.
    pub fn new(peer_id: impl Into<String>) -> NetConfig {
        NetConfig {
            peer_id: peer_id.into(),
            incarnation: rand::random::<u64>() | 1,
            secret: None,
            local_addr: None,
            connect_timeout: Duration::from_secs(3),
            handshake_timeout: Duration::from_secs(3),
            io_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(300),
            min_rate: 64 << 10,
            min_rate_grace: Duration::from_secs(5),
            keepalive: Duration::from_secs(10),
            connections_per_peer: 4,
            max_connections: 4096,
            max_unauthenticated: 64,
            auth_failure_limit: 10,
            auth_failure_window: Duration::from_secs(60),
            limits: Limits::default(),
            tls: None,
        }
    }

    /// Sets the shared secret.
    pub fn with_secret(mut self, secret: impl Into<Vec<u8>>) -> NetConfig {
        self.secret = Some(secret.into());
        self
    }

    /// Rejects zero or absurd values with a message naming the setting.
    pub fn validate(&self) -> Result<(), NetError> {
        let bad = |m: String| Err(NetError::InvalidConfig(m));
        if self.peer_id.is_empty() || self.peer_id.len() > crate::wire::message::MAX_PEER_ID_BYTES {
            return bad(format!("peer id must be 1..=256 bytes, got {}", self.peer_id.len()));
        }
        for (name, d) in [
            ("connect timeout", self.connect_timeout),
            ("handshake timeout", self.handshake_timeout),
            ("io timeout", self.io_timeout),
            ("idle timeout", self.idle_timeout),
            ("keepalive", self.keepalive),
            ("auth failure window", self.auth_failure_window),
            ("min rate grace", self.min_rate_grace),
        ] {
            if d.is_zero() {
                return bad(format!("{name} must be greater than zero"));
            }
            if d > Duration::from_secs(24 * 3600) {
                return bad(format!("{name} of {d:?} is absurd (max 24h)"));
            }
        }
        if self.connections_per_peer == 0 || self.connections_per_peer > 256 {
            return bad(format!(
                "connections per peer must be 1..=256, got {}",
                self.connections_per_peer
            ));
        }
        if self.max_connections == 0 {
            return bad("max connections must be at least 1".into());
        }
        if self.max_unauthenticated == 0 {
            return bad("max unauthenticated connections must be at least 1".into());
        }
        if self.auth_failure_limit == 0 {
            return bad("auth failure limit must be at least 1".into());
        }
        let hs = self.limits.max_handshake_bytes;
        if !(Limits::MIN_HANDSHAKE_BYTES..=MAX_HANDSHAKE_BYTES).contains(&hs) {
            return bad(format!(
                "max handshake bytes must be {}..={MAX_HANDSHAKE_BYTES}, got {hs}",
                Limits::MIN_HANDSHAKE_BYTES
            ));
        }
        if let Some(s) = &self.secret {
            if s.len() < MIN_SECRET_BYTES {
                return bad(format!(
                    "the shared secret is {} bytes; at least {MIN_SECRET_BYTES} are required \
                     (generate one with `head -c 32 /dev/urandom | base64`)",
                    s.len()
                ));
            }
        }
        Ok(())
    }
}

impl NetConfig {
    /// The minimum rate a server enforces on its connections' frames.
    pub(crate) fn min_rate(&self) -> Option<super::progress::MinRate> {
        (self.min_rate > 0).then_some(super::progress::MinRate {
            bytes_per_sec: self.min_rate,
            grace: self.min_rate_grace,
        })
    }
}

/// Largest accepted [`Limits::max_handshake_bytes`].
const MAX_HANDSHAKE_BYTES: u64 = 64 << 10;

impl std::fmt::Debug for NetConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetConfig")
            .field("peer_id", &self.peer_id)
            .field("incarnation", &self.incarnation)
            .field("secret", &self.secret.as_ref().map(|_| "<set>"))
            .field("local_addr", &self.local_addr)
            .field("connect_timeout", &self.connect_timeout)
            .field("handshake_timeout", &self.handshake_timeout)
            .field("io_timeout", &self.io_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .field("min_rate", &self.min_rate)
            .field("min_rate_grace", &self.min_rate_grace)
            .field("keepalive", &self.keepalive)
            .field("connections_per_peer", &self.connections_per_peer)
            .field("max_connections", &self.max_connections)
            .field("max_unauthenticated", &self.max_unauthenticated)
            .field("auth_failure_limit", &self.auth_failure_limit)
            .field("auth_failure_window", &self.auth_failure_window)
            .field("limits", &self.limits)
            .field("tls", &self.tls)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_secrets_are_refused_with_a_how_to() {
        for len in [0, 1, 6, 31] {
            let e = NetConfig::new("a").with_secret(vec![b'x'; len]).validate().unwrap_err();
            let m = e.to_string();
            assert!(m.contains(&format!("{len} bytes")), "{m}");
            assert!(m.contains("head -c 32 /dev/urandom | base64"), "{m}");
        }
        NetConfig::new("a").with_secret(vec![b'x'; 32]).validate().unwrap();
        NetConfig::new("a").validate().unwrap();
    }

    #[test]
    fn debug_redacts_the_secret() {
        let c = NetConfig::new("a").with_secret(b"super-secret-value-0123456789abcdef".to_vec());
        let d = format!("{c:?}");
        assert!(!d.contains("super-secret") && d.contains("<set>"), "{d}");
    }

    #[test]
    fn handshake_budget_and_limits_are_checked() {
        let mut c = NetConfig::new("a");
        c.max_unauthenticated = 0;
        assert!(c.validate().unwrap_err().to_string().contains("unauthenticated"));
        let mut c = NetConfig::new("a");
        c.limits.max_handshake_bytes = 100;
        assert!(c.validate().unwrap_err().to_string().contains("handshake bytes"));
        let mut c = NetConfig::new("a");
        c.auth_failure_limit = 0;
        assert!(c.validate().is_err());
    }
}
