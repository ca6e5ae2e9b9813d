//! Staged leases in the ledger: granted, checked out for a send, checked in, ended by
//! `Done`, expiry, an orphaned eager get, the owner leaving, or shutdown.
//!
//! # Cancellation
//!
//! Nothing here waits; see the module above for how a dropped send reports.

use std::time::Duration;

use tokio::time::Instant;

use super::{EndReason, Ended, LeaseRefusal, Ledger, Outcome, PubId, Who};
use crate::wire::LeaseId;

/// What a new lease is: its owner and the publications it serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct LeaseTerms {
    /// The identity it is granted to.
    pub owner: String,
    /// Without TLS, the incarnation of the peer it is granted to (`None`: bound to a
    /// certificate identity, or granted locally).
    pub owner_incarnation: Option<u64>,
    /// Under TLS, the peer id its owner's connection claimed, when it differs from the
    /// certificate's identity (see [`Ledger::release_peer`]).
    pub claimed_by: Option<String>,
    /// The publications it sends (held until it ends; empty for store chunks).
    pub publications: Vec<PubId>,
}

/// Where a lease is.
#[derive(Debug)]
enum State<L> {
    /// Its pages are being filled; the staging task holds what it gathers.
    Staging,
    /// Waiting for a pull or `Done`; the ledger holds its payload.
    Staged(L),
    /// A send holds its payload.
    CheckedOut,
}

#[derive(Debug)]
pub(super) struct LeaseRecord<L> {
    terms: LeaseTerms,
    state: State<L>,
    /// Set once granted.
    expires: Option<Instant>,
    /// Staging pages its payload is charged for.
    pages: usize,
    /// The connection of the eager get that holds it.
    eager_conn: Option<u64>,
    /// Accepted while staging or checked out; takes effect when it comes back.
    end_pending: Option<EndReason>,
}

impl<L> LeaseRecord<L> {
    fn belongs_to(&self, who: &Who) -> bool {
        match who {
            Who::Local(identity) => self.terms.owner == *identity,
            Who::Remote { identity, incarnation } => {
                self.terms.owner == *identity && self.terms.owner_incarnation.is_none_or(|i| Some(i) == *incarnation)
            }
        }
    }

    /// Records `reason` to take effect when the lease comes back (the first reason
    /// accepted wins).
    fn end_when_back(&mut self, reason: EndReason) {
        self.end_pending.get_or_insert(reason);
    }
}

/// A pull's check-out.
#[derive(Debug)]
pub(crate) enum CheckOut<L, P> {
    /// The payload, now the send's (give it back with `check_in`, or report its drop
    /// with `send_dropped`).
    Out(L),
    /// Expired: it ended now (the outcome holds its payload).
    Expired(Outcome<L, P>),
    /// Expired a while ago (remembered), so it is gone.
    ExpiredEarlier,
    /// Not checked out.
    Refused(LeaseRefusal),
}

impl<L, P> Ledger<L, P> {
    /// Starts a lease: it holds its publications from now on (while its pages are
    /// filled). `fresh_id` draws ids until one is unused. Every publication must be
    /// live; those that are not are left out (the caller looked them up under the
    /// same lock, so none is).
    pub(crate) fn begin(&mut self, mut terms: LeaseTerms, mut fresh_id: impl FnMut() -> LeaseId) -> LeaseId {
        let id = loop {
            let id = fresh_id();
            if id != 0 && !self.leases.contains_key(&id) {
                break id;
            }
        };
        terms.publications.retain(|p| self.hold_publication(*p));
        self.leases.insert(
            id,
            LeaseRecord {
                terms,
                state: State::Staging,
                expires: None,
                pages: 0,
                eager_conn: None,
                end_pending: None,
            },
        );
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
        let Some(rec) = self.leases.get_mut(&id) else {
            debug_assert!(false, "grant of an unknown lease");
            return Err(Outcome::default());
        };
        debug_assert!(matches!(rec.state, State::Staging), "grant of a lease not staging");
        rec.pages = pages;
        rec.expires = Some(now + ttl);
        if let Some(reason) = rec.end_pending {
            rec.state = State::Staged(payload);
            return Err(self.end_lease(id, reason, now));
        }
        rec.state = State::Staged(payload);
        self.counts.granted += 1;
        Ok(())
    }

    /// Staging failed or was dropped before the grant: the lease ends (its
    /// publications are let go of).
    pub(crate) fn staging_failed(&mut self, id: LeaseId, now: Instant) -> Outcome<L, P> {
        match self.leases.get(&id) {
            Some(rec) if matches!(rec.state, State::Staging) => self.end_lease(id, EndReason::StagingFailed, now),
            _ => Outcome::default(),
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
        let Some(rec) = self.leases.get_mut(&id) else {
            if self.recent_expired.contains(&id, now) {
                return CheckOut::ExpiredEarlier;
            }
            return CheckOut::Refused(LeaseRefusal::Unknown);
        };
        if !rec.belongs_to(who) {
            self.counts.foreign_refused += 1;
            return CheckOut::Refused(LeaseRefusal::Foreign);
        }
        if !matches!(rec.state, State::Staged(_)) {
            // Being staged, or already being sent on another request.
            return CheckOut::Refused(LeaseRefusal::Unknown);
        }
        if rec.expires.is_some_and(|e| e <= now) {
            return CheckOut::Expired(self.end_lease(id, EndReason::Expired, now));
        }
        if eager_conn.is_some() {
            rec.eager_conn = eager_conn;
        }
        match std::mem::replace(&mut rec.state, State::CheckedOut) {
            State::Staged(payload) => CheckOut::Out(payload),
            _ => unreachable!("checked above"),
        }
    }

    /// A send gives its lease back: it waits again (a delayed pull may be retried) —
    /// unless an end was accepted while it was out or its TTL passed, and then it ends
    /// now.
    pub(crate) fn check_in(&mut self, id: LeaseId, payload: L, now: Instant) -> Outcome<L, P> {
        let Some(rec) = self.leases.get_mut(&id) else {
            debug_assert!(false, "check-in of an unknown lease");
            return Outcome::default();
        };
        debug_assert!(
            matches!(rec.state, State::CheckedOut),
            "check-in of a lease not checked out"
        );
        rec.state = State::Staged(payload);
        if let Some(reason) = rec.end_pending {
            return self.end_lease(id, reason, now);
        }
        if rec.expires.is_some_and(|e| e <= now) {
            return self.end_lease(id, EndReason::Expired, now);
        }
        Outcome::default()
    }

    /// A send dropped its lease (failed or cancelled; the payload is gone): the lease
    /// ends, by the end accepted meanwhile if any.
    pub(crate) fn send_dropped(&mut self, id: LeaseId, now: Instant) -> Outcome<L, P> {
        match self.leases.get(&id) {
            Some(rec) if matches!(rec.state, State::CheckedOut) => {
                let reason = rec.end_pending.unwrap_or(EndReason::SendDropped);
                self.end_lease(id, reason, now)
            }
            _ => {
                debug_assert!(false, "drop of a lease not checked out");
                Outcome::default()
            }
        }
    }

    /// The owner's `Done`. A staged lease ends now; one checked out ends when its send
    /// gives it back. Either way the `Done` is accepted (and counted) now and retires
    /// the `once` publications the lease serves now: they leave the key table and a
    /// `Release` of their keys answers released; they are reported released when the
    /// lease ends. A foreign `Done` is refused (and counted); an unknown one changes
    /// nothing.
    pub(crate) fn done(&mut self, id: LeaseId, who: &Who, now: Instant) -> Result<Outcome<L, P>, LeaseRefusal> {
        let Some(rec) = self.leases.get_mut(&id) else {
            return Err(LeaseRefusal::Unknown);
        };
        if !rec.belongs_to(who) {
            self.counts.foreign_refused += 1;
            return Err(LeaseRefusal::Foreign);
        }
        match rec.state {
            // Its id has not been given out yet.
            State::Staging => return Err(LeaseRefusal::Unknown),
            State::CheckedOut if rec.end_pending == Some(EndReason::Done) => return Ok(Outcome::default()),
            _ => {}
        }
        self.counts.done += 1;
        let pubs = rec.terms.publications.clone();
        let mut out = Outcome::default();
        for p in pubs {
            out.absorb(self.retire_once(p, now));
        }
        // The lease itself ends now, or when its send gives it back.
        out.absorb(self.end_now_or_when_back(id, EndReason::Done, now));
        Ok(out)
    }

    /// Staged leases past their expiry end.
    pub(super) fn expire_leases(&mut self, now: Instant) -> Outcome<L, P> {
        let ids: Vec<LeaseId> = self
            .leases
            .iter()
            .filter(|(_, r)| matches!(r.state, State::Staged(_)) && r.expires.is_some_and(|e| e <= now))
            .map(|(id, _)| *id)
            .collect();
        let mut out = Outcome::default();
        for id in ids {
            out.absorb(self.end_lease(id, EndReason::Expired, now));
        }
        out
    }

    /// The eager get on connection `conn` is gone: its leases waiting for `Done`
    /// expire `grace` from `now` at the latest. Returns how many. (A lease another
    /// connection of its owner is pulling at that instant keeps its TTL, the backstop.)
    pub(crate) fn orphan(&mut self, conn: u64, grace: Duration, now: Instant) -> usize {
        let until = now + grace;
        let mut n = 0;
        for rec in self.leases.values_mut() {
            if rec.eager_conn == Some(conn) && matches!(rec.state, State::Staged(_)) {
                rec.eager_conn = None;
                rec.expires = Some(rec.expires.map_or(until, |e| e.min(until)));
                n += 1;
            }
        }
        self.counts.orphaned += n as u64;
        n
    }

    /// Peer `owner` is gone: its staged leases end now, those being staged or sent
    /// when they come back. Returns how many leases it had. `owner` is the name the
    /// peer directory knows it by: the owner of its leases, or, under TLS, the peer id
    /// its connections claimed beside their certificate's identity (only the leases
    /// granted on such a connection end: others sharing that certificate keep theirs).
    pub(crate) fn release_peer(&mut self, owner: &str, now: Instant) -> (usize, Outcome<L, P>) {
        let ids: Vec<LeaseId> = self
            .leases
            .iter()
            .filter(|(_, r)| match &r.terms.claimed_by {
                Some(claimed) => claimed == owner,
                None => r.terms.owner == owner,
            })
            .map(|(id, _)| *id)
            .collect();
        let mut out = Outcome::default();
        for &id in &ids {
            out.absorb(self.end_now_or_when_back(id, EndReason::PeerGone, now));
        }
        (ids.len(), out)
    }

    pub(super) fn end_all_leases(&mut self, now: Instant) -> Outcome<L, P> {
        let ids: Vec<LeaseId> = self.leases.keys().copied().collect();
        let mut out = Outcome::default();
        for id in ids {
            out.absorb(self.end_now_or_when_back(id, EndReason::Shutdown, now));
        }
        out
    }

    fn end_now_or_when_back(&mut self, id: LeaseId, reason: EndReason, now: Instant) -> Outcome<L, P> {
        let rec = self.leases.get_mut(&id).expect("present");
        if matches!(rec.state, State::Staged(_)) {
            self.end_lease(id, reason, now)
        } else {
            rec.end_when_back(reason);
            Outcome::default()
        }
    }

    /// Ends a staged (or staging) lease: its payload goes to the outcome, its
    /// publications are let go of.
    fn end_lease(&mut self, id: LeaseId, reason: EndReason, now: Instant) -> Outcome<L, P> {
        let Some(rec) = self.leases.remove(&id) else {
            return Outcome::default();
        };
        let payload = match rec.state {
            State::Staged(p) => Some(p),
            State::Staging | State::CheckedOut => None,
        };
        if reason == EndReason::Expired {
            self.counts.expired += 1;
            self.recent_expired.note(id, now);
        }
        let mut out = Outcome::default();
        out.ended.push(Ended {
            id,
            payload,
            reason,
            pages: rec.pages,
        });
        for p in rec.terms.publications {
            out.absorb(self.unhold_publication(p, now));
        }
        out
    }

    /// Leases waiting for a pull or `Done` (not counting those being staged or sent).
    pub(crate) fn staged_now(&self) -> usize {
        self.leases
            .values()
            .filter(|r| matches!(r.state, State::Staged(_)))
            .count()
    }

    /// Leases in any state.
    #[cfg(test)]
    pub(crate) fn leases_now(&self) -> usize {
        self.leases.len()
    }

    /// Staging pages held by `owner`'s leases (staged or checked out).
    pub(crate) fn pages_held_by(&self, owner: &str) -> usize {
        self.leases
            .values()
            .filter(|r| r.terms.owner == owner)
            .map(|r| r.pages)
            .sum()
    }

    /// Staging pages held by every lease.
    #[cfg(test)]
    pub(crate) fn pages_held(&self) -> usize {
        self.leases.values().map(|r| r.pages).sum()
    }

    /// The state of lease `id`, for tests: "staging", "staged", "out" or none.
    #[cfg(test)]
    pub(crate) fn lease_state(&self, id: LeaseId) -> Option<&'static str> {
        self.leases.get(&id).map(|r| match r.state {
            State::Staging => "staging",
            State::Staged(_) => "staged",
            State::CheckedOut => "out",
        })
    }

    /// When lease `id` expires, for tests.
    #[cfg(test)]
    pub(crate) fn lease_expiry(&self, id: LeaseId) -> Option<Instant> {
        self.leases.get(&id).and_then(|r| r.expires)
    }
}
