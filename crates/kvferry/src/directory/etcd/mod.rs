//! [`EtcdDirectory`]: the peer directory for fleets, on etcd (cargo feature `etcd`).
//!
//! # Records and leases
//!
//! A peer registers `<namespace>/peers/<peer_id>` → its [`PeerRecord`] as JSON, on an
//! etcd lease (TTL default 10 s) kept alive every TTL/3 by a dedicated task. The
//! registration is a create-if-absent transaction: while another live process holds
//! the id, registering fails with [`DirectoryError::DuplicatePeerId`] naming the
//! holder. A record advertising the registering process's own address with another
//! incarnation belongs to a dead predecessor (the address is bound by the registering
//! process) and is replaced: consumers see [`PeerEvent::Restarted`] at once instead of
//! waiting for the old lease to expire. [`Directory::deregister`] (a clean shutdown) deletes the record and revokes
//! the lease. When etcd says the lease is gone (expired while etcd was unreachable),
//! the task registers again on a new lease with the same incarnation (the process did
//! not restart and its connections still present it); consumers saw the delete as
//! `Lost` and dropped whatever they held, then see `Joined`.
//!
//! # The view
//!
//! A second task lists the prefix, then watches it from the list's revision (a
//! compacted revision means: list again), feeding a [`PeerView`] and broadcasting its
//! [`PeerEvent`]s. It asks etcd for watch progress every `stale_after / 3`; when etcd
//! is silent past `stale_after` or the watch breaks, the view is flagged stale (known
//! peers stay usable) and the task reconnects with exponential backoff.
//!
//! Every etcd call is bounded by `call_timeout`: nothing waits on etcd unbounded, and
//! [`Directory::resolve`] / [`Directory::live_peers`] answer from memory.
//!
//! # Cancellation
//!
//! Dropping the directory stops both tasks (a registration then expires with its
//! lease). Dropping a `register` or `deregister` future midway leaves etcd as the last
//! completed call left it; the keep-alive task is only started once registration
//! completed.

mod config;
mod lease;
mod watch;

pub use config::EtcdConfig;

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use parking_lot::Mutex;
use tokio::sync::broadcast;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::record::{LivePeers, PeerEvent, PeerRecord};
use super::view::PeerView;
use super::{Directory, DirectoryError, Prober, RegistrationState, EVENT_CAPACITY};

/// Longest a registration waits for a record it cannot prove dead to expire.
pub const MAX_HOLDER_WAIT: Duration = Duration::from_secs(60);

/// This process's registration.
pub(crate) struct Registration {
    record: PeerRecord,
    lease_id: i64,
    /// Stops the keep-alive task.
    stop: CancellationToken,
}

pub(crate) struct Shared {
    cfg: EtcdConfig,
    client: etcd_client::Client,
    view: Mutex<PeerView>,
    events: broadcast::Sender<PeerEvent>,
    /// True once the view was listed at least once.
    listed: tokio::sync::watch::Sender<bool>,
    closed: CancellationToken,
    reg: Mutex<Option<Registration>>,
    /// Published registration state.
    state: tokio::sync::watch::Sender<RegistrationState>,
    /// Tells who answers at an address (set by the engine).
    prober: Mutex<Option<Prober>>,
    /// Wakes the keep-alive task to check its record now (the view saw it change).
    check_now: tokio::sync::Notify,
    /// Records of this peer id taken back from holders that did not prove themselves.
    taken_back: std::sync::atomic::AtomicU64,
}

impl Shared {
    /// Runs one etcd call under the call deadline.
    async fn call<T>(
        &self,
        op: &'static str,
        fut: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, DirectoryError> {
        let started = Instant::now();
        match tokio::time::timeout(self.cfg.call_timeout, fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(DirectoryError::Backend {
                op,
                reason: e.to_string(),
            }),
            Err(_) => Err(DirectoryError::Timeout {
                op,
                waited: started.elapsed(),
                endpoints: self.cfg.endpoints_text(),
            }),
        }
    }

    fn key(&self, peer_id: &str) -> String {
        format!("{}{peer_id}", self.cfg.prefix())
    }

    /// The peer id this process is registered under, if any.
    fn own_id(&self) -> Option<String> {
        self.reg.lock().as_ref().map(|r| r.record.peer_id.clone())
    }

    fn publish(&self, events: Vec<PeerEvent>) {
        let own = self.own_id();
        if own.is_some() && events.iter().any(|e| Some(e.peer_id()) == own.as_deref()) {
            // Maybe its own record changed behind its back: the keep-alive task looks.
            self.check_now.notify_one();
        }
        for e in events {
            tracing::info!(target: "kvferry::directory", event = ?e, "peer event");
            let _ = self.events.send(e);
        }
    }
}

/// The etcd-backed directory. Cheap to share (`Arc`).
pub struct EtcdDirectory {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for EtcdDirectory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdDirectory")
            .field("endpoints", &self.shared.cfg.endpoints)
            .field("namespace", &self.shared.cfg.namespace)
            .finish()
    }
}

impl EtcdDirectory {
    /// Connects (lazily: an unreachable etcd is not an error here) and starts the view
    /// task. Must be called inside a tokio runtime.
    pub async fn connect(cfg: EtcdConfig) -> Result<EtcdDirectory, DirectoryError> {
        cfg.validate()?;
        let opts = etcd_client::ConnectOptions::new()
            .with_connect_timeout(cfg.call_timeout)
            .with_timeout(cfg.call_timeout)
            .with_keep_alive(Duration::from_secs(1), cfg.call_timeout);
        let started = Instant::now();
        let client = match tokio::time::timeout(
            cfg.call_timeout,
            etcd_client::Client::connect(&cfg.endpoints, Some(opts)),
        )
        .await
        {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                return Err(DirectoryError::Backend {
                    op: "connect",
                    reason: e.to_string(),
                })
            }
            Err(_) => {
                return Err(DirectoryError::Timeout {
                    op: "connect",
                    waited: started.elapsed(),
                    endpoints: cfg.endpoints_text(),
                })
            }
        };
        let (events, _) = broadcast::channel(EVENT_CAPACITY);
        let shared = Arc::new(Shared {
            view: Mutex::new(PeerView::new(cfg.stale_after)),
            cfg,
            client,
            events,
            listed: tokio::sync::watch::channel(false).0,
            closed: CancellationToken::new(),
            reg: Mutex::new(None),
            state: tokio::sync::watch::channel(RegistrationState::Unregistered).0,
            prober: Mutex::new(None),
            taken_back: std::sync::atomic::AtomicU64::new(0),
            check_now: tokio::sync::Notify::new(),
        });
        tokio::spawn(watch::run(shared.clone()));
        Ok(EtcdDirectory { shared })
    }

    /// Waits until the view was listed once, or `timeout` passes.
    pub async fn wait_listed(&self, timeout: Duration) -> Result<(), DirectoryError> {
        let mut rx = self.shared.listed.subscribe();
        let started = Instant::now();
        let listed = tokio::time::timeout(timeout, rx.wait_for(|l| *l)).await.is_ok();
        match listed {
            true => Ok(()),
            false => Err(DirectoryError::Timeout {
                op: "list peers",
                waited: started.elapsed(),
                endpoints: self.shared.cfg.endpoints_text(),
            }),
        }
    }

    /// The settings.
    pub fn config(&self) -> &EtcdConfig {
        &self.shared.cfg
    }

    /// Stops the background tasks (a registration then expires with its lease unless
    /// [`Directory::deregister`] removed it first).
    pub fn close(&self) {
        self.shared.closed.cancel();
        if let Some(r) = self.shared.reg.lock().take() {
            r.stop.cancel();
        }
    }
}

impl Drop for EtcdDirectory {
    fn drop(&mut self) {
        self.close();
    }
}

impl Directory for EtcdDirectory {
    fn resolve(&self, peer: &str) -> Option<String> {
        self.shared.view.lock().resolve(peer)
    }

    fn live_peers(&self) -> LivePeers {
        self.shared.view.lock().snapshot(Instant::now())
    }

    fn register(&self, record: PeerRecord) -> BoxFuture<'_, Result<(), DirectoryError>> {
        Box::pin(lease::register(self.shared.clone(), record))
    }

    fn deregister(&self) -> BoxFuture<'_, Result<(), DirectoryError>> {
        Box::pin(lease::deregister(self.shared.clone()))
    }

    fn subscribe(&self) -> broadcast::Receiver<PeerEvent> {
        self.shared.events.subscribe()
    }

    fn registration(&self) -> Option<PeerRecord> {
        self.shared.reg.lock().as_ref().map(|r| r.record.clone())
    }

    fn registration_state(&self) -> Option<tokio::sync::watch::Receiver<RegistrationState>> {
        Some(self.shared.state.subscribe())
    }

    fn record(&self, peer: &str) -> Option<PeerRecord> {
        self.shared.view.lock().record(peer).cloned()
    }

    fn records_taken_back(&self) -> u64 {
        self.shared.taken_back.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn set_prober(&self, prober: Prober) {
        *self.shared.prober.lock() = Some(prober);
    }
}
