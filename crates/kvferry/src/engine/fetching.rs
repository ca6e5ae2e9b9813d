//! Fetching KV: one entry, [`Engine::transfer`] of a [`Fetch`] — the open check, the
//! destination's registration hold and the peer's resolution in one place — which
//! the eager get, the delayed pull and its resolve wrap; staging, releases, pushes
//! and lookups beside it.
//!
//! # Cancellation
//!
//! Every future here may be dropped: the transfer cancels and drains in the
//! background, and its [`DrainFence`](crate::copy::DrainFence) fires once nothing
//! writes the destination (as [`Consumer`](crate::peer::Consumer) documents).

use std::time::Duration;

use tokio::time::Instant;

use super::{ChunkKey, Destination, Engine, GetFailure, Landed, PeerError, Selection, StagedHandle};
use crate::peer::Transfer;

/// What a [`Engine::transfer`] fetches into its destination.
#[derive(Debug)]
pub enum Fetch<'a> {
    /// An eager get: `peer` sends `keys` at once.
    Get {
        /// The peer (address or directory name).
        peer: &'a str,
        /// The keys, one destination block list each.
        keys: &'a [ChunkKey],
    },
    /// A delayed pull in one call: `peer` stages `keys` under a lease, then their bytes
    /// move.
    Pull {
        /// The peer (address or directory name).
        peer: &'a str,
        /// The keys, one destination block list each.
        keys: &'a [ChunkKey],
    },
    /// The second step of a delayed pull: what a [`Engine::stage`] handed back.
    Resolve(StagedHandle),
}

impl Engine {
    /// Every transfer that lands bytes goes through here: the engine must be open, and
    /// the destination holds its cache's registration (if it is registered with this
    /// engine) until the transfer drains; then the consumer runs `fetch`. The one entry
    /// of [`start_get`](Self::start_get), [`get`](Self::get),
    /// [`start_pull`](Self::start_pull), [`start_resolve`](Self::start_resolve) and
    /// [`resolve`](Self::resolve); [`get_blocking`](Self::get_blocking) runs the same
    /// transfer from a plain thread.
    pub fn transfer(&self, fetch: Fetch<'_>, dst: Destination, deadline: Instant) -> Transfer {
        if self.check_open().is_err() {
            return Transfer::failed(PeerError::ShuttingDown);
        }
        let dst = match self.held(dst) {
            Ok(d) => d,
            Err(f) => return Transfer::failed(f.error),
        };
        let consumer = &self.inner.consumer;
        match fetch {
            Fetch::Get { peer, keys } => consumer.start_get(&self.resolve_peer(peer), keys, dst, deadline),
            Fetch::Pull { peer, keys } => consumer.start_pull(&self.resolve_peer(peer), keys, dst, deadline),
            Fetch::Resolve(handle) => consumer.start_resolve(handle, dst, deadline),
        }
    }

    /// Eager get: `peer` sends `keys` at once; they land in `dst`.
    pub async fn get(
        &self,
        peer: &str,
        keys: &[ChunkKey],
        dst: Destination,
        deadline: Instant,
    ) -> Result<Landed, GetFailure> {
        self.start_get(peer, keys, dst, deadline).await
    }

    /// Starts an eager get whose drain fence is known before it completes.
    pub fn start_get(&self, peer: &str, keys: &[ChunkKey], dst: Destination, deadline: Instant) -> Transfer {
        self.transfer(Fetch::Get { peer, keys }, dst, deadline)
    }

    /// The synchronous get: [`start_get`](Self::start_get)'s transfer, waited for from
    /// this thread by the consumer's one blocking wait; returns within `timeout` (plus
    /// scheduling slack). Must be called outside the engine's runtime (it blocks the
    /// thread). Python's `Engine.get_blocking` is the same transfer, waited for by the
    /// binding (which also answers Ctrl-C).
    pub fn get_blocking(
        &self,
        peer: &str,
        keys: &[ChunkKey],
        dst: Destination,
        timeout: Duration,
    ) -> Result<Landed, GetFailure> {
        self.inner
            .consumer
            .blocking(timeout, |deadline| self.start_get(peer, keys, dst, deadline))
    }

    /// Delayed pull, step one: `peer` stages `keys` (copies or pins them) and answers
    /// with a handle to resolve before its lease expires.
    pub async fn stage(&self, peer: &str, keys: &[ChunkKey], deadline: Instant) -> Result<StagedHandle, PeerError> {
        self.check_open().map_err(|_| PeerError::ShuttingDown)?;
        self.inner
            .consumer
            .stage(&self.resolve_peer(peer), keys, deadline)
            .await
    }

    /// [`stage`](Self::stage) of the `select`ed part of published keys: only the
    /// selected bytes are staged. The handle lands by the selection's destination
    /// ranges unless the resolve's destination carries its own selection (same blocks
    /// and source ranges).
    pub async fn stage_selected(
        &self,
        peer: &str,
        keys: &[ChunkKey],
        select: &Selection,
        deadline: Instant,
    ) -> Result<StagedHandle, PeerError> {
        self.check_open().map_err(|_| PeerError::ShuttingDown)?;
        self.inner
            .consumer
            .stage_selected(&self.resolve_peer(peer), keys, select, deadline)
            .await
    }

    /// Delayed pull, step two: moves the staged bytes into `dst`.
    pub async fn resolve(
        &self,
        handle: StagedHandle,
        dst: Destination,
        deadline: Instant,
    ) -> Result<Landed, GetFailure> {
        self.start_resolve(handle, dst, deadline).await
    }

    /// [`resolve`](Self::resolve) as a [`Transfer`] whose drain fence is known
    /// before it completes: a caller that may cancel (drop) it waits on the fence
    /// before reusing `dst`.
    pub fn start_resolve(&self, handle: StagedHandle, dst: Destination, deadline: Instant) -> Transfer {
        self.transfer(Fetch::Resolve(handle), dst, deadline)
    }

    /// Delayed pull in one call ([`stage`](Self::stage), then
    /// [`resolve`](Self::resolve) under one deadline) as a [`Transfer`] with one
    /// drain fence for both steps.
    pub fn start_pull(&self, peer: &str, keys: &[ChunkKey], dst: Destination, deadline: Instant) -> Transfer {
        self.transfer(Fetch::Pull { peer, keys }, dst, deadline)
    }

    /// Releases a staged lease without pulling it.
    pub async fn release_staged(&self, handle: &StagedHandle, deadline: Instant) -> Result<(), PeerError> {
        self.inner.consumer.release(handle, deadline).await
    }

    /// Tells `peer` that `keys` will not be pulled, so it frees its `once`
    /// publications of them now, without staging (see
    /// [`Consumer::release_keys`](crate::peer::Consumer::release_keys)).
    pub async fn release_keys(
        &self,
        peer: &str,
        keys: &[ChunkKey],
        incarnation: Option<u64>,
        deadline: Instant,
    ) -> Result<Vec<bool>, PeerError> {
        self.check_open().map_err(|_| PeerError::ShuttingDown)?;
        self.inner
            .consumer
            .release_keys(&self.resolve_peer(peer), keys, incarnation, deadline)
            .await
    }

    /// [`release_keys`](Self::release_keys) until every key is released or
    /// `retry_until`: a key `peer` missed (not published yet) is asked again after a
    /// pause that doubles from 2 ms to 50 ms. Returns how many keys were released. The
    /// whole operation runs under `deadline`; a `Timeout` reports the time since
    /// `started` (the caller's call: one clock, as for transfers).
    pub async fn release_remote(
        &self,
        peer: &str,
        mut keys: Vec<ChunkKey>,
        incarnation: Option<u64>,
        started: Instant,
        deadline: Instant,
        retry_until: Instant,
    ) -> Result<usize, PeerError> {
        let mut backoff = Duration::from_millis(2);
        let mut released = 0;
        loop {
            let got = match self.release_keys(peer, &keys, incarnation, deadline).await {
                Ok(got) => got,
                Err(PeerError::Timeout { op, .. }) => {
                    return Err(PeerError::Timeout {
                        op,
                        waited: started.elapsed(),
                    })
                }
                Err(e) => return Err(e),
            };
            released += got.iter().filter(|&&r| r).count();
            keys = keys.into_iter().zip(got).filter(|(_, r)| !r).map(|(k, _)| k).collect();
            if keys.is_empty() || Instant::now() + backoff > retry_until {
                return Ok(released);
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(50));
        }
    }

    /// Pushes `data` to `peer`'s store under `key`.
    pub async fn push(&self, peer: &str, key: ChunkKey, data: &[u8], deadline: Instant) -> Result<(), PeerError> {
        self.check_open().map_err(|_| PeerError::ShuttingDown)?;
        self.inner
            .consumer
            .put(&self.resolve_peer(peer), key, data, deadline)
            .await
    }

    /// How many leading `keys` `peer` holds.
    pub async fn lookup(&self, peer: &str, keys: &[ChunkKey], deadline: Instant) -> Result<usize, PeerError> {
        self.check_open().map_err(|_| PeerError::ShuttingDown)?;
        self.inner
            .consumer
            .lookup(&self.resolve_peer(peer), keys, deadline)
            .await
    }
}
