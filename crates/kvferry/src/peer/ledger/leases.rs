//! The lease table: each staged lease's terms, state (staging, staged, checked out),
//! expiry, pages, eager connection and the end accepted while it is away, and the
//! memory of leases that expired. It decides when a lease ends; the
//! [`Ledger`](super::Ledger) ends it, letting go of the publications it holds.
//!
//! # Cancellation
//!
//! Nothing here waits; see the module above for how a dropped send reports.

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

use super::recent::Recent;
use super::vocab::{EndReason, Ended, LeaseRefusal, LedgerLimits, Outcome, PubId, Who};
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
    /// certificate's identity (see [`Ledger::release_peer`](super::Ledger::release_peer)).
    pub claimed_by: Option<String>,
    /// The publications it sends (held until it ends; empty for store chunks).
    pub publications: Vec<PubId>,
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

/// What the table made of a grant.
#[derive(Debug)]
pub(super) enum Grant {
    /// Granted: it waits for a pull or `Done`.
    Granted,
    /// An end was accepted while it was staged: it ends now, for this reason.
    EndNow(EndReason),
    /// No such lease.
    Unknown,
}

/// What the table made of a pull.
#[derive(Debug)]
pub(super) enum Pull<L> {
    /// Checked out: the payload is the send's.
    Out(L),
    /// Staged past its expiry: it ends now.
    Expired,
    /// Expired a while ago (remembered).
    ExpiredEarlier,
    /// Not checked out.
    Refused(LeaseRefusal),
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
struct LeaseRecord<L> {
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
}

/// The leases of one ledger, in any state, and the ids of those that expired recently.
#[derive(Debug)]
pub(super) struct LeaseTable<L> {
    leases: HashMap<LeaseId, LeaseRecord<L>>,
    /// Expired recently: a late pull answers "expired", not "unknown".
    recent_expired: Recent<LeaseId>,
}

impl<L> LeaseTable<L> {
    /// No leases.
    pub(super) fn new(limits: &LedgerLimits) -> Self {
        LeaseTable {
            leases: HashMap::new(),
            recent_expired: Recent::new(limits.recent_expired, limits.recent_window),
        }
    }

    /// Draws ids from `fresh_id` until one is nonzero and unused.
    pub(super) fn unused_id(&self, mut fresh_id: impl FnMut() -> LeaseId) -> LeaseId {
        loop {
            let id = fresh_id();
            if id != 0 && !self.leases.contains_key(&id) {
                return id;
            }
        }
    }

    /// Records lease `id` as staging under `terms`.
    pub(super) fn insert_staging(&mut self, id: LeaseId, terms: LeaseTerms) {
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
    }

    /// A staging lease's payload (charged for `pages`) is ready: it is staged until
    /// `now + ttl`, unless an end accepted meanwhile says it ends now.
    pub(super) fn grant(&mut self, id: LeaseId, payload: L, pages: usize, now: Instant, ttl: Duration) -> Grant {
        let Some(rec) = self.leases.get_mut(&id) else {
            debug_assert!(false, "grant of an unknown lease");
            return Grant::Unknown;
        };
        debug_assert!(matches!(rec.state, State::Staging), "grant of a lease not staging");
        rec.pages = pages;
        rec.expires = Some(now + ttl);
        rec.state = State::Staged(payload);
        match rec.end_pending {
            Some(reason) => Grant::EndNow(reason),
            None => Grant::Granted,
        }
    }

    /// True if lease `id` is being staged.
    pub(super) fn is_staging(&self, id: LeaseId) -> bool {
        self.leases.get(&id).is_some_and(|r| matches!(r.state, State::Staging))
    }

    /// Checks staged lease `id` out for a send by `who`, tied to `eager_conn` when
    /// given. Checked in this order: unknown (or expired earlier), foreign, not staged,
    /// past its expiry.
    pub(super) fn check_out(&mut self, id: LeaseId, who: &Who, eager_conn: Option<u64>, now: Instant) -> Pull<L> {
        let Some(rec) = self.leases.get_mut(&id) else {
            if self.recent_expired.contains(&id, now) {
                return Pull::ExpiredEarlier;
            }
            return Pull::Refused(LeaseRefusal::Unknown);
        };
        if !rec.belongs_to(who) {
            return Pull::Refused(LeaseRefusal::Foreign);
        }
        if !matches!(rec.state, State::Staged(_)) {
            // Being staged, or already being sent on another request.
            return Pull::Refused(LeaseRefusal::Unknown);
        }
        if rec.expires.is_some_and(|e| e <= now) {
            return Pull::Expired;
        }
        if eager_conn.is_some() {
            rec.eager_conn = eager_conn;
        }
        match std::mem::replace(&mut rec.state, State::CheckedOut) {
            State::Staged(payload) => Pull::Out(payload),
            _ => unreachable!("checked above"),
        }
    }

    /// A send gives lease `id` back: it is staged again. Returns why it ends now, if
    /// it does: the end accepted while it was out, else its expiry if that passed.
    pub(super) fn check_in(&mut self, id: LeaseId, payload: L, now: Instant) -> Option<EndReason> {
        let Some(rec) = self.leases.get_mut(&id) else {
            debug_assert!(false, "check-in of an unknown lease");
            return None;
        };
        debug_assert!(
            matches!(rec.state, State::CheckedOut),
            "check-in of a lease not checked out"
        );
        rec.state = State::Staged(payload);
        if let Some(reason) = rec.end_pending {
            return Some(reason);
        }
        rec.expires.is_some_and(|e| e <= now).then_some(EndReason::Expired)
    }

    /// A send dropped lease `id`: why it ends (the end accepted meanwhile, else
    /// `SendDropped`); `None` if it was not checked out.
    pub(super) fn send_dropped(&self, id: LeaseId) -> Option<EndReason> {
        match self.leases.get(&id) {
            Some(rec) if matches!(rec.state, State::CheckedOut) => {
                Some(rec.end_pending.unwrap_or(EndReason::SendDropped))
            }
            _ => {
                debug_assert!(false, "drop of a lease not checked out");
                None
            }
        }
    }

    /// Whether `who`'s `Done` of lease `id` is accepted: the publications the lease
    /// serves, or `None` when a `Done` was already accepted while it is checked out
    /// (nothing new). Refused when unknown, still staging, or foreign.
    pub(super) fn accept_done(&self, id: LeaseId, who: &Who) -> Result<Option<Vec<PubId>>, LeaseRefusal> {
        let rec = self.leases.get(&id).ok_or(LeaseRefusal::Unknown)?;
        if !rec.belongs_to(who) {
            return Err(LeaseRefusal::Foreign);
        }
        match rec.state {
            // Its id has not been given out yet.
            State::Staging => Err(LeaseRefusal::Unknown),
            State::CheckedOut if rec.end_pending == Some(EndReason::Done) => Ok(None),
            _ => Ok(Some(rec.terms.publications.clone())),
        }
    }

    /// Lease `id` is to end with `reason`: true if it is staged (the caller ends it
    /// now); else `reason` takes effect when it comes back (the first accepted wins).
    pub(super) fn end_when_back(&mut self, id: LeaseId, reason: EndReason) -> bool {
        let rec = self.leases.get_mut(&id).expect("present");
        if matches!(rec.state, State::Staged(_)) {
            return true;
        }
        rec.end_pending.get_or_insert(reason);
        false
    }

    /// Staged leases past their expiry.
    pub(super) fn past_expiry(&self, now: Instant) -> Vec<LeaseId> {
        self.leases
            .iter()
            .filter(|(_, r)| matches!(r.state, State::Staged(_)) && r.expires.is_some_and(|e| e <= now))
            .map(|(id, _)| *id)
            .collect()
    }

    /// Staged leases of the eager get on `conn` expire by `now + grace` at the latest
    /// and are no longer tied to it. Returns how many.
    pub(super) fn orphan(&mut self, conn: u64, grace: Duration, now: Instant) -> usize {
        let until = now + grace;
        let mut n = 0;
        for rec in self.leases.values_mut() {
            if rec.eager_conn == Some(conn) && matches!(rec.state, State::Staged(_)) {
                rec.eager_conn = None;
                rec.expires = Some(rec.expires.map_or(until, |e| e.min(until)));
                n += 1;
            }
        }
        n
    }

    /// Leases of the peer the directory knows as `owner`: granted to it, or, under
    /// TLS, on a connection that claimed that peer id.
    pub(super) fn of_peer(&self, owner: &str) -> Vec<LeaseId> {
        self.leases
            .iter()
            .filter(|(_, r)| match &r.terms.claimed_by {
                Some(claimed) => claimed == owner,
                None => r.terms.owner == owner,
            })
            .map(|(id, _)| *id)
            .collect()
    }

    /// Every lease.
    pub(super) fn ids(&self) -> Vec<LeaseId> {
        self.leases.keys().copied().collect()
    }

    /// Removes lease `id`, ended for `reason` (remembered if it expired): what ended,
    /// and the publications it held.
    pub(super) fn remove(&mut self, id: LeaseId, reason: EndReason, now: Instant) -> Option<(Ended<L>, Vec<PubId>)> {
        let rec = self.leases.remove(&id)?;
        let payload = match rec.state {
            State::Staged(p) => Some(p),
            State::Staging | State::CheckedOut => None,
        };
        if reason == EndReason::Expired {
            self.recent_expired.note(id, now);
        }
        let ended = Ended {
            id,
            payload,
            reason,
            pages: rec.pages,
        };
        Some((ended, rec.terms.publications))
    }

    /// Forgets leases that expired longer ago than the window.
    pub(super) fn prune(&mut self, now: Instant) {
        self.recent_expired.prune(now);
    }

    /// Leases staged now.
    pub(super) fn staged_now(&self) -> usize {
        self.leases
            .values()
            .filter(|r| matches!(r.state, State::Staged(_)))
            .count()
    }

    /// Leases in any state.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.leases.len()
    }

    /// Staging pages held by `owner`'s leases.
    pub(super) fn pages_held_by(&self, owner: &str) -> usize {
        self.leases
            .values()
            .filter(|r| r.terms.owner == owner)
            .map(|r| r.pages)
            .sum()
    }

    /// Staging pages held by every lease.
    #[cfg(test)]
    pub(super) fn pages_held(&self) -> usize {
        self.leases.values().map(|r| r.pages).sum()
    }

    /// The state of lease `id`: "staging", "staged", "out" or none.
    #[cfg(test)]
    pub(super) fn state(&self, id: LeaseId) -> Option<&'static str> {
        self.leases.get(&id).map(|r| match r.state {
            State::Staging => "staging",
            State::Staged(_) => "staged",
            State::CheckedOut => "out",
        })
    }

    /// When lease `id` expires.
    #[cfg(test)]
    pub(super) fn expiry(&self, id: LeaseId) -> Option<Instant> {
        self.leases.get(&id).and_then(|r| r.expires)
    }
}
