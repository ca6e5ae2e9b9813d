//! Transport settings, validated once at start-up.

use std::time::Duration;

use super::NetError;
use crate::wire::Limits;

/// Settings shared by clients and servers.
#[derive(Clone, Debug)]
pub struct NetConfig {
    /// This node's stable identity.
    pub peer_id: String,
    /// Changes every time this process starts (a restarted peer is a new incarnation).
    pub incarnation: u64,
    /// Shared secret; when set, both sides must prove it (HMAC challenge-response).
    pub secret: Option<Vec<u8>>,
    /// Bound on TCP connect.
    pub connect_timeout: Duration,
    /// Bound on the whole handshake.
    pub handshake_timeout: Duration,
    /// Bound on any single read or write making no progress once a frame has started.
    pub io_timeout: Duration,
    /// How long an idle accepted connection may wait for its next request.
    pub idle_timeout: Duration,
    /// TCP keepalive interval.
    pub keepalive: Duration,
    /// Connections per peer in a client pool (transfers are striped over them).
    pub connections_per_peer: usize,
    /// Accepted connections a server keeps at once; more are refused with `Busy`.
    pub max_connections: usize,
    /// Frame and message limits.
    pub limits: Limits,
}

impl NetConfig {
    /// Defaults for `peer_id` with a fresh random incarnation.
    pub fn new(peer_id: impl Into<String>) -> NetConfig {
        NetConfig {
            peer_id: peer_id.into(),
            incarnation: rand::random::<u64>() | 1,
            secret: None,
            connect_timeout: Duration::from_secs(3),
            handshake_timeout: Duration::from_secs(3),
            io_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(300),
            keepalive: Duration::from_secs(10),
            connections_per_peer: 4,
            max_connections: 4096,
            limits: Limits::default(),
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
        if matches!(&self.secret, Some(s) if s.is_empty()) {
            return bad("secret must not be empty".into());
        }
        Ok(())
    }
}
