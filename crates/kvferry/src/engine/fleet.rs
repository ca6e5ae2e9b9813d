//! The engine's side of the peer directory: registering itself, reacting to peer
//! events, and locating keys on live peers.
//!
//! # Semantics
//!
//! - A listening engine with a directory registers a [`PeerRecord`] (its peer id, the
//!   advertised address, its incarnation and role) when it starts, and deregisters
//!   first thing in [`Engine::close`]. While the directory has lost its registration
//!   (a lease expired), its producer refuses new stages and gets with `Busy`.
//! - A task follows the directory's events: [`PeerEvent::Restarted`] fails the old
//!   incarnation's in-flight transfers with `PeerRestarted` and drops its idle pooled
//!   connections; [`PeerEvent::Lost`] fails them with `PeerLost` and releases the
//!   leases this engine staged for that peer. Any event clears the miss cache.
//! - [`Engine::locate`] asks every live peer (at most [`FAN_OUT`] at once, all under
//!   one deadline) how many of the keys it holds, and remembers a key no peer holds
//!   for [`MISS_TTL`]. A peer whose lookup timed out (e.g. it accepts and never
//!   answers) is skipped for [`SUSPECT_TTL`] or until the directory announces a change
//!   of it. [`Engine::locate_holder`] returns as soon as one peer holds every key.
//! - A peer dialled through its record (by id, or by [`Engine::locate`]) must answer
//!   with the record's peer id and incarnation: a connection presenting another is
//!   refused with [`NetError::WrongPeer`](crate::net::NetError::WrongPeer). A
//!   `Restarted` event moves the expectation to the new incarnation; `Lost` clears it.
//! - The directory judges who holds a record by dialling its address as this engine
//!   (its secret, its TLS settings; [`Directory::set_prober`](crate::directory::Directory::set_prober)):
//!   a holder that answers there is live and is never replaced.
//!
//! # Cancellation
//!
//! [`Engine::locate`] dropped midway drops its outstanding lookups (they own no
//! memory). The event task stops when the engine closes or is dropped.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures::StreamExt;
use parking_lot::Mutex;
use tokio::sync::broadcast::error::RecvError;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{Engine, EngineError, Inner};
use crate::directory::{MissCache, PeerEvent, PeerRecord, Probed, Prober, RegistrationState};
use crate::peer::{PeerError, PeerGone};
use crate::wire::ChunkKey;

/// Lookups in flight at once during [`Engine::locate`].
pub const FAN_OUT: usize = 16;
/// How long a key that no live peer held is answered as a miss without asking.
pub const MISS_TTL: Duration = Duration::from_millis(500);
/// How long a peer whose lookup timed out is not asked again (unless the directory
/// announces a change of it first).
pub const SUSPECT_TTL: Duration = Duration::from_secs(10);

/// The directory side of an engine.
pub(super) struct FleetState {
    stop: CancellationToken,
    misses: Mutex<MissCache>,
    /// Peers (id, incarnation) whose lookup timed out, until when they are skipped.
    suspects: Mutex<HashMap<(String, u64), Instant>>,
}

impl Default for FleetState {
    fn default() -> Self {
        FleetState {
            stop: CancellationToken::new(),
            misses: Mutex::new(MissCache::new(MISS_TTL, 65_536)),
            suspects: Mutex::new(HashMap::new()),
        }
    }
}

/// A live peer holding keys, from [`Engine::locate`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Located {
    /// Its peer id.
    pub peer_id: String,
    /// Its address.
    pub address: String,
    /// How many leading keys it holds (at least one).
    pub hits: usize,
}

impl Engine {
    /// Registers this engine and starts following the directory's events (nothing
    /// without a directory).
    pub(super) async fn attach_directory(&self) -> Result<(), EngineError> {
        let Some(dir) = self.inner.cfg.directory.clone() else {
            return Ok(());
        };
        // Subscribe before registering: no event between the two is missed.
        let rx = dir.subscribe();
        tokio::spawn(follow(Arc::downgrade(&self.inner), rx, self.inner.fleet.stop.clone()));
        if let Some(state) = dir.registration_state() {
            tokio::spawn(follow_registration(
                self.inner.producer.clone(),
                state,
                self.inner.fleet.stop.clone(),
            ));
        }
        let Some(bound) = self.inner.address else {
            return Ok(()); // a client-only engine registers nothing
        };
        let address = match &self.inner.cfg.advertise {
            Some(a) => a.clone(),
            None if bound.ip().is_unspecified() => {
                return Err(EngineError::InvalidConfig(format!(
                    "listening on {bound}: set the address to advertise in the directory \
                     (an unspecified address cannot be reached by peers)"
                )))
            }
            None => bound.to_string(),
        };
        dir.set_prober(prober(self.inner.cfg.net.clone()));
        let mut record = PeerRecord::new(self.peer_id(), address, self.incarnation());
        record.role = self.inner.cfg.role;
        record.capabilities = vec!["direct".into(), "staged".into(), "put".into()];
        dir.register(record).await?;
        Ok(())
    }

    /// Stops following events and deregisters, bounded by `deadline`.
    pub(super) async fn detach_directory(&self, deadline: Instant) {
        self.inner.fleet.stop.cancel();
        let Some(dir) = self.inner.cfg.directory.clone() else {
            return;
        };
        if self.inner.address.is_none() {
            return;
        }
        match tokio::time::timeout_at(deadline, dir.deregister()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(target: "kvferry::engine", error = %e, "deregistration failed (the record expires with its lease)")
            }
            Err(_) => tracing::warn!(target: "kvferry::engine", "deregistration did not finish by the close deadline"),
        }
    }

    /// Finds which live peers hold `keys` (how many leading keys each holds), best
    /// first, by asking every live peer of the directory under `deadline`, at most
    /// [`FAN_OUT`] at once. Peers that fail or do not answer in time count as holding
    /// nothing. Empty when no peer holds the first key (remembered for [`MISS_TTL`]).
    pub async fn locate(&self, keys: &[ChunkKey], deadline: Instant) -> Result<Vec<Located>, EngineError> {
        self.locate_until(keys, deadline, false).await
    }

    /// As [`Engine::locate`], but returns as soon as one peer holds every key (that
    /// peer alone; else the best one once all answered): a peer that accepts and never
    /// answers does not hold up a get that another peer can serve. `None` when no peer
    /// holds the first key.
    pub async fn locate_holder(&self, keys: &[ChunkKey], deadline: Instant) -> Result<Option<Located>, EngineError> {
        Ok(self.locate_until(keys, deadline, true).await?.into_iter().next())
    }

    async fn locate_until(
        &self,
        keys: &[ChunkKey],
        deadline: Instant,
        first_full: bool,
    ) -> Result<Vec<Located>, EngineError> {
        self.check_open()?;
        let dir = self
            .inner
            .cfg
            .directory
            .clone()
            .ok_or_else(|| EngineError::InvalidConfig("locating keys needs a directory".into()))?;
        let Some(first) = keys.first().copied() else {
            return Err(EngineError::Peer(PeerError::InvalidArgument("empty key list".into())));
        };
        if self.inner.fleet.misses.lock().is_miss(&first, Instant::now()) {
            return Ok(Vec::new());
        }
        let me = self.peer_id().to_string();
        let now = Instant::now();
        let peers: Vec<PeerRecord> = {
            let mut suspects = self.inner.fleet.suspects.lock();
            suspects.retain(|_, until| *until > now);
            dir.live_peers()
                .peers
                .into_iter()
                .map(|p| p.record)
                .filter(|r| r.peer_id != me && !suspects.contains_key(&(r.peer_id.clone(), r.incarnation)))
                .collect()
        };
        let consumer = self.inner.consumer.clone();
        let fleet = &self.inner.fleet;
        let mut lookups = futures::stream::iter(peers)
            .map(|r| {
                let consumer = consumer.clone();
                self.expect_record(&r);
                async move {
                    let hits = match consumer.lookup(&r.address, keys, deadline).await {
                        Ok(h) => h,
                        Err(e) => {
                            if matches!(e, PeerError::Timeout { .. }) {
                                fleet
                                    .suspects
                                    .lock()
                                    .insert((r.peer_id.clone(), r.incarnation), Instant::now() + SUSPECT_TTL);
                            }
                            tracing::debug!(target: "kvferry::engine", peer = %r.peer_id, error = %e, "lookup failed");
                            0
                        }
                    };
                    Located {
                        peer_id: r.peer_id,
                        address: r.address,
                        hits,
                    }
                }
            })
            .buffer_unordered(FAN_OUT);
        let mut found = Vec::new();
        while let Some(l) = lookups.next().await {
            if l.hits == 0 {
                continue;
            }
            if first_full && l.hits >= keys.len() {
                return Ok(vec![l]);
            }
            found.push(l);
        }
        found.sort_by(|a, b| b.hits.cmp(&a.hits).then_with(|| a.peer_id.cmp(&b.peer_id)));
        if found.is_empty() {
            self.inner.fleet.misses.lock().insert(first, Instant::now());
        }
        Ok(found)
    }
}

impl Engine {
    /// Makes connections to `record`'s address accept only its peer id and
    /// incarnation; returns the address.
    pub fn expect_record(&self, record: &PeerRecord) -> String {
        if let Ok(pool) = self.inner.consumer.pool(&record.address) {
            pool.expect_identity(Some((record.peer_id.clone(), record.incarnation)));
        }
        record.address.clone()
    }
}

/// Who answers at an address, found by a handshake as this engine (a throwaway
/// connection, bounded by the connect and handshake timeouts).
fn prober(net: crate::net::NetConfig) -> Prober {
    Arc::new(move |addr: String| {
        let net = net.clone();
        Box::pin(async move {
            let limit = net.connect_timeout + net.handshake_timeout;
            let pool = match crate::net::Pool::new(addr.clone(), net) {
                Ok(p) => p,
                Err(e) => return Probed::NoAnswer(e.to_string()),
            };
            match pool.checkout(Instant::now() + limit).await {
                Ok(conn) => Probed::Answered {
                    peer_id: conn.peer().peer_id.clone(),
                    incarnation: conn.peer().incarnation,
                },
                // It answered, and failed to prove the fleet's secret after this
                // engine proved it: whatever it is, it is not one of this fleet's
                // peers. (One that refused this engine's proof proves nothing about
                // itself: this engine may be the one outside the fleet.)
                Err(e) if e.server_unproven() => Probed::Unproven(e.to_string()),
                Err(e) => Probed::NoAnswer(e.to_string()),
            }
        }) as futures::future::BoxFuture<'static, Probed>
    })
}

/// While the directory has lost this engine's registration, its producer refuses new
/// stages and gets (peers cannot see it, and a consumer that still can would be using
/// a stale view); it accepts them again once registered anew.
async fn follow_registration(
    producer: crate::peer::Producer,
    mut state: tokio::sync::watch::Receiver<RegistrationState>,
    stop: CancellationToken,
) {
    loop {
        let lost = matches!(*state.borrow_and_update(), RegistrationState::Lost);
        producer.set_refusing(lost);
        tokio::select! {
            _ = stop.cancelled() => return,
            changed = state.changed() => if changed.is_err() { return },
        }
    }
}

/// Follows the directory's events until `stop` or the engine is gone.
async fn follow(inner: Weak<Inner>, mut rx: tokio::sync::broadcast::Receiver<PeerEvent>, stop: CancellationToken) {
    loop {
        let ev = tokio::select! {
            _ = stop.cancelled() => return,
            ev = rx.recv() => ev,
        };
        let Some(inner) = inner.upgrade() else { return };
        match ev {
            Ok(ev) => apply(&inner, ev),
            Err(RecvError::Lagged(n)) => {
                tracing::warn!(target: "kvferry::engine", missed = n, "fell behind the directory's events");
            }
            Err(RecvError::Closed) => return,
        }
    }
}

fn apply(inner: &Inner, ev: PeerEvent) {
    inner.fleet.misses.lock().clear();
    inner.fleet.suspects.lock().retain(|(id, _), _| id != ev.peer_id());
    if ev.peer_id() == inner.cfg.net.peer_id {
        return;
    }
    match ev {
        PeerEvent::Joined(_) => {}
        PeerEvent::Restarted { old, new } => {
            if let Some(pool) = inner.consumer.existing_pool(&new.address) {
                pool.expect_identity(Some((new.peer_id.clone(), new.incarnation)));
            }
            inner.consumer.fail_peer(
                &old.address,
                PeerGone::Restarted {
                    old: old.incarnation,
                    new: new.incarnation,
                },
            );
            inner.producer.release_peer(&old.peer_id);
        }
        PeerEvent::Lost(r) => {
            if let Some(pool) = inner.consumer.existing_pool(&r.address) {
                pool.expect_identity(None);
            }
            inner.consumer.fail_peer(
                &r.address,
                PeerGone::Lost {
                    reason: "it left the directory (lease expired or deregistered)".into(),
                },
            );
            let n = inner.producer.release_peer(&r.peer_id);
            if n > 0 {
                tracing::info!(target: "kvferry::engine", peer = %r.peer_id, leases = n, "released leases staged for a lost peer");
            }
        }
    }
}
