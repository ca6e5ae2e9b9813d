//! The registration table: each registered cache (host or device) with an explicit
//! count of its holders — its publications and the transfers using it — and whether a
//! deregistration waits for that count to reach zero.
//!
//! # Cancellation
//!
//! Nothing here waits: a deregistration that finds holders is *pending*, and the
//! unhold that takes the count to zero reports it complete. The waiter (the engine)
//! waits on a notification with its own deadline; when it gives up it calls
//! [`Ledger::abandon_deregister`](super::Ledger::abandon_deregister) and the cache
//! stays registered.

use std::collections::HashMap;

use super::vocab::RegId;

/// Why a registration operation was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum RegError {
    /// Not registered (never, or already deregistered).
    #[error("not registered")]
    NotRegistered,
    /// Being deregistered: no new holder may take it.
    #[error("being deregistered")]
    Deregistering,
    /// Already registered under this id.
    #[error("already registered")]
    Duplicate,
}

/// Where a deregistration stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Deregistration {
    /// Done: nothing held it.
    Done,
    /// Waiting for this many holders to let go.
    Pending(usize),
}

#[derive(Debug, Default)]
struct RegRecord {
    holders: usize,
    deregistering: bool,
}

/// The registrations of one ledger.
#[derive(Debug, Default)]
pub(super) struct RegistrationTable {
    regs: HashMap<RegId, RegRecord>,
}

impl RegistrationTable {
    /// Registers `id` with no holders.
    pub(super) fn register(&mut self, id: RegId) -> Result<(), RegError> {
        if self.regs.contains_key(&id) {
            return Err(RegError::Duplicate);
        }
        self.regs.insert(id, RegRecord::default());
        Ok(())
    }

    /// One more holder of `id`.
    pub(super) fn hold(&mut self, id: RegId) -> Result<(), RegError> {
        match self.regs.get_mut(&id) {
            None => Err(RegError::NotRegistered),
            Some(r) if r.deregistering => Err(RegError::Deregistering),
            Some(r) => {
                r.holders += 1;
                Ok(())
            }
        }
    }

    /// One holder of `id` fewer; `Some(id)` when that completed its deregistration.
    pub(super) fn unhold(&mut self, id: RegId) -> Option<RegId> {
        let r = self.regs.get_mut(&id)?;
        debug_assert!(r.holders > 0, "registration unheld more than held");
        r.holders = r.holders.saturating_sub(1);
        if r.holders == 0 && r.deregistering {
            self.regs.remove(&id);
            return Some(id);
        }
        None
    }

    /// Starts deregistering `id`: done at once without holders, else pending until the
    /// last holder lets go (no new holder is admitted meanwhile).
    pub(super) fn deregister(&mut self, id: RegId) -> Result<Deregistration, RegError> {
        let r = self.regs.get_mut(&id).ok_or(RegError::NotRegistered)?;
        if r.holders == 0 {
            self.regs.remove(&id);
            return Ok(Deregistration::Done);
        }
        r.deregistering = true;
        Ok(Deregistration::Pending(r.holders))
    }

    /// A pending deregistration gave up: `id` stays registered (and may be held
    /// again). Returns its holders; `None` if it completed meanwhile (or is unknown).
    pub(super) fn abandon_deregister(&mut self, id: RegId) -> Option<usize> {
        let r = self.regs.get_mut(&id)?;
        r.deregistering = false;
        Some(r.holders)
    }

    /// Holders of `id` now (`None`: not registered).
    pub(super) fn holders(&self, id: RegId) -> Option<usize> {
        self.regs.get(&id).map(|r| r.holders)
    }
}
