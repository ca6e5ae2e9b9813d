//! Registrations: each registered cache (host or device) counted in the ledger, with
//! its holders — its publications, and the transfers using it (each a [`Hold`]). A
//! deregistration completes at once without holders, else when the last holder lets
//! go, or fails at its deadline (the cache then stays registered).
//!
//! # Cancellation
//!
//! [`deregister`](Producer::deregister) waits on a notification, woken by the last
//! holder's release. Dropped while it waits, it leaves the deregistration pending in
//! the ledger (no new holder is admitted): it completes when the last holder lets go;
//! only a wait that reaches its deadline gives it up.

use tokio::time::Instant;

use super::guards::Hold;
use super::Producer;
use crate::peer::ledger::{Deregistration, RegError, RegId};

/// Registrations: each registered cache (host or device) counted in the ledger.
impl Producer {
    /// Records registration `id` (no holders).
    pub(crate) fn register(&self, id: u64) -> Result<(), RegError> {
        self.inner.ledger.lock().register(RegId(id))
    }

    /// One more holder of registration `id`, until the [`Hold`] drops; refused if it
    /// is not registered or is being deregistered.
    pub(crate) fn hold(&self, id: u64) -> Result<Hold, RegError> {
        self.inner.ledger.lock().hold(RegId(id))?;
        Ok(Hold {
            producer: self.clone(),
            id: RegId(id),
        })
    }

    /// Holders of registration `id` now (`None`: not registered).
    pub(crate) fn holders(&self, id: u64) -> Option<usize> {
        self.inner.ledger.lock().holders(RegId(id))
    }

    /// Deregisters `id`: at once without holders, else when the last holder lets go
    /// (woken by it, not polled), or at `deadline`: then it stays registered and the
    /// holders left are the error.
    pub(crate) async fn deregister(&self, id: u64, deadline: Instant) -> Result<(), DeregisterError> {
        let id = RegId(id);
        let notified = self.inner.deregistered.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        match self.inner.ledger.lock().deregister(id) {
            Err(_) => return Err(DeregisterError::NotRegistered),
            Ok(Deregistration::Done) => return Ok(()),
            Ok(Deregistration::Pending(_)) => {}
        }
        loop {
            let woken = tokio::time::timeout_at(deadline, notified.as_mut()).await.is_ok();
            // Armed before the check: a completion after it wakes the next wait.
            notified.set(self.inner.deregistered.notified());
            notified.as_mut().enable();
            let mut ledger = self.inner.ledger.lock();
            if ledger.holders(id).is_none() {
                return Ok(());
            }
            if !woken {
                let holders = ledger.abandon_deregister(id).unwrap_or(0);
                return Err(DeregisterError::InUse { holders });
            }
        }
    }
}

/// Why a deregistration failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DeregisterError {
    /// Not registered (or already deregistered).
    NotRegistered,
    /// Still held at the deadline by this many holders.
    InUse {
        /// Holders left.
        holders: usize,
    },
}
