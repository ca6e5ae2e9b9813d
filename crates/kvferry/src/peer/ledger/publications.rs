//! The publication table: each publication by id, the key table of live ones, how
//! many leases hold each, why it was retired, and the keys retired recently.
//! Publications are published, looked up, held by leases, retired (by a `Done`, a
//! `Release`, expiry, unpublish, replacement or shutdown) and released when no lease
//! holds them any more; the [`Ledger`](super::Ledger) reports what this table
//! releases and lets go of its registration.
//!
//! # Cancellation
//!
//! Nothing here waits.

use std::collections::HashMap;

use tokio::time::Instant;

use super::recent::Recent;
use super::vocab::{LedgerLimits, PubId, RegId};
use crate::peer::publish::{ReleaseReason, Released};
use crate::wire::ChunkKey;

#[derive(Debug)]
struct PubRecord<P> {
    key: ChunkKey,
    payload: P,
    once: bool,
    expires: Instant,
    /// Leases holding it (in any state).
    holders: usize,
    /// Set once retired: it left the key table and is released when `holders` is 0.
    retired: Option<ReleaseReason>,
    /// The registration it holds.
    reg: Option<RegId>,
}

/// A publication released (retired, and no lease holds it): it left the table.
#[derive(Debug)]
pub(super) struct Freed<P> {
    /// Its key and why it was retired.
    pub(super) released: Released,
    /// What it sent from.
    pub(super) payload: P,
    /// The registration it held, now to be unheld.
    pub(super) reg: Option<RegId>,
}

/// The publications of one ledger not yet released.
#[derive(Debug)]
pub(super) struct PublicationTable<P> {
    pubs: HashMap<PubId, PubRecord<P>>,
    /// Live publications by key.
    by_key: HashMap<ChunkKey, PubId>,
    next_pub: u64,
    /// Retired recently: a late `Release` answers "released".
    recent_retired: Recent<ChunkKey>,
}

impl<P> PublicationTable<P> {
    /// No publications.
    pub(super) fn new(limits: &LedgerLimits) -> Self {
        PublicationTable {
            pubs: HashMap::new(),
            by_key: HashMap::new(),
            next_pub: 1,
            recent_retired: Recent::new(limits.recent_retired, limits.recent_window),
        }
    }

    /// Publishes `payload` under `key` (see [`Ledger::publish`](super::Ledger::publish);
    /// the caller holds `reg` for it). A live publication under the same key is
    /// retired (`Replaced`); returned if that released it.
    pub(super) fn publish(
        &mut self,
        key: ChunkKey,
        payload: P,
        once: bool,
        expires: Instant,
        reg: Option<RegId>,
        now: Instant,
    ) -> (PubId, Option<Freed<P>>) {
        let id = PubId(self.next_pub);
        self.next_pub += 1;
        let freed = match self.by_key.get(&key).copied() {
            Some(old) => self.retire(old, ReleaseReason::Replaced, now),
            None => None,
        };
        self.pubs.insert(
            id,
            PubRecord {
                key,
                payload,
                once,
                expires,
                holders: 0,
                retired: None,
                reg,
            },
        );
        self.by_key.insert(key, id);
        (id, freed)
    }

    /// `key`'s live publication.
    pub(super) fn live(&self, key: &ChunkKey) -> Option<PubId> {
        self.by_key.get(key).copied()
    }

    /// A consumer's `Release` of `keys` (see [`Ledger::release_keys`](super::Ledger::release_keys)):
    /// the answers, and what the retirements released, in key order.
    pub(super) fn release_keys(&mut self, keys: &[ChunkKey], now: Instant) -> (Vec<bool>, Vec<Freed<P>>) {
        let mut freed = Vec::new();
        let answers = keys
            .iter()
            .map(|k| match self.by_key.get(k).copied() {
                Some(id) if self.pubs[&id].once => {
                    freed.extend(self.retire(id, ReleaseReason::Declined, now));
                    true
                }
                Some(_) => false,
                None => self.recent_retired.contains(k, now),
            })
            .collect();
        (answers, freed)
    }

    /// The leading live, unexpired publications of `keys`, with their ids.
    pub(super) fn lookup(&self, keys: &[ChunkKey], now: Instant) -> Vec<(PubId, &P)> {
        keys.iter()
            .map_while(|k| {
                let id = *self.by_key.get(k)?;
                let p = &self.pubs[&id];
                (p.expires > now).then_some((id, &p.payload))
            })
            .collect()
    }

    /// Live publications (in the key table) now.
    pub(super) fn published_now(&self) -> usize {
        self.by_key.len()
    }

    /// Publications not yet released.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.pubs.len()
    }

    /// Live publications past their expiry retire (`Expired`); returns those released.
    pub(super) fn expire(&mut self, now: Instant) -> Vec<Freed<P>> {
        let ids: Vec<PubId> = self
            .by_key
            .values()
            .copied()
            .filter(|id| self.pubs[id].expires <= now)
            .collect();
        self.retire_each(ids, ReleaseReason::Expired, now)
    }

    /// Every live publication retires with `reason`; returns those released.
    pub(super) fn retire_all(&mut self, reason: ReleaseReason, now: Instant) -> Vec<Freed<P>> {
        let ids: Vec<PubId> = self.by_key.values().copied().collect();
        self.retire_each(ids, reason, now)
    }

    fn retire_each(&mut self, ids: Vec<PubId>, reason: ReleaseReason, now: Instant) -> Vec<Freed<P>> {
        ids.into_iter().filter_map(|id| self.retire(id, reason, now)).collect()
    }

    /// Retires `id` if it is `once` and still live (a `Done` of a lease serving it).
    pub(super) fn retire_once(&mut self, id: PubId, now: Instant) -> Option<Freed<P>> {
        match self.pubs.get(&id) {
            Some(p) if p.once && p.retired.is_none() => self.retire(id, ReleaseReason::Done, now),
            _ => None,
        }
    }

    /// Retires a live publication: it leaves the key table now (no new lease gets
    /// it) and is released once no lease holds it. Retiring it again changes nothing.
    pub(super) fn retire(&mut self, id: PubId, reason: ReleaseReason, now: Instant) -> Option<Freed<P>> {
        let p = self.pubs.get_mut(&id)?;
        if p.retired.is_some() {
            return None;
        }
        p.retired = Some(reason);
        let key = p.key;
        if self.by_key.get(&key) == Some(&id) {
            self.by_key.remove(&key);
        }
        self.recent_retired.note(key, now);
        self.release_if_free(id)
    }

    /// A lease starts holding `id`; false if it is not live.
    pub(super) fn hold(&mut self, id: PubId) -> bool {
        match self.pubs.get_mut(&id) {
            Some(p) if p.retired.is_none() => {
                p.holders += 1;
                true
            }
            _ => false,
        }
    }

    /// A lease that held `id` ended; returns it if that released it.
    pub(super) fn unhold(&mut self, id: PubId) -> Option<Freed<P>> {
        match self.pubs.get_mut(&id) {
            Some(p) => {
                debug_assert!(p.holders > 0, "publication unheld more than held");
                p.holders = p.holders.saturating_sub(1);
                self.release_if_free(id)
            }
            None => {
                debug_assert!(false, "a lease held a released publication");
                None
            }
        }
    }

    /// Releases `id` if it is retired and no lease holds it.
    fn release_if_free(&mut self, id: PubId) -> Option<Freed<P>> {
        let free = self
            .pubs
            .get(&id)
            .is_some_and(|p| p.holders == 0 && p.retired.is_some());
        if !free {
            return None;
        }
        let p = self.pubs.remove(&id).expect("present");
        Some(Freed {
            released: Released {
                key: p.key,
                reason: p.retired.expect("retired"),
            },
            payload: p.payload,
            reg: p.reg,
        })
    }

    /// Forgets keys retired longer ago than the window.
    pub(super) fn prune(&mut self, now: Instant) {
        self.recent_retired.prune(now);
    }

    /// Whether publication `id` is live, and its holders; `None` once released.
    #[cfg(test)]
    pub(super) fn state(&self, id: PubId) -> Option<(bool, usize)> {
        self.pubs.get(&id).map(|p| (p.retired.is_none(), p.holders))
    }
}
