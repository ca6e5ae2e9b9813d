//! Where a peer's name becomes an address: the hook a peer directory plugs into.
//!
//! An engine's transfers name their peer either by address (`host:port`) or by a
//! name a [`Directory`] resolves. [`StaticDirectory`] (names from configuration) is
//! built in; a fleet directory implements the same trait.

use std::collections::HashMap;

use parking_lot::RwLock;

/// Resolves peer names to addresses.
pub trait Directory: Send + Sync + 'static {
    /// The address of `peer`, or `None` when it is not known.
    fn resolve(&self, peer: &str) -> Option<String>;
}

/// Peers named in configuration (or added at run time).
#[derive(Default)]
pub struct StaticDirectory {
    peers: RwLock<HashMap<String, String>>,
}

impl StaticDirectory {
    /// A directory of `(name, address)` pairs.
    pub fn new(peers: impl IntoIterator<Item = (String, String)>) -> StaticDirectory {
        StaticDirectory {
            peers: RwLock::new(peers.into_iter().collect()),
        }
    }

    /// Adds or replaces a peer.
    pub fn insert(&self, name: impl Into<String>, addr: impl Into<String>) {
        self.peers.write().insert(name.into(), addr.into());
    }

    /// Forgets a peer.
    pub fn remove(&self, name: &str) {
        self.peers.write().remove(name);
    }
}

impl Directory for StaticDirectory {
    fn resolve(&self, peer: &str) -> Option<String> {
        self.peers.read().get(peer).cloned()
    }
}
