//! [`StaticDirectory`]: peers named in configuration or added at run time; nothing to
//! run. Registration is a no-op, the view is never stale, and events are emitted when
//! the caller inserts, replaces or removes a peer.

use std::collections::HashMap;

use futures::future::BoxFuture;
use parking_lot::RwLock;
use tokio::sync::broadcast;

use super::record::{LivePeer, LivePeers, PeerEvent, PeerRecord};
use super::{Directory, DirectoryError, EVENT_CAPACITY};

/// Peers named in configuration (or added at run time).
pub struct StaticDirectory {
    peers: RwLock<HashMap<String, PeerRecord>>,
    events: broadcast::Sender<PeerEvent>,
}

impl Default for StaticDirectory {
    fn default() -> Self {
        StaticDirectory::new(std::iter::empty())
    }
}

impl StaticDirectory {
    /// A directory of `(name, address)` pairs.
    pub fn new(peers: impl IntoIterator<Item = (String, String)>) -> StaticDirectory {
        let (events, _) = broadcast::channel(EVENT_CAPACITY);
        StaticDirectory {
            peers: RwLock::new(
                peers
                    .into_iter()
                    .map(|(n, a)| (n.clone(), PeerRecord::new(n, a, 0)))
                    .collect(),
            ),
            events,
        }
    }

    /// Adds or replaces a peer by name and address (incarnation unknown: 0).
    pub fn insert(&self, name: impl Into<String>, addr: impl Into<String>) {
        let name = name.into();
        self.insert_record(PeerRecord::new(name.clone(), addr, 0));
    }

    /// Adds or replaces a peer's record: a new incarnation of a known peer is
    /// announced as [`PeerEvent::Restarted`], an unknown peer as `Joined`.
    pub fn insert_record(&self, record: PeerRecord) {
        let old = self.peers.write().insert(record.peer_id.clone(), record.clone());
        let event = match old {
            None => Some(PeerEvent::Joined(record)),
            Some(old) if old.incarnation != record.incarnation => Some(PeerEvent::Restarted { old, new: record }),
            Some(_) => None,
        };
        if let Some(e) = event {
            let _ = self.events.send(e);
        }
    }

    /// Forgets a peer (announced as [`PeerEvent::Lost`]).
    pub fn remove(&self, name: &str) {
        if let Some(r) = self.peers.write().remove(name) {
            let _ = self.events.send(PeerEvent::Lost(r));
        }
    }
}

impl Directory for StaticDirectory {
    fn resolve(&self, peer: &str) -> Option<String> {
        self.peers.read().get(peer).map(|r| r.address.clone())
    }

    fn live_peers(&self) -> LivePeers {
        let mut peers: Vec<LivePeer> = self
            .peers
            .read()
            .values()
            .map(|r| LivePeer {
                record: r.clone(),
                known_for: std::time::Duration::ZERO,
            })
            .collect();
        peers.sort_by(|a, b| a.record.peer_id.cmp(&b.record.peer_id));
        LivePeers { peers, stale: false }
    }

    fn register(&self, _record: PeerRecord) -> BoxFuture<'_, Result<(), DirectoryError>> {
        Box::pin(async { Ok(()) })
    }

    fn deregister(&self) -> BoxFuture<'_, Result<(), DirectoryError>> {
        Box::pin(async { Ok(()) })
    }

    fn subscribe(&self) -> broadcast::Receiver<PeerEvent> {
        self.events.subscribe()
    }
}
