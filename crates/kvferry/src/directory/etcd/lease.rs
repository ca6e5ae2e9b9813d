//! Registration: a lease, a create-if-absent transaction, the judgement of a record
//! already there, the keep-alive task (which also checks the record), and revocation.
//!
//! # Semantics
//!
//! A record names its holder's incarnation. It is replaced only when its holder is
//! proven dead, does not prove itself (the fleet's secret, and its identity) at its
//! address, or its lease expired; never because a newcomer claims the
//! same address (with `--advertise` any process can claim any address). See the module
//! docs of [`super`] for the rules, and [`judge`] for the proof.
//!
//! # Cancellation
//!
//! [`register`] dropped before its transaction completed may leave a granted lease
//! with no record (it expires after its TTL); dropped after, it leaves a record whose
//! lease nobody keeps alive (it expires too). The keep-alive task stops on its token;
//! every await in it is bounded by the call deadline or races the token.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp, TxnOpResponse};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{Registration, Shared, MAX_HOLDER_WAIT};
use crate::directory::record::PeerRecord;
use crate::directory::{DirectoryError, Probed, RegistrationState};

/// How often a registration waiting for a holder's lease to expire looks again.
const WAIT_POLL: Duration = Duration::from_millis(250);
/// Transactions lost to concurrent changes of the record before giving up.
const MAX_RACES: u32 = 8;

/// What is known about the holder of a record.
#[derive(Debug)]
enum Holder {
    /// It answers at its address with its incarnation.
    Alive,
    /// Its address answers as the registering process: it cannot be serving there.
    Dead,
    /// Something answers at its address but does not prove itself the holder: it
    /// failed to prove the fleet's secret after this process proved it, or it has
    /// another peer's identity (the reason says which). No holder at all.
    Unproven(String),
    /// Nobody answers (the reason says why): not proven either way.
    Unknown(String),
}

/// How patient a claim is with a holder it cannot judge.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Patience {
    /// Registering: wait for the holder's lease to expire (bounded).
    WaitForExpiry,
    /// Checking from the keep-alive task: one round, never blocking the renewals.
    OneRound,
}

/// What a successful claim did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Claimed {
    /// The key already held this registration's record.
    Kept,
    /// The key was absent: the record was created.
    Created,
    /// Another record was replaced.
    Replaced,
}

/// Why a claim did not succeed.
enum Refused {
    /// A live (or not disprovable) holder keeps the record.
    Held(PeerRecord, String),
    /// An etcd call failed.
    Failed(DirectoryError),
}

impl From<DirectoryError> for Refused {
    fn from(e: DirectoryError) -> Refused {
        Refused::Failed(e)
    }
}

impl Refused {
    fn into_error(self, peer_id: &str) -> DirectoryError {
        match self {
            Refused::Held(h, why) => {
                tracing::warn!(target: "kvferry::directory", peer_id, holder = %h.address,
                    incarnation = format_args!("{:#x}", h.incarnation), why, "peer id held by another process");
                DirectoryError::DuplicatePeerId {
                    peer_id: peer_id.to_string(),
                    address: h.address,
                    incarnation: h.incarnation,
                }
            }
            Refused::Failed(e) => e,
        }
    }
}

/// Grants a lease and creates the record on it, unless another live process holds
/// the id (see [`claim`]). Replaces an earlier registration of this directory.
pub(super) async fn register(shared: Arc<Shared>, record: PeerRecord) -> Result<(), DirectoryError> {
    if shared.closed.is_cancelled() {
        return Err(DirectoryError::Closed);
    }
    if let Some(old) = shared.reg.lock().take() {
        old.stop.cancel();
    }
    let lease_id = grant(&shared).await?;
    match claim(&shared, &record, lease_id, Patience::WaitForExpiry).await {
        Ok(_) => {}
        Err(r) => {
            revoke(&shared, lease_id).await;
            return Err(r.into_error(&record.peer_id));
        }
    }
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

async fn grant(shared: &Shared) -> Result<i64, DirectoryError> {
    let ttl = shared.cfg.ttl.as_secs().max(1) as i64;
    Ok(shared
        .call("grant lease", shared.client.lease_client().grant(ttl, None))
        .await?
        .id())
}

/// A record already under the key.
struct Current {
    record: Option<PeerRecord>,
    mod_revision: i64,
    lease: i64,
}

/// Puts `record` on `lease_id` when the key is absent (or, with `over`, when it is
/// still at that mod revision); otherwise returns what is there (`None`: it vanished
/// meanwhile).
async fn put_if(
    shared: &Shared,
    record: &PeerRecord,
    lease_id: i64,
    over: Option<i64>,
) -> Result<Result<(), Option<Current>>, DirectoryError> {
    let key = shared.key(&record.peer_id);
    let value = serde_json::to_vec(record).map_err(|e| DirectoryError::BadRecord {
        key: key.clone(),
        reason: e.to_string(),
    })?;
    let guard = match over {
        None => Compare::version(key.clone(), CompareOp::Equal, 0),
        Some(rev) => Compare::mod_revision(key.clone(), CompareOp::Equal, rev),
    };
    let txn = Txn::new()
        .when([guard])
        .and_then([TxnOp::put(
            key.clone(),
            value,
            Some(PutOptions::new().with_lease(lease_id)),
        )])
        .or_else([TxnOp::get(key.clone(), None)]);
    let resp = shared.call("register", shared.client.kv_client().txn(txn)).await?;
    if resp.succeeded() {
        return Ok(Ok(()));
    }
    let current = resp.op_responses().into_iter().find_map(|r| match r {
        TxnOpResponse::Get(g) => g.kvs().first().map(|kv| Current {
            record: serde_json::from_slice(kv.value()).ok(),
            mod_revision: kv.mod_revision(),
            lease: kv.lease(),
        }),
        _ => None,
    });
    Ok(Err(current))
}

/// Who holds a record: asks who answers at its address.
async fn judge(shared: &Shared, holder: &PeerRecord, me: &PeerRecord) -> Holder {
    let Some(probe) = shared.prober.lock().clone() else {
        return Holder::Unknown("this directory cannot probe addresses".into());
    };
    match probe(holder.address.clone()).await {
        Probed::Answered { peer_id, incarnation } if peer_id == holder.peer_id && incarnation == holder.incarnation => {
            Holder::Alive
        }
        Probed::Answered { peer_id, incarnation } if peer_id == me.peer_id && incarnation == me.incarnation => {
            Holder::Dead
        }
        Probed::Answered { peer_id, incarnation } => Holder::Unproven(format!(
            "{} answers as {peer_id} (incarnation {incarnation:#x}), not as the record's holder",
            holder.address
        )),
        Probed::Unproven(why) => Holder::Unproven(format!("{} does not prove itself: {why}", holder.address)),
        Probed::NoAnswer(why) => Holder::Unknown(format!("{} does not answer: {why}", holder.address)),
    }
}

/// Makes the key hold `record` on `lease_id`: creates it when absent, keeps it when it
/// is already this registration's, replaces a record whose holder is proven dead, that
/// names no incarnation, whose address answers without proving itself the holder
/// (secret, certificate or identity), or that is on no lease with a holder that does
/// not answer. A holder that does not answer, on a live lease: checked by the
/// registered process itself ([`Patience::OneRound`]), it loses the record; while
/// registering ([`Patience::WaitForExpiry`]), the claim waits for its lease to expire,
/// bounded by its granted TTL (at most [`MAX_HOLDER_WAIT`]) plus a call deadline.
/// Never replaces a holder that proves itself at its address.
async fn claim(shared: &Shared, record: &PeerRecord, lease_id: i64, patience: Patience) -> Result<Claimed, Refused> {
    let key = shared.key(&record.peer_id);
    let mut over = None;
    let mut races = 0;
    let mut wait_until: Option<Instant> = None;
    let mut judged: Option<(i64, Holder)> = None;
    loop {
        let current = match put_if(shared, record, lease_id, over).await? {
            Ok(()) => {
                tracing::info!(target: "kvferry::directory", key, lease_id, incarnation = record.incarnation,
                    replaced = over.is_some(), "registered");
                return Ok(if over.is_some() {
                    Claimed::Replaced
                } else {
                    Claimed::Created
                });
            }
            Err(c) => c,
        };
        over = None;
        let Some(current) = current else {
            // Deleted between the compare and the get: try creating again.
            races += 1;
            if races > MAX_RACES {
                return Err(Refused::Failed(kept_changing(&key)));
            }
            continue;
        };
        let holder = match current.record {
            Some(h) if h.peer_id == record.peer_id => h,
            // Not a valid record of this id: it names no live incarnation.
            _ => {
                tracing::warn!(target: "kvferry::directory", key, "replacing an invalid record");
                over = Some(current.mod_revision);
                continue;
            }
        };
        if holder.incarnation == record.incarnation {
            if current.lease == lease_id && holder == *record {
                return Ok(Claimed::Kept);
            }
            // This process's record on another lease (or changed): put it right.
            over = Some(current.mod_revision);
            continue;
        }
        // One probe per record seen: waiting re-reads the key, not the holder (failed
        // handshakes count against this host at the holder).
        let verdict = match judged.take() {
            Some((rev, v)) if rev == current.mod_revision => v,
            _ => judge(shared, &holder, record).await,
        };
        match verdict {
            Holder::Alive => {
                return Err(Refused::Held(
                    holder,
                    "its holder answers at its address with its incarnation".into(),
                ))
            }
            Holder::Dead => {
                tracing::info!(target: "kvferry::directory", key, old = holder.incarnation, new = record.incarnation,
                    address = %holder.address, "replacing the record of a dead predecessor (its address answers as this process)");
                over = Some(current.mod_revision);
                races += 1;
                if races > MAX_RACES {
                    return Err(Refused::Failed(kept_changing(&key)));
                }
            }
            // Whatever answers at the record's address is not the fleet's holder of
            // this id (a forged record): the id is this process's to take, at once.
            Holder::Unproven(why) => {
                note_taken_back(shared, &key, &holder, &why, current.lease);
                over = Some(current.mod_revision);
                races += 1;
                if races > MAX_RACES {
                    return Err(Refused::Failed(kept_changing(&key)));
                }
            }
            // This process is the registered one, checking its own record: only a
            // holder that proves itself alive and authorised keeps a live process's
            // id, and one that does not answer proves nothing.
            Holder::Unknown(why) if patience == Patience::OneRound && current.lease != 0 => {
                note_taken_back(shared, &key, &holder, &why, current.lease);
                over = Some(current.mod_revision);
                races += 1;
                if races > MAX_RACES {
                    return Err(Refused::Failed(kept_changing(&key)));
                }
            }
            // A record on no lease is no process's registration (nothing keeps it
            // alive; e.g. written by hand): a holder that does not answer loses it.
            Holder::Unknown(why) if current.lease == 0 => {
                tracing::warn!(target: "kvferry::directory", key, holder = %holder.address, why,
                    "replacing a record on no lease whose holder does not answer");
                over = Some(current.mod_revision);
                races += 1;
                if races > MAX_RACES {
                    return Err(Refused::Failed(kept_changing(&key)));
                }
            }
            Holder::Unknown(why) => {
                let deadline = match wait_until {
                    Some(d) => d,
                    None => {
                        let granted = holder_ttl(shared, current.lease).await;
                        let d = Instant::now() + granted.min(MAX_HOLDER_WAIT) + shared.cfg.call_timeout;
                        tracing::info!(target: "kvferry::directory", key, holder = %holder.address, why,
                            wait = ?granted.min(MAX_HOLDER_WAIT), "waiting for the holder's lease to expire");
                        *wait_until.insert(d)
                    }
                };
                if Instant::now() >= deadline {
                    return Err(Refused::Held(
                        holder,
                        format!("{why}, and its lease is still kept alive"),
                    ));
                }
                judged = Some((current.mod_revision, Holder::Unknown(why)));
                tokio::select! {
                    _ = shared.closed.cancelled() => return Err(Refused::Failed(DirectoryError::Closed)),
                    _ = tokio::time::sleep(WAIT_POLL) => {}
                }
            }
        }
    }
}

/// Logs and counts a record taken back from a holder that did not prove itself.
fn note_taken_back(shared: &Shared, key: &str, holder: &PeerRecord, why: &str, lease: i64) {
    tracing::warn!(target: "kvferry::directory", key, holder = %holder.address,
        incarnation = format_args!("{:#x}", holder.incarnation), why, lease,
        "taking the record back from a holder that does not prove itself alive and authorised");
    shared.taken_back.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

fn kept_changing(key: &str) -> DirectoryError {
    DirectoryError::Backend {
        op: "register",
        reason: format!("the record at {key} kept changing; try again"),
    }
}

/// The TTL a holder's lease was granted (the call deadline when etcd does not say).
async fn holder_ttl(shared: &Shared, lease: i64) -> Duration {
    match shared
        .call(
            "lease time to live",
            shared.client.lease_client().time_to_live(lease, None),
        )
        .await
    {
        Ok(r) if r.granted_ttl() > 0 => Duration::from_secs(r.granted_ttl() as u64),
        _ => shared.cfg.call_timeout,
    }
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
    // Revoking the lease deletes every key attached to it (only this process's record:
    // a record another process holds is on that process's lease).
    shared
        .call("revoke lease", shared.client.lease_client().revoke(reg.lease_id))
        .await
        .map(|_| ())
}

/// Keeps the registration's lease alive every TTL/3 and then checks the record (at
/// once, too, when the view saw the key change). When etcd says the lease is gone,
/// registers again on a new lease with the **same** incarnation: the process did not
/// restart, and its connections keep presenting that incarnation, so the directory and
/// the wire agree. Consumers already saw the record deleted (`Lost`: their in-flight
/// transfers failed and what was staged for them was released), so nothing they held
/// survives the gap; the record coming back is a `Joined`. A record deleted or
/// overwritten behind the process's back is put back unless a live process holds it.
async fn keep_alive(shared: Arc<Shared>, stop: CancellationToken) {
    let period = (shared.cfg.ttl / 3).max(Duration::from_millis(100));
    let mut next_renewal = Instant::now() + period;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep_until(next_renewal) => {}
            _ = shared.check_now.notified() => {}
        }
        let Some((mut lease_id, record)) = shared.reg.lock().as_ref().map(|r| (r.lease_id, r.record.clone())) else {
            return;
        };
        if Instant::now() >= next_renewal {
            next_renewal = Instant::now() + period;
            match shared
                .call("keep lease alive", shared.client.lease_client().keep_alive(lease_id))
                .await
            {
                Ok(_) => {}
                Err(DirectoryError::Backend { reason, .. }) if reason.contains("lease not found") => {
                    tracing::warn!(target: "kvferry::directory", lease_id, "registration lease lost; registering again (same incarnation)");
                    shared.state.send_replace(RegistrationState::Lost);
                    match grant(&shared).await {
                        Ok(id) => {
                            if stop.is_cancelled() {
                                revoke(&shared, id).await;
                                return;
                            }
                            lease_id = id;
                            if let Some(r) = shared.reg.lock().as_mut() {
                                r.lease_id = id;
                            }
                        }
                        Err(e) => {
                            tracing::warn!(target: "kvferry::directory", error = %e, "re-registration failed; retrying");
                            continue;
                        }
                    }
                }
                Err(e) => {
                    tracing::debug!(target: "kvferry::directory", lease_id, error = %e, "keep-alive failed; retrying");
                    continue;
                }
            }
        }
        if stop.is_cancelled() {
            return;
        }
        check_record(&shared, &record, lease_id).await;
    }
}

/// Makes sure the key holds this registration's record, and publishes the state.
async fn check_record(shared: &Shared, record: &PeerRecord, lease_id: i64) {
    let was = shared.state.borrow().is_registered();
    match claim(shared, record, lease_id, Patience::OneRound).await {
        Ok(claimed) => {
            if !was || claimed != Claimed::Kept {
                tracing::warn!(target: "kvferry::directory", peer_id = %record.peer_id,
                    incarnation = format_args!("{:#x}", record.incarnation), ?claimed,
                    "this process's record was missing or replaced; registered again, visible to peers");
            }
            shared.state.send_if_modified(|s| {
                let fresh = RegistrationState::Registered(record.clone());
                let changed = *s != fresh;
                *s = fresh;
                changed
            });
        }
        Err(Refused::Held(h, why)) => {
            if was {
                tracing::warn!(target: "kvferry::directory", peer_id = %record.peer_id, holder = %h.address,
                    incarnation = format_args!("{:#x}", h.incarnation), why,
                    "this process's record is held by another process: not visible to peers (unregistered) until it is free");
            }
            shared.state.send_replace(RegistrationState::Lost);
        }
        Err(Refused::Failed(e)) => {
            // etcd unreachable: the lease decides (renewals go on; its loss is seen).
            tracing::debug!(target: "kvferry::directory", error = %e, "record check failed; retrying");
        }
    }
}
