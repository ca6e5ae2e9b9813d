//! Publications in the ledger: published, looked up, held by leases, retired (by a
//! `Done`, a `Release`, expiry, unpublish, replacement or shutdown) and released when
//! no lease holds them any more.
//!
//! # Cancellation
//!
//! Nothing here waits.

use tokio::time::Instant;

use super::{Ledger, Outcome, PubId, RegId, ReleaseReason, Released};
use crate::wire::ChunkKey;

#[derive(Debug)]
pub(super) struct PubRecord<P> {
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

impl<L, P> Ledger<L, P> {
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
    ) -> Result<(PubId, Outcome<L, P>), super::RegError> {
        if let Some(r) = reg {
            self.hold(r)?;
        }
        let id = PubId(self.next_pub);
        self.next_pub += 1;
        let mut out = Outcome::default();
        if let Some(old) = self.by_key.get(&key).copied() {
            out = self.retire(old, ReleaseReason::Replaced, now);
        }
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
        Ok((id, out))
    }

    /// The engine's own release of `key`'s live publication (`Released`); `None` if
    /// none is live.
    pub(crate) fn unpublish(&mut self, key: &ChunkKey, now: Instant) -> Option<Outcome<L, P>> {
        let id = *self.by_key.get(key)?;
        Some(self.retire(id, ReleaseReason::Released, now))
    }

    /// A consumer's `Release` of `keys`: a live `once` publication retires
    /// (`Declined`) and answers true; so does a key whose publication was retired
    /// recently (for any reason: its blocks are, or will be, released). A live
    /// publication many may read, and an unknown key, answer false.
    pub(crate) fn decline(&mut self, keys: &[ChunkKey], now: Instant) -> (Vec<bool>, Outcome<L, P>) {
        let mut out = Outcome::default();
        let answers = keys
            .iter()
            .map(|k| match self.by_key.get(k).copied() {
                Some(id) if self.pubs[&id].once => {
                    out.absorb(self.retire(id, ReleaseReason::Declined, now));
                    true
                }
                Some(_) => false,
                None => self.recent_retired.contains(k, now),
            })
            .collect();
        (answers, out)
    }

    /// The leading live, unexpired publications of `keys`, with their ids.
    pub(crate) fn lookup(&self, keys: &[ChunkKey], now: Instant) -> Vec<(PubId, &P)> {
        keys.iter()
            .map_while(|k| {
                let id = *self.by_key.get(k)?;
                let p = &self.pubs[&id];
                (p.expires > now).then_some((id, &p.payload))
            })
            .collect()
    }

    /// Live publications (in the key table) now.
    pub(crate) fn published_now(&self) -> usize {
        self.by_key.len()
    }

    /// Publications not yet released (live, or retired and still held by a lease).
    #[cfg(test)]
    pub(crate) fn publications_held(&self) -> usize {
        self.pubs.len()
    }

    /// Live publications past their expiry retire (`Expired`).
    pub(super) fn expire_publications(&mut self, now: Instant) -> Outcome<L, P> {
        let ids: Vec<PubId> = self
            .by_key
            .values()
            .copied()
            .filter(|id| self.pubs[id].expires <= now)
            .collect();
        let mut out = Outcome::default();
        for id in ids {
            out.absorb(self.retire(id, ReleaseReason::Expired, now));
        }
        out
    }

    /// Every live publication retires with `reason`.
    pub(super) fn retire_all(&mut self, reason: ReleaseReason, now: Instant) -> Outcome<L, P> {
        let ids: Vec<PubId> = self.by_key.values().copied().collect();
        let mut out = Outcome::default();
        for id in ids {
            out.absorb(self.retire(id, reason, now));
        }
        out
    }

    /// Retires `id` if it is `once` and still live (a `Done` of a lease serving it).
    pub(super) fn retire_once(&mut self, id: PubId, now: Instant) -> Outcome<L, P> {
        match self.pubs.get(&id) {
            Some(p) if p.once && p.retired.is_none() => self.retire(id, ReleaseReason::Done, now),
            _ => Outcome::default(),
        }
    }

    /// Retires a live publication: it leaves the key table now (no new lease gets
    /// it) and is released once no lease holds it. Retiring it again changes nothing.
    fn retire(&mut self, id: PubId, reason: ReleaseReason, now: Instant) -> Outcome<L, P> {
        let Some(p) = self.pubs.get_mut(&id) else {
            return Outcome::default();
        };
        if p.retired.is_some() {
            return Outcome::default();
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
    pub(super) fn hold_publication(&mut self, id: PubId) -> bool {
        match self.pubs.get_mut(&id) {
            Some(p) if p.retired.is_none() => {
                p.holders += 1;
                true
            }
            _ => false,
        }
    }

    /// A lease that held `id` ended.
    pub(super) fn unhold_publication(&mut self, id: PubId, _now: Instant) -> Outcome<L, P> {
        match self.pubs.get_mut(&id) {
            Some(p) => {
                debug_assert!(p.holders > 0, "publication unheld more than held");
                p.holders = p.holders.saturating_sub(1);
                self.release_if_free(id)
            }
            None => {
                debug_assert!(false, "a lease held a released publication");
                Outcome::default()
            }
        }
    }

    /// Releases `id` if it is retired and no lease holds it.
    fn release_if_free(&mut self, id: PubId) -> Outcome<L, P> {
        let mut out = Outcome::default();
        let free = self
            .pubs
            .get(&id)
            .is_some_and(|p| p.holders == 0 && p.retired.is_some());
        if !free {
            return out;
        }
        let p = self.pubs.remove(&id).expect("present");
        let released = Released {
            key: p.key,
            reason: p.retired.expect("retired"),
        };
        out.released.push((released, p.payload));
        if let Some(r) = p.reg {
            if let Some(done) = self.unhold(r) {
                out.deregistered.push(done);
            }
        }
        out
    }

    /// Whether publication `id` is live, retired but held, or gone, for tests.
    #[cfg(test)]
    pub(crate) fn publication_state(&self, id: PubId) -> Option<(bool, usize)> {
        self.pubs.get(&id).map(|p| (p.retired.is_none(), p.holders))
    }
}
