//! Serving requests: the producer is the [`Handler`] a [`crate::net::Server`] calls for
//! every request of a connection. Each request is measured (its kind, outcome and
//! handling latency, see `accounting`) and answered here: lookups, stages and eager
//! gets (capped: over `max_concurrent_gets`, or while the producer is refusing, an
//! immediate `Busy`), pulls of staged leases, `Done`, a consumer's `Release`,
//! pushes (see `puts`), and waits for a key to arrive (see `awaiting`). A refusal is an `Error` reply with its kind.
//!
//! A requester is who its connection proves or claims it is: under TLS the
//! certificate's identity, otherwise the claimed id, and its leases are then bound to
//! its incarnation too (quotas count its source address as well). A lease is sent
//! checked out of the ledger ([`Sending`](super::guards::Sending)): an eager get's is
//! tied to its connection and ends with a failed send; a delayed pull's is checked
//! back in after the send, so a pull may be retried until `Done` or its TTL.
//!
//! # Cancellation
//!
//! A handler future dropped mid-request (connection torn down, server stopped) drops
//! the staging (its [`Staging`](super::guards::Staging) guard ends the lease in the
//! ledger) or the checked-out lease (after the socket write stopped, since the write
//! borrows it; its [`Sending`](super::guards::Sending) guard tells the ledger, which
//! ends the lease and releases what only it held). A dropped request is not recorded
//! in the request stats.

use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use tokio::time::Instant;
use tracing::Instrument;

use super::accounting;
use super::awaiting::Awaited;
use super::fault_hooks::corrupted;
use super::staged::StagedLease;
use super::Producer;
use crate::net::{Connection, Handler, NetError};
use crate::peer::error::PeerError;
use crate::peer::ledger::{LeaseRefusal, Who};
use crate::peer::quota::Holder;
use crate::wire::{ChunkKey, ErrorKind, Message, SelectedShape};

impl Handler for Producer {
    fn handle<'a>(
        &'a self,
        conn: &'a mut Connection,
        request_id: u64,
        msg: Message,
    ) -> BoxFuture<'a, Result<(), NetError>> {
        let span = tracing::info_span!(target: "kvferry::peer", "request", request = request_id,
            peer = %conn.peer(), msg = msg.name());
        let kind = accounting::kind_of(&msg);
        async move {
            let handler = self.handle_request(conn, request_id, msg);
            let r = accounting::measured(&self.inner.requests, kind, handler).await;
            if let Err(e) = &r {
                tracing::debug!(target: "kvferry::peer", error = %e, "request ended the connection");
            }
            r
        }
        .instrument(span)
        .boxed()
    }

    fn disconnected(&self, conn: &Connection) {
        let n = self.orphan_eager(conn.id());
        if n > 0 {
            tracing::debug!(target: "kvferry::peer", peer = %conn.peer(), leases = n,
                grace = ?self.inner.cfg.lease_grace, "eager get connection closed without Done");
        }
    }
}

impl Producer {
    async fn handle_request(&self, conn: &mut Connection, id: u64, msg: Message) -> Result<(), NetError> {
        // Under TLS, the certificate's identity: a peer cannot claim another's leases.
        // Without it, the claimed id, and leases are bound to the claimant's
        // incarnation too; quotas then count its source address as well.
        let peer = conn.peer();
        let holder = Holder {
            identity: peer.authenticated_id().to_string(),
            conn: Some(conn.id()),
            source: peer.addr.map(|a| a.ip()),
            proven: peer.tls_identity.is_some(),
            // The directory's name for it, when its certificate names it otherwise.
            claimed: (peer.authenticated_id() != peer.peer_id).then(|| peer.peer_id.clone()),
        };
        let incarnation = (!holder.proven).then_some(peer.incarnation);
        let who = Who::Remote {
            identity: holder.identity.clone(),
            incarnation,
        };
        // A selected get or stage is served as the plain one, with its selection.
        let (msg, select) = match msg {
            Message::GetSelected { keys, ttl_ms, select } => (Message::Get { keys, ttl_ms }, Some(select)),
            Message::StageSelected { keys, ttl_ms, select } => (Message::Stage { keys, ttl_ms }, Some(select)),
            other => (other, None),
        };
        // A selected request's reply is `StagedSelected`, a miss included.
        let selected = select.is_some();
        let staged = |lease_id, chunks, ttl_ms, shape: Option<SelectedShape>| match shape {
            Some(shape) => Message::StagedSelected {
                lease_id,
                incarnation: self.inner.incarnation,
                chunks,
                ttl_ms,
                shape,
            },
            None if selected => Message::StagedSelected {
                lease_id,
                incarnation: self.inner.incarnation,
                chunks,
                ttl_ms,
                shape: SelectedShape::default(),
            },
            None => Message::Staged {
                lease_id,
                incarnation: self.inner.incarnation,
                chunks,
                ttl_ms,
            },
        };
        if self.inner.refusing.load(Ordering::Acquire) && accounting::takes_staging(accounting::kind_of(&msg)) {
            self.inner.counters.busy.fetch_add(1, Ordering::Relaxed);
            let why = "not registered in the peer directory (its lease was lost; registering again)";
            return refuse(conn, id, ErrorKind::Busy, why.into()).await;
        }
        match msg {
            Message::Ping => conn.send(id, &Message::Pong).await,
            Message::Lookup { keys } => {
                let hits = self.lookup_hits(&keys) as u32;
                accounting::note_found(hits > 0);
                conn.send(id, &Message::LookupReply { hits }).await
            }
            Message::Stage { keys, ttl_ms } | Message::Get { keys, ttl_ms } if keys.is_empty() => {
                let _ = ttl_ms;
                refuse(conn, id, ErrorKind::BadRequest, "empty key list".into()).await
            }
            Message::Stage { keys, ttl_ms } => {
                let Ok(_permit) = self.inner.gets.try_acquire() else {
                    self.inner.counters.busy.fetch_add(1, Ordering::Relaxed);
                    return refuse(conn, id, ErrorKind::Busy, "too many concurrent gets".into()).await;
                };
                let ttl = Duration::from_millis(ttl_ms as u64);
                match self.stage_for(&keys, ttl, &holder, incarnation, select.as_ref()).await {
                    Ok((lease_id, chunks, ttl_ms, shape)) => {
                        accounting::note_found(!chunks.is_empty());
                        conn.send(id, &staged(lease_id, chunks, ttl_ms, shape)).await
                    }
                    Err(e) => refuse(conn, id, kind_of(&e), e.to_string()).await,
                }
            }
            Message::Get { keys, ttl_ms } => {
                let Ok(_permit) = self.inner.gets.try_acquire() else {
                    self.inner.counters.busy.fetch_add(1, Ordering::Relaxed);
                    return refuse(conn, id, ErrorKind::Busy, "too many concurrent gets".into()).await;
                };
                let ttl = Duration::from_millis(ttl_ms as u64);
                let (lease_id, chunks, ttl_ms, shape) =
                    match self.stage_for(&keys, ttl, &holder, incarnation, select.as_ref()).await {
                        Ok(s) => s,
                        Err(e) => return refuse(conn, id, kind_of(&e), e.to_string()).await,
                    };
                accounting::note_found(!chunks.is_empty());
                conn.send(id, &staged(lease_id, chunks, ttl_ms, shape)).await?;
                if lease_id == 0 {
                    return Ok(()); // miss: nothing staged, nothing follows
                }
                // Tied to this connection: released after the grace if it closes
                // without `Done`.
                let sending = match self.check_out(lease_id, &who, Some(conn.id())) {
                    Ok(s) => s,
                    Err((kind, message)) => return refuse(conn, id, kind, message).await,
                };
                // On a failed (or aborted) send the guard drops: the lease ends, its
                // pages and its quota charge return (the eager consumer is gone).
                self.send_lease(conn, id, sending.lease()).await?;
                conn.send(id, &Message::PullDone { lease_id }).await?;
                sending.check_in();
                Ok(())
            }
            Message::Pull { lease_id, incarnation } => {
                if incarnation != self.inner.incarnation {
                    let m = format!(
                        "lease from incarnation {incarnation:#x}, this is {:#x}",
                        self.inner.incarnation
                    );
                    return refuse(conn, id, ErrorKind::StaleIncarnation, m).await;
                }
                let sending = match self.check_out(lease_id, &who, None) {
                    Ok(s) => s,
                    Err((kind, message)) => return refuse(conn, id, kind, message).await,
                };
                let r = self.send_lease(conn, id, sending.lease()).await;
                // A delayed pull may be retried: keep the lease until Done or TTL
                // (or end it now, if a Done arrived while it was being sent).
                sending.check_in();
                r?;
                conn.send(id, &Message::PullDone { lease_id }).await
            }
            Message::Done { lease_id } => {
                // Duplicate or unknown Dones change nothing and are acknowledged (a
                // Done may race the TTL); a foreign one is refused.
                match self.done_for(lease_id, &who) {
                    Err(LeaseRefusal::Foreign) => {
                        let m = format!("lease {lease_id} was not granted to this peer");
                        refuse(conn, id, ErrorKind::UnknownLease, m).await
                    }
                    _ => conn.send(id, &Message::DoneAck).await,
                }
            }
            Message::Release { keys, incarnation } => {
                if incarnation != self.inner.incarnation {
                    let m = format!(
                        "release for incarnation {incarnation:#x}, this is {:#x}",
                        self.inner.incarnation
                    );
                    return refuse(conn, id, ErrorKind::StaleIncarnation, m).await;
                }
                let released = self.release_keys(&keys);
                conn.send(id, &Message::ReleaseAck { released }).await
            }
            Message::Put { key, len } => self.receive_put(conn, id, key, len, &holder).await,
            Message::MoverHello { boot_id } => conn.send(id, &self.mover_offer(&boot_id)).await,
            Message::GetMapped { keys, ttl_ms, select } => {
                if keys.is_empty() {
                    return refuse(conn, id, ErrorKind::BadRequest, "empty key list".into()).await;
                }
                let Ok(_permit) = self.inner.gets.try_acquire() else {
                    self.inner.counters.busy.fetch_add(1, Ordering::Relaxed);
                    return refuse(conn, id, ErrorKind::Busy, "too many concurrent gets".into()).await;
                };
                let ttl = Duration::from_millis(ttl_ms as u64);
                let staged = self.stage_for(&keys, ttl, &holder, incarnation, select.as_ref()).await;
                let (lease_id, chunks, _ttl_ms, shape) = match staged {
                    Ok(s) => s,
                    Err(e) => return refuse(conn, id, kind_of(&e), e.to_string()).await,
                };
                accounting::note_found(!chunks.is_empty());
                match self.map_lease(lease_id, chunks, shape, &who, conn.id()) {
                    Ok(reply) => conn.send(id, &reply).await,
                    Err((kind, message)) => refuse(conn, id, kind, message).await,
                }
            }
            Message::PullMapped { lease_id, incarnation } => match self.map_pull(lease_id, incarnation, &who) {
                Ok(reply) => conn.send(id, &reply).await,
                Err((kind, message)) => refuse(conn, id, kind, message).await,
            },
            Message::AwaitPublished { key, wait_ms } => {
                let awaited = self.await_key(&key, Duration::from_millis(wait_ms as u64)).await;
                // Counted a hit only when the key ended the wait, not its timer.
                accounting::note_found(awaited == Awaited::Here);
                let hits = awaited.here() as u32;
                conn.send(id, &Message::LookupReply { hits }).await
            }
            Message::DeviceIpcHello { kinds } => conn.send(id, &self.device_ipc_offer(&kinds)).await,
            Message::GetDeviceMapped {
                keys,
                ttl_ms,
                kind,
                select,
            } => {
                if keys.is_empty() {
                    return refuse(conn, id, ErrorKind::BadRequest, "empty key list".into()).await;
                }
                let Ok(_permit) = self.inner.gets.try_acquire() else {
                    self.inner.counters.busy.fetch_add(1, Ordering::Relaxed);
                    return refuse(conn, id, ErrorKind::Busy, "too many concurrent gets".into()).await;
                };
                let ttl = Duration::from_millis(ttl_ms as u64);
                let served = self
                    .device_mapped(
                        &keys,
                        ttl,
                        &kind,
                        select.as_ref(),
                        &holder,
                        incarnation,
                        &who,
                        conn.id(),
                    )
                    .await;
                match served {
                    Ok(reply) => {
                        let found = !matches!(&reply, Message::StagedMapped { chunks, .. } if chunks.is_empty());
                        accounting::note_found(found);
                        conn.send(id, &reply).await
                    }
                    Err((kind, message)) => refuse(conn, id, kind, message).await,
                }
            }
            other => {
                let m = format!("unexpected request {}", other.name());
                refuse(conn, id, ErrorKind::BadRequest, m).await
            }
        }
    }

    /// How many leading `keys` this producer would serve: the leading published ones
    /// when the first is published (what a stage would send), else those in the store.
    fn lookup_hits(&self, keys: &[ChunkKey]) -> usize {
        let published = self.inner.ledger.lock().lookup(keys, Instant::now()).len();
        if published > 0 {
            published
        } else {
            self.inner.store.lookup(keys)
        }
    }

    async fn send_lease(&self, conn: &mut Connection, request_id: u64, entry: &StagedLease) -> Result<(), NetError> {
        let faults = &self.inner.faults;
        for (i, meta) in entry.chunks.iter().enumerate() {
            faults.before_frame(conn.peer()).await?;
            let parts = entry.parts(i).map_err(|e| NetError::Protocol(e.to_string()))?;
            if meta.len > 0 && faults.corrupt_frame() {
                conn.send_bulk(request_id, &[&corrupted(&parts)]).await?;
            } else {
                conn.send_bulk_with_checksum(request_id, &parts, meta.checksum).await?;
            }
            self.inner.counters.bytes_sent.fetch_add(meta.len, Ordering::Relaxed);
            self.inner.counters.chunks_sent.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }
}

pub(super) fn kind_of(e: &PeerError) -> ErrorKind {
    match e {
        PeerError::StagingExhausted { .. } | PeerError::StoreFull { .. } | PeerError::QuotaExceeded { .. } => {
            ErrorKind::Busy
        }
        PeerError::InvalidArgument(_) => ErrorKind::BadRequest,
        PeerError::Selection(_) => ErrorKind::BadSelection,
        PeerError::ShuttingDown => ErrorKind::ShuttingDown,
        _ => ErrorKind::Internal,
    }
}

pub(super) async fn refuse(conn: &mut Connection, id: u64, kind: ErrorKind, message: String) -> Result<(), NetError> {
    tracing::debug!(target: "kvferry::peer", ?kind, reason = %message, "request refused");
    accounting::note_refusal(kind);
    conn.send(id, &Message::Error { kind, message }).await
}
