//! What the directory knows about a peer: [`PeerRecord`] (what a peer registers),
//! [`LivePeer`] and [`LivePeers`] (a consumer's view), and [`PeerEvent`] (changes to
//! that view).
//!
//! # Semantics
//!
//! A record is keyed by `peer_id`; its `incarnation` changes each time the peer's
//! process starts (and when it re-registers after losing its lease), so a record with
//! a new incarnation means "everything held on the old one is gone". Records carry no
//! secret: they are readable by anyone who can read the directory.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// The version of the wire protocol a record's peer speaks.
pub const PROTOCOL_VERSION: u32 = 1;

/// What a peer does in a prefill/decode fleet.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Produces KV (serves it to decoders).
    Prefill,
    /// Consumes KV.
    Decode,
    /// Both.
    #[default]
    Both,
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "both",
        })
    }
}

impl std::str::FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Role, String> {
        match s {
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            "both" => Ok(Role::Both),
            other => Err(format!("unknown role {other:?} (expected prefill, decode or both)")),
        }
    }
}

/// One peer's entry in the directory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerRecord {
    /// Unique name of the peer within the namespace.
    pub peer_id: String,
    /// Where it serves (`host:port`).
    pub address: String,
    /// Changes with every start (and re-registration) of the peer.
    pub incarnation: u64,
    /// Its role.
    #[serde(default)]
    pub role: Role,
    /// The inference engine instance it belongs to (free-form; empty if none).
    #[serde(default)]
    pub engine_id: String,
    /// Data-parallel rank.
    #[serde(default)]
    pub dp_rank: u32,
    /// Tensor-parallel rank.
    #[serde(default)]
    pub tp_rank: u32,
    /// Pipeline-parallel rank.
    #[serde(default)]
    pub pp_rank: u32,
    /// Wire protocol version.
    #[serde(default)]
    pub protocol_version: u32,
    /// Capabilities (free-form tags, e.g. `direct`, `device`).
    #[serde(default)]
    pub capabilities: Vec<String>,
    /// When it registered, in milliseconds since the Unix epoch (its own clock).
    #[serde(default)]
    pub registered_unix_ms: u64,
}

impl PeerRecord {
    /// A record for `peer_id` at `address` with `incarnation`, registered now, role
    /// `both`, rank 0, this build's protocol version.
    pub fn new(peer_id: impl Into<String>, address: impl Into<String>, incarnation: u64) -> PeerRecord {
        PeerRecord {
            peer_id: peer_id.into(),
            address: address.into(),
            incarnation,
            role: Role::Both,
            engine_id: String::new(),
            dp_rank: 0,
            tp_rank: 0,
            pp_rank: 0,
            protocol_version: PROTOCOL_VERSION,
            capabilities: Vec::new(),
            registered_unix_ms: unix_ms(SystemTime::now()),
        }
    }

    /// How long ago it registered, by `now` on this host's clock (zero if clocks
    /// disagree the other way).
    pub fn age(&self, now: SystemTime) -> Duration {
        Duration::from_millis(unix_ms(now).saturating_sub(self.registered_unix_ms))
    }
}

/// Milliseconds since the Unix epoch.
pub fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// A peer in a consumer's view.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LivePeer {
    /// Its record.
    pub record: PeerRecord,
    /// How long this view has known it (this incarnation).
    pub known_for: Duration,
}

/// The live peers as a directory sees them now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LivePeers {
    /// The peers, by id.
    pub peers: Vec<LivePeer>,
    /// True when the backend cannot currently confirm this view (e.g. etcd is
    /// unreachable): the list is the last one known.
    pub stale: bool,
}

/// A change to the set of live peers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerEvent {
    /// A peer appeared.
    Joined(PeerRecord),
    /// A peer re-registered with a new incarnation: everything held on the old one
    /// is gone.
    Restarted {
        /// The old record (its address is where old connections went).
        old: PeerRecord,
        /// The new record.
        new: PeerRecord,
    },
    /// A peer left (its record was deleted or its lease expired).
    Lost(PeerRecord),
}

impl PeerEvent {
    /// The peer id the event is about.
    pub fn peer_id(&self) -> &str {
        match self {
            PeerEvent::Joined(r) | PeerEvent::Lost(r) => &r.peer_id,
            PeerEvent::Restarted { new, .. } => &new.peer_id,
        }
    }
}
