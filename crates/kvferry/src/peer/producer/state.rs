//! The producer's side of its ledger: acting on what the ledger lets go of (what a
//! staged lease holds is [`StagedLease`](super::staged::StagedLease)). The ledger decides who holds what until
//! when, under one lock; [`act`](Producer::act), called with the lock released, drops
//! the ended leases' payloads (their staging pages and quota charges return), reports
//! released publications and wakes completed deregistrations.
//!
//! The ends decided here: a `Done` (bound to the peer the lease was granted to), a
//! consumer's `Release` of `once` publications, a peer gone (every lease it holds), an
//! eager get's connection closed without `Done` (released `lease_grace` later),
//! shutdown, and TTL expiry, found by the [`sweeper`]. A lease being sent is
//! checked out: an end accepted meanwhile takes effect when its send ends.
//!
//! # Cancellation
//!
//! Nothing here is awaited by a caller. The sweeper runs as its own task until the
//! producer's stop token is cancelled or the producer is gone (it holds only a weak
//! reference).

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::staged::StagedLease;
use super::{Inner, Producer};
use crate::peer::error::PeerError;
use crate::peer::ledger::{EndReason, LeaseRefusal, Outcome, Who};
use crate::peer::publish::Publication;
use crate::peer::quota::{Charge, Holder, QuotaError};
use crate::wire::{ChunkKey, LeaseId};

impl Producer {
    /// Releases every lease of peer `owner` (e.g. when the directory says the peer
    /// is gone); returns how many. Leases waiting for a pull end now; leases being
    /// staged or sent end when their staging or send ends.
    pub fn release_peer(&self, owner: &str) -> usize {
        let (n, out) = self.inner.ledger.lock().release_peer(owner, Instant::now());
        self.act(out); // their pages and quota charges return here
        n
    }

    /// Releases every staged lease and publication now (e.g. at shutdown); leases
    /// being sent are released when their send ends.
    pub fn release_all(&self) {
        let out = self.inner.ledger.lock().release_all(Instant::now());
        self.act(out);
    }

    /// Acts on what the ledger let go of: lease payloads drop first (staging pages and
    /// quota charges return), then released publications are reported and completed
    /// deregistrations woken. Called with the ledger unlocked.
    pub(super) fn act(&self, out: Outcome<StagedLease, Arc<Publication>>) {
        if out.is_empty() {
            return;
        }
        let Outcome {
            ended,
            released,
            deregistered,
        } = out;
        let expired = ended.iter().filter(|e| e.reason == EndReason::Expired).count();
        if expired > 0 {
            tracing::debug!(target: "kvferry::peer", n = expired, "released expired staged leases");
        }
        for e in ended {
            tracing::trace!(target: "kvferry::peer", lease = e.id, reason = ?e.reason, pages = e.pages,
                with_payload = e.payload.is_some(), "lease ended");
            drop(e.payload); // pages and quota charge return here
        }
        for (r, publication) in released {
            drop(publication);
            self.inner.releases.push(r);
        }
        if !deregistered.is_empty() {
            self.inner.deregistered.notify_waiters();
        }
    }

    /// Releases a staged lease on `owner`'s `Done`: published chunks it sent that
    /// were published `once` leave the table. Unknown leases, and leases of another
    /// peer (refused and counted), change nothing. A lease being sent is released when
    /// its send ends (the `Done` is accepted now).
    pub fn release(&self, lease_id: LeaseId, owner: &str) -> Result<(), LeaseRefusal> {
        self.done_for(lease_id, &Who::Local(owner.to_string()))
    }

    /// A `Done` from `who`: for a remote requester its identity, and without TLS its
    /// incarnation, must be the ones the lease was granted to.
    pub(super) fn done_for(&self, lease_id: LeaseId, who: &Who) -> Result<(), LeaseRefusal> {
        let out = self.inner.ledger.lock().done(lease_id, who, Instant::now())?;
        self.act(out); // the lease's pages and charge drop here, unless it is being sent
        Ok(())
    }

    /// A consumer's `Release`: each key that is a `once` publication leaves the table
    /// (reason `Declined`; reported once every transfer still sending it stopped), and
    /// a key retired recently answers released again. Whoever may pull a `once`
    /// publication may release it (it could stage it and send `Done`): a key is the
    /// capability. Publications many may read and store chunks are never touched.
    /// Nothing is staged.
    pub(super) fn release_keys(&self, keys: &[ChunkKey]) -> Vec<bool> {
        let (answers, out) = self.inner.ledger.lock().release_keys(keys, Instant::now());
        self.act(out);
        answers
    }

    /// An eager get's connection closed: its leases not yet released by `Done` are
    /// released `lease_grace` from now (sooner if their TTL says so). Returns how many.
    pub(super) fn orphan_eager(&self, conn_id: u64) -> usize {
        self.inner
            .ledger
            .lock()
            .orphan(conn_id, self.inner.cfg.lease_grace, Instant::now())
    }

    pub(super) fn clamp_ttl(&self, ttl: Duration) -> Duration {
        if ttl.is_zero() {
            self.inner.cfg.default_ttl
        } else {
            ttl.min(self.inner.cfg.max_ttl)
        }
    }

    /// Charges `pages` to `holder`, or refuses (counted).
    pub(super) fn charge(&self, holder: &Holder, pages: usize) -> Result<Charge, PeerError> {
        self.inner.quotas.charge(holder, pages).map_err(|e| {
            self.inner.counters.quota_refused.fetch_add(1, Ordering::Relaxed);
            quota_error(e)
        })
    }
}

/// A refused quota charge as the peer error callers know.
fn quota_error(e: QuotaError) -> PeerError {
    let QuotaError::Exceeded {
        scope,
        held,
        asked,
        quota,
    } = e;
    PeerError::QuotaExceeded {
        peer: scope,
        held,
        asked,
        quota,
    }
}

impl Inner {
    /// Spawns the TTL [`sweeper`] on the current runtime.
    pub(super) fn spawn_sweeper(self: &Arc<Inner>) {
        tokio::spawn(sweeper(Arc::downgrade(self), self.stop.clone()));
    }
}

/// Releases expired leases and publications. Holds only a weak reference, so it ends
/// with the producer.
async fn sweeper(inner: Weak<Inner>, stop: CancellationToken) {
    loop {
        let period = match inner.upgrade() {
            Some(i) => (i.cfg.default_ttl / 4).clamp(Duration::from_millis(5), Duration::from_millis(100)),
            None => return,
        };
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(period) => {}
        }
        let Some(inner) = inner.upgrade() else { return };
        let out = inner.ledger.lock().expire(Instant::now());
        Producer { inner }.act(out);
    }
}
