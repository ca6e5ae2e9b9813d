//! The view task: list the prefix, watch from the list's revision, ask for progress,
//! and on any break flag the view stale and reconnect with backoff.
//!
//! # Cancellation
//!
//! The task ends when the directory's `closed` token is cancelled; every await in it
//! is bounded by the call deadline or races that token.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{EventType, GetOptions, WatchOptions};
use tokio::time::Instant;

use super::Shared;
use crate::directory::record::PeerRecord;
use crate::directory::view::Step;
use crate::directory::DirectoryError;

/// Runs until the directory is closed.
pub(super) async fn run(shared: Arc<Shared>) {
    let mut backoff = shared.cfg.backoff_min;
    while !shared.closed.is_cancelled() {
        let step = shared.view.lock().next_step();
        let ok = match step {
            Step::List => list(&shared).await,
            Step::Watch { from } => watch(&shared, from).await,
        };
        match ok {
            Ok(()) => backoff = shared.cfg.backoff_min,
            Err(e) => {
                shared.view.lock().disconnected();
                tracing::debug!(target: "kvferry::directory", error = %e, ?backoff, "etcd unreachable; view stale, retrying");
                tokio::select! {
                    _ = shared.closed.cancelled() => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(shared.cfg.backoff_max);
            }
        }
    }
}

fn parse(key: &[u8], value: &[u8]) -> Result<PeerRecord, DirectoryError> {
    serde_json::from_slice(value).map_err(|e| DirectoryError::BadRecord {
        key: String::from_utf8_lossy(key).into_owned(),
        reason: e.to_string(),
    })
}

/// The peer id of a key under the prefix.
fn id_of<'a>(prefix: &str, key: &'a [u8]) -> Option<&'a str> {
    std::str::from_utf8(key).ok()?.strip_prefix(prefix)
}

async fn list(shared: &Shared) -> Result<(), DirectoryError> {
    let prefix = shared.cfg.prefix();
    let resp = shared
        .call(
            "list peers",
            shared
                .client
                .kv_client()
                .get(prefix.clone(), Some(GetOptions::new().with_prefix())),
        )
        .await?;
    let revision = resp.header().map(|h| h.revision()).unwrap_or(0);
    let mut records = Vec::new();
    for kv in resp.kvs() {
        match parse(kv.key(), kv.value()) {
            // A record whose id disagrees with its key is ignored, like a bad one.
            Ok(r) if id_of(&prefix, kv.key()) == Some(r.peer_id.as_str()) => records.push(r),
            Ok(_) => {
                tracing::warn!(target: "kvferry::directory", key = %String::from_utf8_lossy(kv.key()), "record names another peer id; ignored")
            }
            Err(e) => tracing::warn!(target: "kvferry::directory", error = %e, "ignored"),
        }
    }
    let events = shared.view.lock().listed(records, revision, Instant::now());
    shared.publish(events);
    shared.listed.send_replace(true);
    Ok(())
}

async fn watch(shared: &Shared, from: i64) -> Result<(), DirectoryError> {
    let prefix = shared.cfg.prefix();
    let opts = WatchOptions::new().with_prefix().with_start_revision(from);
    let (mut watcher, mut stream) = shared
        .call(
            "watch peers",
            shared.client.watch_client().watch(prefix.clone(), Some(opts)),
        )
        .await?;
    let tick = (shared.cfg.stale_after / 3).max(Duration::from_millis(50));
    let mut last_heard = Instant::now();
    shared.view.lock().confirmed(last_heard);
    loop {
        tokio::select! {
            _ = shared.closed.cancelled() => {
                let _ = tokio::time::timeout(shared.cfg.call_timeout, watcher.cancel()).await;
                return Ok(());
            }
            _ = tokio::time::sleep(tick) => {
                if last_heard.elapsed() > shared.cfg.stale_after {
                    return Err(DirectoryError::Timeout {
                        op: "watch progress",
                        waited: last_heard.elapsed(),
                        endpoints: shared.cfg.endpoints_text(),
                    });
                }
                // Bounded: a progress request that cannot be sent is a broken watch.
                shared.call("request watch progress", watcher.request_progress()).await?;
            }
            msg = stream.message() => {
                let resp = match msg {
                    Ok(Some(r)) => r,
                    Ok(None) => return Err(DirectoryError::Backend { op: "watch peers", reason: "watch stream ended".into() }),
                    Err(e) => return Err(DirectoryError::Backend { op: "watch peers", reason: e.to_string() }),
                };
                last_heard = Instant::now();
                if resp.compact_revision() > 0 {
                    tracing::info!(target: "kvferry::directory", from, compacted = resp.compact_revision(), "watch revision compacted; listing again");
                    shared.view.lock().compacted();
                    return Ok(());
                }
                if resp.canceled() {
                    return Err(DirectoryError::Backend { op: "watch peers", reason: format!("watch cancelled: {}", resp.cancel_reason()) });
                }
                let mut events = Vec::new();
                {
                    let mut view = shared.view.lock();
                    view.confirmed(last_heard);
                    for ev in resp.events() {
                        let Some(kv) = ev.kv() else { continue };
                        let Some(id) = id_of(&prefix, kv.key()) else { continue };
                        let rev = kv.mod_revision();
                        match ev.event_type() {
                            EventType::Put => match parse(kv.key(), kv.value()) {
                                Ok(r) if r.peer_id == id => events.extend(view.put(r, rev, last_heard)),
                                Ok(_) => tracing::warn!(target: "kvferry::directory", key = id, "record names another peer id; ignored"),
                                Err(e) => tracing::warn!(target: "kvferry::directory", error = %e, "ignored"),
                            },
                            EventType::Delete => events.extend(view.deleted(id, rev, last_heard)),
                        }
                    }
                }
                shared.publish(events);
            }
        }
    }
}
