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
//! **Layout**: each table owns its records and decides within them —
//! `LeaseTable` (`leases.rs`), `PublicationTable` (`publications.rs`),
//! `RegistrationTable` (`registrations.rs`); `recent.rs` is their bounded memory of
//! what ended. What they all speak ([`PubId`], [`RegId`], [`Who`], [`EndReason`],
//! [`Outcome`], the limits and counters) is in `vocab.rs`, which names none of them.
//! [`Ledger`], here, composes the tables and does what crosses them: a lease holds its
//! publications and a publication its registration, so ending a lease may release
//! publications and releasing one may complete a deregistration. The tables import
//! only `vocab.rs` and `recent.rs`, never this module or each other.
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
mod vocab;

#[cfg(test)]
mod props;

use std::time::Duration;

use tokio::time::Instant;

use super::publish::ReleaseReason;
use crate::wire::{ChunkKey, LeaseId};

pub(crate) use leases::{CheckOut, LeaseTerms};
pub(crate) use registrations::{Deregistration, RegError};
pub use vocab::LeaseRefusal;
pub(crate) use vocab::{EndReason, LedgerCounts, LedgerLimits, Outcome, PubId, RegId, Who};

use leases::{Grant, LeaseTable, Pull};
use publications::{Freed, PublicationTable};
use registrations::RegistrationTable;

/// The holdings ledger of one producer: `L` is a staged lease's payload (its pages and
/// quota charge), `P` a publication's (what it sends from). It composes the three
/// tables and does what crosses them: a lease holds its publications, a publication
/// its registration, and ending or releasing one lets go of what it held.
pub(crate) struct Ledger<L, P> {
    leases: LeaseTable<L>,
    pubs: PublicationTable<P>,
    regs: RegistrationTable,
    counts: LedgerCounts,
}

impl<L, P> Ledger<L, P> {
    /// An empty ledger.
    pub(crate) fn new(limits: LedgerLimits) -> Self {
        Ledger {
            leases: LeaseTable::new(&limits),
            pubs: PublicationTable::new(&limits),
            regs: RegistrationTable::default(),
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
        let mut out = Outcome::default();
        for id in self.leases.past_expiry(now) {
            out.absorb(self.end_lease(id, EndReason::Expired, now));
        }
        let freed = self.pubs.expire(now);
        out.absorb(self.report(freed));
        self.leases.prune(now);
        self.pubs.prune(now);
        out
    }

    /// Shutdown: every staged lease ends now, leases being staged or sent end when
    /// they come back, every live publication retires (`Shutdown`).
    pub(crate) fn release_all(&mut self, now: Instant) -> Outcome<L, P> {
        let mut out = Outcome::default();
        for id in self.leases.ids() {
            out.absorb(self.end_now_or_when_back(id, EndReason::Shutdown, now));
        }
        let freed = self.pubs.retire_all(ReleaseReason::Shutdown, now);
        out.absorb(self.report(freed));
        out
    }

    // Leases.

    /// Starts a lease: it holds its publications from now on (while its pages are
    /// filled). `fresh_id` draws ids until one is unused. Every publication must be
    /// live; those that are not are left out (the caller looked them up under the
    /// same lock, so none is).
    pub(crate) fn begin(&mut self, mut terms: LeaseTerms, fresh_id: impl FnMut() -> LeaseId) -> LeaseId {
        let id = self.leases.unused_id(fresh_id);
        terms.publications.retain(|p| self.pubs.hold(*p));
        self.leases.insert_staging(id, terms);
        id
    }

    /// Grants a lease begun with [`begin`](Self::begin): its payload (charged for
    /// `pages`) waits for a pull or `Done` until `now + ttl`. A lease whose end was
    /// decided while it was staged (shutdown, owner gone) ends at once instead: the
    /// outcome holds its payload and the grant is refused.
    pub(crate) fn grant(
        &mut self,
        id: LeaseId,
        payload: L,
        pages: usize,
        now: Instant,
        ttl: Duration,
    ) -> Result<(), Outcome<L, P>> {
        match self.leases.grant(id, payload, pages, now, ttl) {
            Grant::Granted => {
                self.counts.granted += 1;
                Ok(())
            }
            Grant::EndNow(reason) => Err(self.end_lease(id, reason, now)),
            Grant::Unknown => Err(Outcome::default()),
        }
    }

    /// Staging failed or was dropped before the grant: the lease ends (its
    /// publications are let go of).
    pub(crate) fn staging_failed(&mut self, id: LeaseId, now: Instant) -> Outcome<L, P> {
        if self.leases.is_staging(id) {
            self.end_lease(id, EndReason::StagingFailed, now)
        } else {
            Outcome::default()
        }
    }

    /// Checks a staged lease out for a send by `who`. Tied to `eager_conn` when given
    /// (an eager get: released after the grace if that connection closes without
    /// `Done`). A foreign request is refused (and counted); an expired lease ends.
    pub(crate) fn check_out(
        &mut self,
        id: LeaseId,
        who: &Who,
        eager_conn: Option<u64>,
        now: Instant,
    ) -> CheckOut<L, P> {
        match self.leases.check_out(id, who, eager_conn, now) {
            Pull::Out(payload) => CheckOut::Out(payload),
            Pull::Expired => CheckOut::Expired(self.end_lease(id, EndReason::Expired, now)),
            Pull::ExpiredEarlier => CheckOut::ExpiredEarlier,
            Pull::Refused(refusal) => {
                if refusal == LeaseRefusal::Foreign {
                    self.counts.foreign_refused += 1;
                }
                CheckOut::Refused(refusal)
            }
        }
    }

    /// A send gives its lease back: it waits again (a delayed pull may be retried) —
    /// unless an end was accepted while it was out or its TTL passed, and then it ends
    /// now.
    pub(crate) fn check_in(&mut self, id: LeaseId, payload: L, now: Instant) -> Outcome<L, P> {
        match self.leases.check_in(id, payload, now) {
            Some(reason) => self.end_lease(id, reason, now),
            None => Outcome::default(),
        }
    }

    /// A send dropped its lease (failed or cancelled; the payload is gone): the lease
    /// ends, by the end accepted meanwhile if any.
    pub(crate) fn send_dropped(&mut self, id: LeaseId, now: Instant) -> Outcome<L, P> {
        match self.leases.send_dropped(id) {
            Some(reason) => self.end_lease(id, reason, now),
            None => Outcome::default(),
        }
    }

    /// The owner's `Done`. A staged lease ends now; one checked out ends when its send
    /// gives it back. Either way the `Done` is accepted (and counted) now and retires
    /// the `once` publications the lease serves now: they leave the key table and a
    /// `Release` of their keys answers released; they are reported released when the
    /// lease ends. A foreign `Done` is refused (and counted); an unknown one changes
    /// nothing.
    pub(crate) fn done(&mut self, id: LeaseId, who: &Who, now: Instant) -> Result<Outcome<L, P>, LeaseRefusal> {
        let pubs = match self.leases.accept_done(id, who) {
            Ok(Some(pubs)) => pubs,
            // Already accepted while it is checked out.
            Ok(None) => return Ok(Outcome::default()),
            Err(refusal) => {
                if refusal == LeaseRefusal::Foreign {
                    self.counts.foreign_refused += 1;
                }
                return Err(refusal);
            }
        };
        self.counts.done += 1;
        let mut out = Outcome::default();
        for p in pubs {
            let freed = self.pubs.retire_once(p, now);
            out.absorb(self.report(freed));
        }
        // The lease itself ends now, or when its send gives it back.
        out.absorb(self.end_now_or_when_back(id, EndReason::Done, now));
        Ok(out)
    }

    /// The eager get on connection `conn` is gone: its leases waiting for `Done`
    /// expire `grace` from `now` at the latest. Returns how many. (A lease another
    /// connection of its owner is pulling at that instant keeps its TTL, the backstop.)
    pub(crate) fn orphan(&mut self, conn: u64, grace: Duration, now: Instant) -> usize {
        let n = self.leases.orphan(conn, grace, now);
        self.counts.orphaned += n as u64;
        n
    }

    /// Peer `owner` is gone: its staged leases end now, those being staged or sent
    /// when they come back. Returns how many leases it had. `owner` is the name the
    /// peer directory knows it by: the owner of its leases, or, under TLS, the peer id
    /// its connections claimed beside their certificate's identity (only the leases
    /// granted on such a connection end: others sharing that certificate keep theirs).
    pub(crate) fn release_peer(&mut self, owner: &str, now: Instant) -> (usize, Outcome<L, P>) {
        let ids = self.leases.of_peer(owner);
        let mut out = Outcome::default();
        for &id in &ids {
            out.absorb(self.end_now_or_when_back(id, EndReason::PeerGone, now));
        }
        (ids.len(), out)
    }

    fn end_now_or_when_back(&mut self, id: LeaseId, reason: EndReason, now: Instant) -> Outcome<L, P> {
        if self.leases.end_when_back(id, reason) {
            self.end_lease(id, reason, now)
        } else {
            Outcome::default()
        }
    }

    /// Ends a staged (or staging) lease: its payload goes to the outcome, its
    /// publications are let go of.
    fn end_lease(&mut self, id: LeaseId, reason: EndReason, now: Instant) -> Outcome<L, P> {
        let Some((ended, pubs)) = self.leases.remove(id, reason, now) else {
            return Outcome::default();
        };
        if reason == EndReason::Expired {
            self.counts.expired += 1;
        }
        let mut out = Outcome::default();
        out.ended.push(ended);
        for p in pubs {
            let freed = self.pubs.unhold(p);
            out.absorb(self.report(freed));
        }
        out
    }

    /// Leases waiting for a pull or `Done` (not counting those being staged or sent).
    pub(crate) fn staged_now(&self) -> usize {
        self.leases.staged_now()
    }

    /// Leases in any state.
    #[cfg(test)]
    pub(crate) fn leases_now(&self) -> usize {
        self.leases.len()
    }

    /// Staging pages held by `owner`'s leases (staged or checked out).
    pub(crate) fn pages_held_by(&self, owner: &str) -> usize {
        self.leases.pages_held_by(owner)
    }

    /// Staging pages held by every lease.
    #[cfg(test)]
    pub(crate) fn pages_held(&self) -> usize {
        self.leases.pages_held()
    }

    /// The state of lease `id`, for tests: "staging", "staged", "out" or none.
    #[cfg(test)]
    pub(crate) fn lease_state(&self, id: LeaseId) -> Option<&'static str> {
        self.leases.state(id)
    }

    /// When lease `id` expires, for tests.
    #[cfg(test)]
    pub(crate) fn lease_expiry(&self, id: LeaseId) -> Option<Instant> {
        self.leases.expiry(id)
    }

    // Publications.

    /// Publishes `payload` under `key` until `expires`; `once`: retired by the first
    /// `Done` of a lease that served it (or a `Release`). Holds registration `reg`
    /// (refused if it is not registered or is being deregistered). A live publication
    /// under the same key is retired (`Replaced`).
    pub(crate) fn publish(
        &mut self,
        key: ChunkKey,
        payload: P,
        once: bool,
        expires: Instant,
        reg: Option<RegId>,
        now: Instant,
    ) -> Result<(PubId, Outcome<L, P>), RegError> {
        if let Some(r) = reg {
            self.regs.hold(r)?;
        }
        let (id, freed) = self.pubs.publish(key, payload, once, expires, reg, now);
        Ok((id, self.report(freed)))
    }

    /// The engine's own release of `key`'s live publication (`Released`); `None` if
    /// none is live.
    pub(crate) fn unpublish(&mut self, key: &ChunkKey, now: Instant) -> Option<Outcome<L, P>> {
        let id = self.pubs.live(key)?;
        let freed = self.pubs.retire(id, ReleaseReason::Released, now);
        Some(self.report(freed))
    }

    /// A consumer's `Release` of `keys`: a live `once` publication retires
    /// (`Declined`) and answers true; so does a key whose publication was retired
    /// recently (for any reason: its blocks are, or will be, released). A live
    /// publication many may read, and an unknown key, answer false.
    pub(crate) fn release_keys(&mut self, keys: &[ChunkKey], now: Instant) -> (Vec<bool>, Outcome<L, P>) {
        let (answers, freed) = self.pubs.release_keys(keys, now);
        (answers, self.report(freed))
    }

    /// The leading live, unexpired publications of `keys`, with their ids.
    pub(crate) fn lookup(&self, keys: &[ChunkKey], now: Instant) -> Vec<(PubId, &P)> {
        self.pubs.lookup(keys, now)
    }

    /// Live publications (in the key table) now.
    pub(crate) fn published_now(&self) -> usize {
        self.pubs.published_now()
    }

    /// Publications not yet released (live, or retired and still held by a lease).
    #[cfg(test)]
    pub(crate) fn publications_held(&self) -> usize {
        self.pubs.len()
    }

    /// Whether publication `id` is live, retired but held, or gone, for tests.
    #[cfg(test)]
    pub(crate) fn publication_state(&self, id: PubId) -> Option<(bool, usize)> {
        self.pubs.state(id)
    }

    /// Reports publications the table released, in order, each letting go of its
    /// registration (which may complete that registration's deregistration).
    fn report(&mut self, freed: impl IntoIterator<Item = Freed<P>>) -> Outcome<L, P> {
        let mut out = Outcome::default();
        for f in freed {
            out.released.push((f.released, f.payload));
            if let Some(done) = f.reg.and_then(|r| self.regs.unhold(r)) {
                out.deregistered.push(done);
            }
        }
        out
    }

    // Registrations.

    /// Registers `id` with no holders.
    pub(crate) fn register(&mut self, id: RegId) -> Result<(), RegError> {
        self.regs.register(id)
    }

    /// One more holder of `id`.
    pub(crate) fn hold(&mut self, id: RegId) -> Result<(), RegError> {
        self.regs.hold(id)
    }

    /// One holder of `id` fewer; `Some(id)` when that completed its deregistration.
    pub(crate) fn unhold(&mut self, id: RegId) -> Option<RegId> {
        self.regs.unhold(id)
    }

    /// Starts deregistering `id`: done at once without holders, else pending until the
    /// last holder lets go (no new holder is admitted meanwhile).
    pub(crate) fn deregister(&mut self, id: RegId) -> Result<Deregistration, RegError> {
        self.regs.deregister(id)
    }

    /// A pending deregistration gave up: `id` stays registered (and may be held
    /// again). Returns its holders; `None` if it completed meanwhile (or is unknown).
    pub(crate) fn abandon_deregister(&mut self, id: RegId) -> Option<usize> {
        self.regs.abandon_deregister(id)
    }

    /// Holders of `id` now (`None`: not registered).
    pub(crate) fn holders(&self, id: RegId) -> Option<usize> {
        self.regs.holders(id)
    }
}
