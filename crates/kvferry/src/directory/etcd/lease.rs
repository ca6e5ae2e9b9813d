//! Registration: a lease, a create-if-absent transaction, the keep-alive task, and
//! revocation.
//!
//! # Cancellation
//!
//! [`register`] dropped before its transaction completed may leave a granted lease
//! with no record (it expires after its TTL); dropped after, it leaves a record whose
//! lease nobody keeps alive (it expires too). The keep-alive task stops on its token.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp, TxnOpResponse};
use tokio_util::sync::CancellationToken;

use super::{Registration, Shared};
use crate::directory::record::{unix_ms, PeerRecord};
use crate::directory::{DirectoryError, RegistrationState};

/// Grants a lease and creates the record on it, unless another live process holds
/// the id. A record with the same address and another incarnation is a dead
/// predecessor's (this process has bound that address) and is replaced, which
/// consumers see as a restart. Replaces an earlier registration of this directory.
pub(super) async fn register(shared: Arc<Shared>, record: PeerRecord) -> Result<(), DirectoryError> {
    if shared.closed.is_cancelled() {
        return Err(DirectoryError::Closed);
    }
    if let Some(old) = shared.reg.lock().take() {
        old.stop.cancel();
    }
    let lease_id = create(&shared, &record).await?;
    let stop = shared.closed.child_token();
    *shared.reg.lock() = Some(Registration {
        record: record.clone(),
        lease_id,
        stop: stop.clone(),
    });
    shared.state.send_replace(RegistrationState::Registered(record));
    tokio::spawn(keep_alive(shared, stop));
    Ok(())
}

/// The lease and the transaction; returns the lease id.
async fn create(shared: &Shared, record: &PeerRecord) -> Result<i64, DirectoryError> {
    let ttl = shared.cfg.ttl.as_secs().max(1) as i64;
    let lease_id = shared
        .call("grant lease", shared.client.lease_client().grant(ttl, None))
        .await?
        .id();
    let key = shared.key(&record.peer_id);
    let value = serde_json::to_vec(record).map_err(|e| DirectoryError::BadRecord {
        key: key.clone(),
        reason: e.to_string(),
    })?;
    let put = || TxnOp::put(key.clone(), value.clone(), Some(PutOptions::new().with_lease(lease_id)));
    // First: create if absent. Then, at most once: replace a dead predecessor.
    let mut guard = Compare::version(key.clone(), CompareOp::Equal, 0);
    for attempt in 0..2 {
        let txn = Txn::new()
            .when([guard])
            .and_then([put()])
            .or_else([TxnOp::get(key.clone(), None)]);
        let resp = match shared.call("register", shared.client.kv_client().txn(txn)).await {
            Ok(r) => r,
            Err(e) => {
                revoke(shared, lease_id).await;
                return Err(e);
            }
        };
        if resp.succeeded() {
            tracing::info!(target: "kvferry::directory", key, lease_id, incarnation = record.incarnation,
                replaced = attempt > 0, "registered");
            return Ok(lease_id);
        }
        let holder = resp.op_responses().into_iter().find_map(|r| match r {
            TxnOpResponse::Get(g) => g.kvs().first().map(|kv| (kv.value().to_vec(), kv.mod_revision())),
            _ => None,
        });
        let Some((bytes, rev)) = holder else {
            // Deleted between the compare and the get: try creating again.
            guard = Compare::version(key.clone(), CompareOp::Equal, 0);
            continue;
        };
        let holder: Option<PeerRecord> = serde_json::from_slice(&bytes).ok();
        match holder {
            // The registering process has bound this address, so a record that
            // advertises it with another incarnation is a dead predecessor's.
            Some(h) if attempt == 0 && h.address == record.address && h.incarnation != record.incarnation => {
                tracing::info!(target: "kvferry::directory", key, old = h.incarnation, new = record.incarnation,
                    "replacing the record of a dead predecessor at the same address");
                guard = Compare::mod_revision(key.clone(), CompareOp::Equal, rev);
            }
            h => {
                revoke(shared, lease_id).await;
                return Err(DirectoryError::DuplicatePeerId {
                    peer_id: record.peer_id.clone(),
                    address: h.as_ref().map(|h| h.address.clone()).unwrap_or_else(|| "?".into()),
                    incarnation: h.map(|h| h.incarnation).unwrap_or(0),
                });
            }
        }
    }
    revoke(shared, lease_id).await;
    Err(DirectoryError::Backend {
        op: "register",
        reason: format!("the record at {key} kept changing; try again"),
    })
}

/// Best-effort revocation, bounded by the call deadline.
async fn revoke(shared: &Shared, lease_id: i64) {
    if let Err(e) = shared
        .call("revoke lease", shared.client.lease_client().revoke(lease_id))
        .await
    {
        tracing::debug!(target: "kvferry::directory", lease_id, error = %e, "revoke failed (the lease expires by itself)");
    }
}

/// Deletes the record and revokes the lease.
pub(super) async fn deregister(shared: Arc<Shared>) -> Result<(), DirectoryError> {
    let Some(reg) = shared.reg.lock().take() else {
        return Ok(());
    };
    reg.stop.cancel();
    shared.state.send_replace(RegistrationState::Unregistered);
    // Revoking the lease deletes every key attached to it.
    shared
        .call("revoke lease", shared.client.lease_client().revoke(reg.lease_id))
        .await
        .map(|_| ())
}

/// Keeps the registration's lease alive every TTL/3. When etcd says the lease is gone,
/// registers again on a new lease with the **same** incarnation: the process did not
/// restart, and its connections keep presenting that incarnation, so the directory and
/// the wire agree. Consumers already saw the record deleted (`Lost`: their in-flight
/// transfers failed and what was staged for them was released), so nothing they held
/// survives the gap; the record coming back is a `Joined`.
async fn keep_alive(shared: Arc<Shared>, stop: CancellationToken) {
    let period = (shared.cfg.ttl / 3).max(Duration::from_millis(100));
    let mut backoff = shared.cfg.backoff_min;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(period) => {}
        }
        let Some((lease_id, record)) = shared.reg.lock().as_ref().map(|r| (r.lease_id, r.record.clone())) else {
            return;
        };
        match shared
            .call("keep lease alive", shared.client.lease_client().keep_alive(lease_id))
            .await
        {
            Ok(_) => backoff = shared.cfg.backoff_min,
            Err(DirectoryError::Backend { reason, .. }) if reason.contains("lease not found") => {
                tracing::warn!(target: "kvferry::directory", lease_id, "registration lease lost; registering again (same incarnation)");
                shared.state.send_replace(RegistrationState::Lost);
                let mut fresh = record;
                fresh.registered_unix_ms = unix_ms(std::time::SystemTime::now());
                match create(&shared, &fresh).await {
                    Ok(id) => {
                        if stop.is_cancelled() {
                            revoke(&shared, id).await;
                            return;
                        }
                        if let Some(r) = shared.reg.lock().as_mut() {
                            r.lease_id = id;
                            r.record = fresh.clone();
                        }
                        shared.state.send_replace(RegistrationState::Registered(fresh));
                    }
                    Err(e) => {
                        tracing::warn!(target: "kvferry::directory", error = %e, "re-registration failed; retrying");
                        tokio::select! {
                            _ = stop.cancelled() => return,
                            _ = tokio::time::sleep(backoff) => {}
                        }
                        backoff = (backoff * 2).min(shared.cfg.backoff_max);
                    }
                }
            }
            Err(e) => {
                tracing::debug!(target: "kvferry::directory", lease_id, error = %e, "keep-alive failed; retrying");
            }
        }
    }
}
