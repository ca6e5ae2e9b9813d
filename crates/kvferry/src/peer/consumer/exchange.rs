//! The consumer's single-exchange requests — `lookup`, `put`, `stage` (with or without
//! a selection), `release` and `release_keys` — each one request and its reply on a
//! pooled connection, awaited under the caller's deadline and raced against the
//! directory's view of the peer. A reused idle connection that died with an old
//! incarnation is retried once on a fresh one. None of them moves KV bytes into a
//! destination (see `get` for those).
//!
//! # Cancellation
//!
//! Dropping one of these futures closes the connection it held (it is taken back only
//! through an explicit finish) and leaves nothing behind on this side; a `stage`
//! dropped after the producer granted the lease leaves that lease to end by its TTL.

use std::time::Duration;

use tokio::time::Instant;

use super::super::error::PeerError;
use super::super::selection::Selection;
use super::client::Consumer;
use super::shared::{check_frames, check_keys, unexpected};
use super::types::{StagedHandle, StagedSelection};
use crate::net::{NetError, Pool};
use crate::wire::{ChunkKey, ErrorKind, Message, WireSelection};

impl Consumer {
    /// How many leading `keys` the peer holds.
    pub async fn lookup(&self, peer: &str, keys: &[ChunkKey], deadline: Instant) -> Result<usize, PeerError> {
        check_keys(keys, self.max_keys())?;
        let msg = Message::Lookup { keys: keys.to_vec() };
        match self.simple_request(peer, &msg, deadline).await? {
            Message::LookupReply { hits } => Ok(hits as usize),
            other => Err(unexpected("LookupReply", &other)),
        }
    }

    /// Pushes `data` to `peer` under `key` (the peer allocates staging pages, receives,
    /// lands into its store).
    pub async fn put(&self, peer: &str, key: ChunkKey, data: &[u8], deadline: Instant) -> Result<(), PeerError> {
        let pool = self.pool(peer)?;
        let fut = async {
            let mut conn = pool.checkout(deadline).await?;
            let id = conn.next_request_id();
            conn.send(
                id,
                &Message::Put {
                    key,
                    len: data.len() as u64,
                },
            )
            .await?;
            conn.send_bulk(id, &[data]).await?;
            let reply = conn.recv_reply(id).await?;
            conn.finish();
            match reply {
                Message::PutAck { .. } => Ok(()),
                other => Err(unexpected("PutAck", &other)),
            }
        };
        let started = Instant::now();
        let fut = self.peer_watch(peer).race(fut);
        match tokio::time::timeout_at(deadline, fut).await {
            Ok(r) => r,
            Err(_) => Err(PeerError::Timeout {
                op: "put",
                waited: started.elapsed(),
            }),
        }
    }

    pub(super) async fn simple_request(
        &self,
        peer: &str,
        msg: &Message,
        deadline: Instant,
    ) -> Result<Message, PeerError> {
        let pool = self.pool(peer)?;
        let start = Instant::now();
        let fut = async {
            for attempt in 0..2 {
                let mut conn = pool.checkout(deadline).await?;
                match conn.request(msg).await {
                    Ok(reply) => {
                        conn.finish();
                        return Ok(reply);
                    }
                    // A reused idle connection may have died with an old incarnation.
                    Err(NetError::Lost { .. }) if conn.reused() && attempt == 0 => continue,
                    Err(e) => return Err(PeerError::from(e)),
                }
            }
            unreachable!("the second attempt returns")
        };
        let fut = self.peer_watch(peer).race(fut);
        match tokio::time::timeout_at(deadline, fut).await {
            Ok(r) => r,
            Err(_) => Err(PeerError::Timeout {
                op: "request",
                waited: start.elapsed(),
            }),
        }
    }

    /// [`stage_with`](Self::stage_with), and while it misses the first key and `wait`
    /// (from the call, within `deadline`) has not passed: `AwaitPublished` of that key,
    /// and the stage again the moment the producer says it arrived (no retry timer;
    /// see `Destination::await_published`).
    pub(super) async fn stage_awaiting(
        &self,
        peer: &str,
        keys: &[ChunkKey],
        select: Option<(Selection, WireSelection)>,
        wait: Duration,
        deadline: Instant,
    ) -> Result<StagedHandle, PeerError> {
        let until = (Instant::now() + wait).min(deadline);
        loop {
            let handle = self.stage_with(peer, keys, select.clone(), deadline).await?;
            let now = Instant::now();
            if !handle.chunks.is_empty() || keys.is_empty() || now >= until {
                return Ok(handle);
            }
            if !self.await_key(peer, &keys[0], until - now, deadline).await? {
                return Ok(handle);
            }
        }
    }

    /// Asks `peer` to answer once `key` is published, waiting at most `wait` (cut to
    /// half the I/O timeout, within which the reply must start): true when it is
    /// there. A producer that does not know the request (an older build) answers
    /// `BadRequest`: false, as if the wait passed.
    pub(super) async fn await_key(
        &self,
        peer: &str,
        key: &ChunkKey,
        wait: Duration,
        deadline: Instant,
    ) -> Result<bool, PeerError> {
        let wait = wait.min(self.inner.cfg.net.io_timeout / 2);
        let wait_ms = wait.as_millis().clamp(1, u32::MAX as u128) as u32;
        let msg = Message::AwaitPublished { key: *key, wait_ms };
        match self.simple_request(peer, &msg, deadline).await {
            Ok(Message::LookupReply { hits }) => Ok(hits > 0),
            Ok(other) => Err(unexpected("LookupReply", &other)),
            Err(PeerError::Remote {
                kind: ErrorKind::BadRequest,
                ..
            }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Delayed pull, step one: asks `peer` to stage `keys` and returns a handle.
    pub async fn stage(&self, peer: &str, keys: &[ChunkKey], deadline: Instant) -> Result<StagedHandle, PeerError> {
        self.stage_with(peer, keys, None, deadline).await
    }

    /// [`stage`](Self::stage) of the `select`ed part of published keys: the producer
    /// stages (device caches) or pins (host caches) only the selected bytes. The
    /// handle records the selection and the stream's shape; [`resolve`](Self::resolve)
    /// lands it by the selection's destination ranges, or by those of its
    /// destination's own selection (same blocks and source ranges). A miss (not every
    /// key published) is a handle with no chunks.
    pub async fn stage_selected(
        &self,
        peer: &str,
        keys: &[ChunkKey],
        select: &Selection,
        deadline: Instant,
    ) -> Result<StagedHandle, PeerError> {
        self.stage_with(peer, keys, Some((select.clone(), select.wire(None, None))), deadline)
            .await
    }

    pub(super) async fn stage_with(
        &self,
        peer: &str,
        keys: &[ChunkKey],
        select: Option<(Selection, WireSelection)>,
        deadline: Instant,
    ) -> Result<StagedHandle, PeerError> {
        check_keys(keys, self.max_keys())?;
        let sent = Instant::now();
        let ttl_ms = self.inner.cfg.lease_ttl.as_millis() as u32;
        let keys_v = keys.to_vec();
        let msg = match &select {
            None => Message::Stage { keys: keys_v, ttl_ms },
            Some((_, wire)) => Message::StageSelected {
                keys: keys_v,
                ttl_ms,
                select: wire.clone(),
            },
        };
        let handle = |lease_id, incarnation, chunks, ttl_ms: u32, selection| StagedHandle {
            peer: peer.to_string(),
            lease_id,
            incarnation,
            chunks,
            expires: sent + Duration::from_millis(ttl_ms as u64),
            selection,
        };
        match (self.simple_request(peer, &msg, deadline).await?, select) {
            (
                Message::Staged {
                    lease_id,
                    incarnation,
                    chunks,
                    ttl_ms,
                },
                None,
            ) => Ok(handle(lease_id, incarnation, chunks, ttl_ms, None)),
            (
                Message::StagedSelected {
                    lease_id,
                    incarnation,
                    chunks,
                    ttl_ms,
                    shape,
                },
                Some((select, _)),
            ) => {
                if chunks.is_empty() {
                    return Ok(handle(lease_id, incarnation, chunks, ttl_ms, None));
                }
                check_frames(&chunks, shape.total())?;
                let selection = StagedSelection {
                    select,
                    shape,
                    keys: keys.len(),
                };
                Ok(handle(lease_id, incarnation, chunks, ttl_ms, Some(selection)))
            }
            (other, None) => Err(unexpected("Staged", &other)),
            (other, Some(_)) => Err(unexpected("StagedSelected", &other)),
        }
    }

    /// Releases a staged lease without pulling it.
    pub async fn release(&self, handle: &StagedHandle, deadline: Instant) -> Result<(), PeerError> {
        self.simple_request(
            &handle.peer,
            &Message::Done {
                lease_id: handle.lease_id,
            },
            deadline,
        )
        .await
        .map(|_| ())
    }

    /// Tells `peer` that `keys` will not be pulled: it frees those of them that are
    /// `once` publications at once, staging nothing (so it works when its staging is
    /// full). Returns, per key, whether it is released — by this call, or recently
    /// (by a `Done` or an earlier release: a retry answers true again); false: not
    /// published (yet), not a `once` publication, or released long ago. With
    /// `incarnation`, a peer that is another incarnation (it restarted) is refused
    /// with `StaleIncarnation`; without, the incarnation the connection reached.
    ///
    /// More keys than one message carries (`max_keys`) go as several `Release`
    /// messages, in order, all to the incarnation the first one reached: a release
    /// is per key, so nothing is lost by cutting it (a step of a vLLM decode may
    /// release thousands of reader slots of one prefill rank at once). An error in
    /// a later message returns that error; the keys of the messages before it are
    /// released.
    pub async fn release_keys(
        &self,
        peer: &str,
        keys: &[ChunkKey],
        incarnation: Option<u64>,
        deadline: Instant,
    ) -> Result<Vec<bool>, PeerError> {
        if keys.is_empty() {
            return Err(PeerError::InvalidArgument("empty key list".into()));
        }
        let pool = self.pool(peer)?;
        let start = Instant::now();
        let max_keys = self.max_keys().max(1);
        let fut = async {
            let mut pinned = incarnation;
            let mut out = Vec::with_capacity(keys.len());
            for part in keys.chunks(max_keys) {
                let (released, reached) = release_message(&pool, part, pinned, deadline).await?;
                pinned = Some(reached);
                out.extend(released);
            }
            Ok(out)
        };
        let fut = self.peer_watch(peer).race(fut);
        match tokio::time::timeout_at(deadline, fut).await {
            Ok(r) => r,
            Err(_) => Err(PeerError::Timeout {
                op: "release",
                waited: start.elapsed(),
            }),
        }
    }
}

/// One `Release` message of at most `max_keys` keys: per key whether it is released,
/// and the incarnation it reached (refused with `StaleIncarnation` when that is not
/// `incarnation`). A reused idle connection that died with an old incarnation is
/// retried once on a fresh one.
async fn release_message(
    pool: &Pool,
    keys: &[ChunkKey],
    incarnation: Option<u64>,
    deadline: Instant,
) -> Result<(Vec<bool>, u64), PeerError> {
    for attempt in 0..2 {
        let mut conn = pool.checkout(deadline).await?;
        let current = conn.peer().incarnation;
        if let Some(expected) = incarnation.filter(|&e| e != current) {
            conn.finish();
            return Err(PeerError::StaleIncarnation {
                handle: expected,
                current,
            });
        }
        let msg = Message::Release {
            keys: keys.to_vec(),
            incarnation: current,
        };
        match conn.request(&msg).await {
            Ok(Message::ReleaseAck { released }) if released.len() == keys.len() => {
                conn.finish();
                return Ok((released, current));
            }
            Ok(other) => return Err(unexpected("ReleaseAck", &other)),
            Err(NetError::Lost { .. }) if conn.reused() && attempt == 0 => continue,
            Err(e) => return Err(PeerError::from(e)),
        }
    }
    unreachable!("the second attempt returns")
}
