//! The holdings ledger: the one place that decides who holds what until when on the
//! producer side — staged leases, publications, registrations and the staging pages
//! charged to each holder.
//!
//! # Semantics
//!
//! [`Ledger`] is pure: no I/O, no tasks, no clock of its own (as
//! [`StepTracker`](crate::cluster::tracker::StepTracker)). Every method takes the
//! current time as `now` and returns what it let go of as values — an [`Outcome`]:
//! lease payloads to drop (their staging pages and quota charges return when they do),
//! publications whose blocks are the engine's again, registrations whose
//! deregistration completed. The producer calls it under one lock and acts on the
//! outcome outside it; the unit and property tests drive it with made-up instants.
//!
//! **Staged leases** (`leases.rs`) move through `Staging` (a gather is filling its
//! pages) → `Staged` (waiting for a pull or `Done`; the ledger owns its payload) ⇄
//! `CheckedOut` (a send owns the payload) → ended. A lease is in exactly one of these
//! states. Nothing held by a checked-out lease is released until the send gives it
//! back ([`Ledger::check_in`]) or drops it ([`Ledger::send_dropped`]): a `Done`,
//! `Release`, expiry, peer loss or shutdown that arrives meanwhile is *accepted at
//! once* (a `Done` is acknowledged and counted, the `once` publications it retires
//! leave the key table, a later `Release` of those keys answers released) and *takes
//! effect* — the lease ends, its payload drops, its publications are reported released
//! — when the send ends. The TTL is the backstop: a staged lease past its expiry ends
//! at the next [`Ledger::expire`]; one checked out past it ends at its check-in.
//!
//! **Publications** (`publications.rs`) each get their own [`PubId`]; the key table
//! maps a key to its live publication. A lease holds the publications it serves by id,
//! so a `Done` retires exactly those (never a later publication under the same key).
//! Retiring (reasons as [`ReleaseReason`]) takes the publication out of the key table
//! at once; it is *released* — reported, its registration unheld — when no lease holds
//! it any more. Keys retired recently (bounded: [`LedgerLimits`]) are remembered, so
//! `Release` is idempotent.
//!
//! **Registrations** (`registrations.rs`) count their holders explicitly: every
//! publication of a registered cache holds it, and so does every [`Hold`] the engine
//! takes for a transfer using it. A deregistration with holders left is pending; the
//! unhold that brings the count to zero completes it (reported in the outcome, so the
//! waiter is woken, never polled).
//!
//! **Quotas**: each lease's payload owns its quota charge guard
//! ([`Charge`](super::quota::Charge)), so ending a lease on any path uncharges it; the
//! ledger records each lease's pages and owner and reports them per owner
//! ([`Ledger::pages_held_by`]).
//!
//! [`Hold`]: super::Hold
//!
//! # Cancellation
//!
//! Nothing here waits. The caller's guards (a checked-out send, a lease being staged,
//! a hold) report to the ledger when they drop, so a dropped future ends what it held.

mod leases;
mod publications;
mod recent;
mod registrations;

#[cfg(test)]
mod props;

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

use super::publish::{ReleaseReason, Released};
use crate::wire::{ChunkKey, LeaseId};

pub(crate) use leases::{CheckOut, LeaseTerms};
pub(crate) use registrations::{Deregistration, RegError, RegId};

use leases::LeaseRecord;
use publications::PubRecord;
use recent::Recent;
use registrations::RegRecord;

/// A publication's identity (unique within a ledger; never reused).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct PubId(pub(crate) u64);

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

    fn absorb(&mut self, other: Outcome<L, P>) {
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

/// The holdings ledger of one producer: `L` is a staged lease's payload (its pages and
/// quota charge), `P` a publication's (what it sends from).
pub(crate) struct Ledger<L, P> {
    leases: HashMap<LeaseId, LeaseRecord<L>>,
    pubs: HashMap<PubId, PubRecord<P>>,
    /// Live publications by key.
    by_key: HashMap<ChunkKey, PubId>,
    next_pub: u64,
    regs: HashMap<RegId, RegRecord>,
    recent_expired: Recent<LeaseId>,
    recent_retired: Recent<ChunkKey>,
    counts: LedgerCounts,
}

impl<L, P> Ledger<L, P> {
    /// An empty ledger.
    pub(crate) fn new(limits: LedgerLimits) -> Self {
        Ledger {
            leases: HashMap::new(),
            pubs: HashMap::new(),
            by_key: HashMap::new(),
            next_pub: 1,
            regs: HashMap::new(),
            recent_expired: Recent::new(limits.recent_expired, limits.recent_window),
            recent_retired: Recent::new(limits.recent_retired, limits.recent_window),
            counts: LedgerCounts::default(),
        }
    }

    /// The counters.
    pub(crate) fn counts(&self) -> LedgerCounts {
        self.counts
    }

    /// Everything that expires by `now`: staged leases past their TTL end, live
    /// publications past theirs retire (`Expired`; released once no lease holds
    /// them), and the memories of recent events are pruned.
    pub(crate) fn expire(&mut self, now: Instant) -> Outcome<L, P> {
        let mut out = self.expire_leases(now);
        out.absorb(self.expire_publications(now));
        self.recent_expired.prune(now);
        self.recent_retired.prune(now);
        out
    }

    /// Shutdown: every staged lease ends now, leases being staged or sent end when
    /// they come back, every live publication retires (`Shutdown`).
    pub(crate) fn release_all(&mut self, now: Instant) -> Outcome<L, P> {
        let mut out = self.end_all_leases(now);
        out.absorb(self.retire_all(ReleaseReason::Shutdown, now));
        out
    }
}
