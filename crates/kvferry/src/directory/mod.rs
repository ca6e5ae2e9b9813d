//! The peer directory: where peers find each other, learn that one restarted and
//! forget one that died.
//!
//! One trait, [`Directory`], two backends:
//!
//! - [`StaticDirectory`] (the default; nothing to run): peers named in configuration
//!   or on the command line; their metadata is exchanged in the handshake.
//! - `etcd::EtcdDirectory` (cargo feature `etcd`): each peer registers
//!   `<namespace>/peers/<peer_id>` on an etcd lease kept alive by a dedicated task;
//!   consumers list, then watch from that revision.
//!
//! A directory answers from memory ([`Directory::resolve`], [`Directory::live_peers`]
//! never wait on a backend) and announces changes as [`PeerEvent`]s. The view logic
//! (list → watch → relist, event derivation, staleness) is the pure state machine
//! [`view::PeerView`]; lookups of keys without a peer use a [`MissCache`].
//!
//! The shared secret never goes into a directory: records carry addresses and
//! metadata only.
//!
//! # Ownership of a registration
//!
//! A record is owned by the process whose incarnation it names. A backend never
//! replaces a record naming a live incarnation: a newcomer with the same peer id is
//! refused with [`DirectoryError::DuplicatePeerId`] unless the holder is proven dead
//! (its address answers as the newcomer, see [`Prober`]) or its lease expires. A
//! holder whose address fails to prove the fleet's secret after the prober proved it,
//! or answers as another peer, is no holder: its record is replaced at once. A registered
//! process checks its own record and puts it back when it vanished or was overwritten
//! by a record whose holder does not prove itself alive and authorised at its address
//! (counted, [`Directory::records_taken_back`]); while another live process holds it,
//! its state is [`RegistrationState::Lost`].
//!
//! # Cancellation
//!
//! [`Directory::register`] and [`Directory::deregister`] return futures bounded by the
//! backend's call deadline; dropping one midway leaves the registration as the backend
//! last saw it (an etcd record then expires with its lease).

pub mod miss_cache;
pub mod record;
mod static_dir;
pub mod view;

#[cfg(feature = "etcd")]
pub mod etcd;

use std::time::Duration;

use futures::future::BoxFuture;
use tokio::sync::broadcast;

pub use miss_cache::MissCache;
pub use record::{LivePeer, LivePeers, PeerEvent, PeerRecord, Role, PROTOCOL_VERSION};
pub use static_dir::StaticDirectory;

/// Events a subscriber may fall behind by before it is told it lagged.
pub const EVENT_CAPACITY: usize = 1024;

/// Errors of a directory backend.
#[derive(Debug, thiserror::Error)]
pub enum DirectoryError {
    /// A setting is unusable; the message names it.
    #[error("invalid directory config: {0}")]
    InvalidConfig(String),
    /// Another live process holds this peer id.
    #[error("peer id {peer_id} is already registered by a live process at {address} (incarnation {incarnation:#x})")]
    DuplicatePeerId {
        /// The id.
        peer_id: String,
        /// The holder's address.
        address: String,
        /// The holder's incarnation.
        incarnation: u64,
    },
    /// The backend did not answer within its deadline.
    #[error("directory {op} timed out after {waited:?} (is {endpoints} reachable?)")]
    Timeout {
        /// What timed out.
        op: &'static str,
        /// How long it waited.
        waited: Duration,
        /// The backend's endpoints.
        endpoints: String,
    },
    /// The backend refused or failed a call.
    #[error("directory {op} failed: {reason}")]
    Backend {
        /// What failed.
        op: &'static str,
        /// Why.
        reason: String,
    },
    /// A record in the backend is not a valid peer record.
    #[error("bad peer record at {key}: {reason}")]
    BadRecord {
        /// Its key.
        key: String,
        /// Why.
        reason: String,
    },
    /// The directory was closed.
    #[error("directory is closed")]
    Closed,
}

impl DirectoryError {
    /// The stable code of this error.
    pub fn code(&self) -> crate::ErrorCode {
        use crate::ErrorCode as C;
        match self {
            DirectoryError::InvalidConfig(_) => C::InvalidConfig,
            DirectoryError::DuplicatePeerId { .. } => C::DuplicatePeerId,
            DirectoryError::Timeout { .. } => C::Timeout,
            DirectoryError::Backend { .. } | DirectoryError::BadRecord { .. } => C::Directory,
            DirectoryError::Closed => C::Closed,
        }
    }
}

/// Where peers are found.
pub trait Directory: Send + Sync + 'static {
    /// The address of `peer` (an id), or `None` when it is not known. Answers from
    /// memory.
    fn resolve(&self, peer: &str) -> Option<String>;

    /// The live peers as currently known, with a `stale` flag when the backend cannot
    /// currently confirm this view. Answers from memory.
    fn live_peers(&self) -> LivePeers;

    /// Registers this process under `record.peer_id` (a no-op for static peers). Fails
    /// with [`DirectoryError::DuplicatePeerId`] when another live process holds it.
    fn register(&self, record: PeerRecord) -> BoxFuture<'_, Result<(), DirectoryError>>;

    /// Removes this process's registration (e.g. at a clean shutdown).
    fn deregister(&self) -> BoxFuture<'_, Result<(), DirectoryError>>;

    /// Changes to the live peers from now on.
    fn subscribe(&self) -> broadcast::Receiver<PeerEvent>;

    /// This process's current registration (its incarnation may differ from the one
    /// registered first, after the backend lost and renewed it), if registered.
    fn registration(&self) -> Option<PeerRecord> {
        None
    }

    /// Changes of this process's registration state (`None`: the backend has no
    /// registrations that can be lost, as for static peers).
    fn registration_state(&self) -> Option<tokio::sync::watch::Receiver<RegistrationState>> {
        None
    }

    /// How many times this process put its record back after a writer whose holder
    /// could not prove itself (the shared secret, or its identity at its address) had
    /// taken it (0 for backends without registrations).
    fn records_taken_back(&self) -> u64 {
        0
    }

    /// The record of `peer` (an id), when the backend has one: what a consumer
    /// dialling by peer id compares the handshake's peer id and incarnation with.
    /// Answers from memory.
    fn record(&self, _peer: &str) -> Option<PeerRecord> {
        None
    }

    /// Sets how this directory asks who answers at an address, to tell a live holder
    /// of a peer id from a dead one (backends without registrations ignore it). Set it
    /// before [`Directory::register`].
    fn set_prober(&self, _prober: Prober) {}
}

/// Who answered at an address, as a [`Prober`] found out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Probed {
    /// A peer completed the handshake there, presenting this id and incarnation.
    Answered {
        /// Its peer id.
        peer_id: String,
        /// Its incarnation.
        incarnation: u64,
    },
    /// Something answered there but failed to prove the fleet's shared secret after
    /// the prober proved it. It cannot be a holder of a fleet's record. (A peer that
    /// refuses the prober's proof, or a TLS handshake that fails, is `NoAnswer`: the
    /// prober may be the one outside the fleet.)
    Unproven(String),
    /// Nobody completed a handshake there in time (the reason says what happened).
    NoAnswer(String),
}

/// Dials an address (a record's) and says who answers there. The engine provides one
/// that handshakes as itself (with its secret and TLS settings), bounded by its
/// connect and handshake timeouts.
pub type Prober = std::sync::Arc<dyn Fn(String) -> BoxFuture<'static, Probed> + Send + Sync>;

/// This process's standing in a directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RegistrationState {
    /// Not registered (never, or deregistered).
    Unregistered,
    /// Registered with this record.
    Registered(PeerRecord),
    /// The backend lost the registration (its lease expired while the backend was
    /// unreachable, its record was deleted, or another live process holds the id);
    /// registering again. Peers do not see this process meanwhile.
    Lost,
}

impl RegistrationState {
    /// Whether peers can see this process now.
    pub fn is_registered(&self) -> bool {
        matches!(self, RegistrationState::Registered(_))
    }
}
