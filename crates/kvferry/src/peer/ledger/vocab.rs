//! The ledger's shared vocabulary: the ids it hands out ([`PubId`], [`RegId`]), who
//! asks for a lease ([`Who`]), why a lease ended or was refused, what one operation let
//! go of ([`Outcome`]), and the ledger's limits and counters. The tables (`leases.rs`,
//! `publications.rs`, `registrations.rs`) and the [`Ledger`](super::Ledger) composing
//! them all speak it; it names none of them.
//!
//! # Cancellation
//!
//! Nothing here waits.

use std::time::Duration;

use crate::peer::publish::Released;
use crate::wire::LeaseId;

/// A publication's identity (unique within a ledger; never reused).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct PubId(pub(crate) u64);

/// A registration's identity (unique within an engine).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct RegId(pub(crate) u64);

/// Who asks for a lease (a pull, a `Done`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Who {
    /// The embedder, naming the owner: the identity alone is compared.
    Local(String),
    /// A remote peer: its authenticated (or claimed) identity, and without TLS its
    /// incarnation, must be the ones the lease was granted to.
    Remote {
        /// The certificate's identity under TLS, else the claimed peer id.
        identity: String,
        /// Its incarnation when its identity is only claimed.
        incarnation: Option<u64>,
    },
}

/// Why a lease ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EndReason {
    /// Its owner's `Done`.
    Done,
    /// Its TTL passed (or the grace after its eager get's connection closed).
    Expired,
    /// The send that had it checked out failed or was dropped (an eager get's
    /// consumer is gone, a connection task was torn down).
    SendDropped,
    /// Staging failed or was cancelled before it was granted.
    StagingFailed,
    /// Its owner left the peer directory.
    PeerGone,
    /// The producer is shutting down.
    Shutdown,
}

/// Why a `Done` (or a pull) changed nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseRefusal {
    /// No such lease (already released, expired, or never granted).
    Unknown,
    /// The lease was granted to another peer.
    Foreign,
}

/// A lease that ended.
#[derive(Debug)]
pub(crate) struct Ended<L> {
    /// The lease.
    pub id: LeaseId,
    /// Its payload, when the ledger held it (a staged lease); `None` when the send or
    /// the staging that held it already dropped it.
    pub payload: Option<L>,
    /// Why.
    pub reason: EndReason,
    /// Its staging pages (now uncharged, with its payload).
    pub pages: usize,
}

/// What one ledger operation let go of: the caller drops the payloads first, then
/// reports the released publications and wakes completed deregistrations.
#[must_use = "an outcome holds payloads to drop and releases to report"]
#[derive(Debug)]
pub(crate) struct Outcome<L, P> {
    /// Leases that ended.
    pub ended: Vec<Ended<L>>,
    /// Publications released: no lease holds them and they left the table.
    pub released: Vec<(Released, P)>,
    /// Registrations whose deregistration completed.
    pub deregistered: Vec<RegId>,
}

impl<L, P> Default for Outcome<L, P> {
    fn default() -> Self {
        Outcome {
            ended: Vec::new(),
            released: Vec::new(),
            deregistered: Vec::new(),
        }
    }
}

impl<L, P> Outcome<L, P> {
    /// True when nothing was let go of.
    pub(crate) fn is_empty(&self) -> bool {
        self.ended.is_empty() && self.released.is_empty() && self.deregistered.is_empty()
    }

    /// Appends what `other` let go of, after what this one did.
    pub(super) fn absorb(&mut self, other: Outcome<L, P>) {
        self.ended.extend(other.ended);
        self.released.extend(other.released);
        self.deregistered.extend(other.deregistered);
    }
}

/// How much the ledger remembers of what ended.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LedgerLimits {
    /// Expired lease ids remembered (a late pull answers "expired").
    pub recent_expired: usize,
    /// Retired keys remembered (a late `Release` answers "released").
    pub recent_retired: usize,
    /// How long either is remembered.
    pub recent_window: Duration,
}

impl Default for LedgerLimits {
    fn default() -> Self {
        LedgerLimits {
            recent_expired: 4096,
            recent_retired: 4096,
            recent_window: Duration::from_secs(120),
        }
    }
}

/// Counters kept by the ledger.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct LedgerCounts {
    /// Leases granted.
    pub granted: u64,
    /// `Done`s accepted (a lease checked out counts when the `Done` arrives).
    pub done: u64,
    /// Leases ended by their TTL.
    pub expired: u64,
    /// `Done`s and pulls refused because the lease belongs to another peer.
    pub foreign_refused: u64,
    /// Eager-get leases whose connection closed without `Done`.
    pub orphaned: u64,
}
