//! A per-peer pool of handshaken connections.
//!
//! At most `connections_per_peer` connections to one peer are in use at once;
//! concurrent transfers are striped over them (each transfer holds one connection for
//! its duration). Idle connections are reused; a connection comes back to the pool
//! only through [`PooledConnection::finish`], so one abandoned mid-frame is closed.
//!
//! The pool remembers the peer's incarnation from the latest handshake; when a peer
//! restarts, new connections see a new incarnation and [`Pool::incarnation`] changes,
//! which makes references to the old incarnation fail fast.
//!
//! A pool may be told which peer id and incarnation should answer at its address
//! ([`Pool::expect_identity`], set from the directory's record when a peer is dialled
//! by id): a connection whose handshake presents another is refused with
//! [`NetError::WrongPeer`] (a stale or forged record does not get its bytes used).
//!
//! # Cancellation
//!
//! [`Pool::checkout`] is cancel-safe: a dropped checkout returns its permit and closes
//! any connection it had just opened.

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::{handshake, Connection, NetConfig, NetError};

struct Shared {
    addr: String,
    cfg: NetConfig,
    idle: Mutex<Vec<Connection>>,
    permits: Arc<Semaphore>,
    incarnation: AtomicU64,
    restarts: AtomicU64,
    /// Connections opened (handshaken) so far.
    opened: AtomicU64,
    /// The peer id and incarnation the directory says answer here, if dialled by id.
    expected: Mutex<Option<(String, u64)>>,
}

/// What a [`Pool`] holds now and has opened so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Connections checked out now.
    pub in_use: usize,
    /// Idle connections kept for reuse.
    pub idle: usize,
    /// Connections opened (handshake completed) since the pool was made.
    pub opened: u64,
}

/// Connections to one peer. Cheap to clone.
#[derive(Clone)]
pub struct Pool {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").field("addr", &self.shared.addr).finish()
    }
}

impl Pool {
    /// A pool for `addr` (no connection is made until the first checkout).
    pub fn new(addr: impl Into<String>, cfg: NetConfig) -> Result<Pool, NetError> {
        cfg.validate()?;
        let n = cfg.connections_per_peer;
        Ok(Pool {
            shared: Arc::new(Shared {
                addr: addr.into(),
                cfg,
                idle: Mutex::new(Vec::new()),
                permits: Arc::new(Semaphore::new(n)),
                incarnation: AtomicU64::new(0),
                restarts: AtomicU64::new(0),
                opened: AtomicU64::new(0),
                expected: Mutex::new(None),
            }),
        })
    }

    /// The peer address.
    pub fn addr(&self) -> &str {
        &self.shared.addr
    }

    /// The peer's incarnation from the latest handshake (0 before the first).
    pub fn incarnation(&self) -> u64 {
        self.shared.incarnation.load(Ordering::Acquire)
    }

    /// How many times a new incarnation of the peer was seen.
    pub fn restarts_seen(&self) -> u64 {
        self.shared.restarts.load(Ordering::Relaxed)
    }

    /// Connections in use and idle now, and opened so far.
    pub fn stats(&self) -> PoolStats {
        PoolStats {
            in_use: (self.shared.cfg.connections_per_peer).saturating_sub(self.shared.permits.available_permits()),
            idle: self.shared.idle.lock().len(),
            opened: self.shared.opened.load(Ordering::Relaxed),
        }
    }

    /// Sets (or, with `None`, clears) the peer id and incarnation that must answer at
    /// this address; idle connections of another peer are dropped.
    pub fn expect_identity(&self, who: Option<(String, u64)>) {
        let mut e = self.shared.expected.lock();
        if *e == who {
            return;
        }
        if let Some((id, inc)) = &who {
            self.shared
                .idle
                .lock()
                .retain(|c| c.peer().peer_id == *id && c.peer().incarnation == *inc);
        }
        *e = who;
    }

    /// A connection presenting another peer than the one expected is refused.
    fn check_identity(&self, conn: &Connection) -> Result<(), NetError> {
        let e = self.shared.expected.lock();
        match &*e {
            Some((id, inc)) if conn.peer().peer_id != *id || conn.peer().incarnation != *inc => {
                Err(NetError::WrongPeer {
                    addr: self.shared.addr.clone(),
                    expected_id: id.clone(),
                    expected_incarnation: *inc,
                    got_id: conn.peer().peer_id.clone(),
                    got_incarnation: conn.peer().incarnation,
                })
            }
            _ => Ok(()),
        }
    }

    /// Forgets idle connections (e.g. after the peer was lost).
    pub fn clear_idle(&self) {
        self.shared.idle.lock().clear();
    }

    /// A connection, reused or new, by `deadline`.
    pub async fn checkout(&self, deadline: Instant) -> Result<PooledConnection, NetError> {
        let start = Instant::now();
        let permit = match tokio::time::timeout_at(deadline, self.shared.permits.clone().acquire_owned()).await {
            Ok(Ok(p)) => p,
            Ok(Err(_)) => return Err(NetError::Protocol("pool closed".into())),
            Err(_) => {
                return Err(NetError::Timeout {
                    op: "wait for a free connection",
                    waited: start.elapsed(),
                })
            }
        };
        // Skip idle connections the peer has closed meanwhile (idle timeout, restart).
        let idle = loop {
            let Some(conn) = self.shared.idle.lock().pop() else {
                break None;
            };
            if !conn.is_stale() {
                break Some(conn);
            }
        };
        if let Some(conn) = idle {
            self.check_identity(&conn)?;
            return Ok(PooledConnection {
                conn: Some(conn),
                pool: self.clone(),
                _permit: permit,
                reused: true,
            });
        }
        let conn =
            match tokio::time::timeout_at(deadline, handshake::connect(&self.shared.addr, &self.shared.cfg)).await {
                Ok(r) => r?,
                Err(_) => {
                    return Err(NetError::Timeout {
                        op: "connect",
                        waited: start.elapsed(),
                    })
                }
            };
        self.shared.opened.fetch_add(1, Ordering::Relaxed);
        // Before the pool learns the incarnation: a wrong peer changes nothing here.
        self.check_identity(&conn)?;
        let inc = conn.peer().incarnation;
        let prev = self.shared.incarnation.swap(inc, Ordering::AcqRel);
        if prev != 0 && prev != inc {
            self.shared.restarts.fetch_add(1, Ordering::Relaxed);
            // Idle connections belong to the old incarnation.
            self.shared.idle.lock().clear();
            tracing::info!(target: "kvferry::net", peer = %conn.peer(), old = prev, new = inc, "peer restarted: new incarnation");
        }
        Ok(PooledConnection {
            conn: Some(conn),
            pool: self.clone(),
            _permit: permit,
            reused: false,
        })
    }
}

/// A checked-out connection. Dropped without [`finish`](Self::finish), it is closed.
pub struct PooledConnection {
    conn: Option<Connection>,
    pool: Pool,
    _permit: OwnedSemaphorePermit,
    reused: bool,
}

impl PooledConnection {
    /// Whether this connection was idle in the pool before (it may have gone stale).
    pub fn reused(&self) -> bool {
        self.reused
    }

    /// Returns the connection to the pool: only call when it is in sync (no frame
    /// half-read or half-written).
    pub fn finish(mut self) {
        if let Some(c) = self.conn.take() {
            if c.peer().incarnation == self.pool.incarnation() {
                self.pool.shared.idle.lock().push(c);
            }
        }
    }
}

impl Deref for PooledConnection {
    type Target = Connection;
    fn deref(&self) -> &Connection {
        self.conn.as_ref().expect("connection present until finish")
    }
}

impl DerefMut for PooledConnection {
    fn deref_mut(&mut self) -> &mut Connection {
        self.conn.as_mut().expect("connection present until finish")
    }
}
