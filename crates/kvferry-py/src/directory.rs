//! The engine's peer directory from Python: `Engine(directory="etcd://HOST:PORT")`
//! connects to etcd (cargo feature `etcd` of this crate, which needs `protoc` to
//! build), and the live peers as JSON for `Engine.peers()`.
//!
//! # Cancellation
//!
//! [`connect_etcd`] is bounded by its `wait`; dropped midway it leaves no
//! registration (the engine registers only once it starts).

use std::sync::Arc;
use std::time::Duration;

use kvferry::engine::{Directory, LivePeers};

use crate::errors::ErrInfo;

/// Whether this build can use an etcd directory.
pub const HAS_ETCD: bool = cfg!(feature = "etcd");

/// Connects to etcd at `url` (`etcd://HOST:PORT[,HOST:PORT...]`) under `namespace`
/// and waits (at most `wait`) for the first list of peers.
#[cfg(feature = "etcd")]
pub async fn connect_etcd(
    url: &str,
    namespace: &str,
    ttl: Duration,
    wait: Duration,
) -> Result<Arc<dyn Directory>, ErrInfo> {
    use kvferry::engine::{EtcdConfig, EtcdDirectory};
    let invalid = |e: kvferry::engine::DirectoryError| ErrInfo::invalid(format!("directory: {e}"));
    let endpoints = EtcdConfig::parse_url(url).map_err(invalid)?;
    let mut cfg = EtcdConfig::new(endpoints, namespace.to_string());
    cfg.ttl = ttl;
    cfg.validate().map_err(invalid)?;
    let dir = EtcdDirectory::connect(cfg)
        .await
        .map_err(|e| ErrInfo::new(kvferry::ErrorCode::Directory, format!("directory {url}: {e}")).op("connect"))?;
    dir.wait_listed(wait).await.map_err(|_| {
        ErrInfo::new(
            kvferry::ErrorCode::Timeout,
            format!("cannot reach etcd at {url} within {wait:?} (is it running?)"),
        )
        .op("connect")
    })?;
    Ok(Arc::new(dir))
}

/// Without the `etcd` feature: a clear error saying how to get it.
#[cfg(not(feature = "etcd"))]
pub async fn connect_etcd(
    url: &str,
    _namespace: &str,
    _ttl: Duration,
    _wait: Duration,
) -> Result<Arc<dyn Directory>, ErrInfo> {
    Err(ErrInfo::invalid(format!(
        "directory {url:?}: this build of kvferry has no etcd support; rebuild the package \
         with the `etcd` feature (`maturin develop --features etcd`, needs protoc)"
    )))
}

/// The live peers as `{"stale": bool, "peers": [...]}`.
pub fn live_peers_json(live: &LivePeers) -> String {
    let peers: Vec<serde_json::Value> = live
        .peers
        .iter()
        .map(|p| {
            serde_json::json!({
                "peer_id": p.record.peer_id,
                "address": p.record.address,
                "incarnation": p.record.incarnation,
                "role": p.record.role.to_string(),
                "known_for": p.known_for.as_secs_f64(),
            })
        })
        .collect();
    serde_json::json!({ "stale": live.stale, "peers": peers }).to_string()
}
