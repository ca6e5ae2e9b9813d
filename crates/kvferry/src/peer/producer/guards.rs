//! The guards that report to the producer's ledger when they drop, so that every
//! path — success, error, cancellation — ends what it holds:
//!
//! - [`Staging`]: a lease being staged; granted, or dropped on any other path (a failed
//!   or cancelled stage), which ends the lease;
//! - [`Sending`]: a lease checked out for a send; checked back in, or dropped (a failed
//!   or aborted send), which drops its payload (pages and quota charge back) and ends
//!   the lease;
//! - [`Hold`]: a holder of a registered cache; its last drop while the cache is being
//!   deregistered completes the deregistration.
//!
//! # Cancellation
//!
//! Nothing here is awaited. A future holding one of these guards may be dropped at any
//! await: the guard's `Drop` tells the ledger and acts on its answer (see
//! [`act`](Producer::act)).

use std::time::Duration;

use tokio::time::Instant;

use super::staged::StagedLease;
use super::Producer;
use crate::peer::error::PeerError;
use crate::peer::ledger::{CheckOut, LeaseRefusal, LeaseTerms, PubId, RegId, Who};
use crate::peer::quota::Holder;
use crate::wire::{ErrorKind, LeaseId};

/// A lease being staged (its pages filled, its publications held): granted with
/// [`grant`](Self::grant); dropped on any other path (a failed or cancelled stage), it
/// ends the lease in the ledger.
pub(super) struct Staging<'a> {
    pub(super) producer: &'a Producer,
    pub(super) id: LeaseId,
    pub(super) armed: bool,
}

impl Staging<'_> {
    /// Grants the lease its payload (charged for `pages`) for `ttl`; refused (with
    /// the payload dropped) when the producer shut down or the owner left meanwhile.
    pub(super) fn grant(mut self, payload: StagedLease, pages: usize, ttl: Duration) -> Result<LeaseId, PeerError> {
        self.armed = false;
        let granted = self
            .producer
            .inner
            .ledger
            .lock()
            .grant(self.id, payload, pages, Instant::now(), ttl);
        match granted {
            Ok(()) => Ok(self.id),
            Err(out) => {
                self.producer.act(out);
                Err(PeerError::ShuttingDown)
            }
        }
    }
}

impl Drop for Staging<'_> {
    fn drop(&mut self) {
        if self.armed {
            let out = self
                .producer
                .inner
                .ledger
                .lock()
                .staging_failed(self.id, Instant::now());
            self.producer.act(out);
        }
    }
}

/// A lease checked out for a send: the send reads [`lease`](Self::lease), then
/// [`check_in`](Self::check_in)s it. Dropped instead (a failed or aborted send, after
/// the socket write stopped, since the write borrows it), it drops the payload and
/// tells the ledger, which ends the lease.
pub(super) struct Sending<'a> {
    producer: &'a Producer,
    id: LeaseId,
    lease: Option<StagedLease>,
}

impl Sending<'_> {
    pub(super) fn lease(&self) -> &StagedLease {
        self.lease.as_ref().expect("held until checked in or dropped")
    }

    /// Gives the lease back to the ledger (it waits again, or ends now if an end was
    /// accepted while it was out).
    pub(super) fn check_in(mut self) {
        if let Some(lease) = self.lease.take() {
            let out = self
                .producer
                .inner
                .ledger
                .lock()
                .check_in(self.id, lease, Instant::now());
            self.producer.act(out);
        }
    }
}

impl Drop for Sending<'_> {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take() {
            drop(lease); // pages and charge back
            let out = self.producer.inner.ledger.lock().send_dropped(self.id, Instant::now());
            self.producer.act(out);
        }
    }
}

/// A holder of a registration (a transfer using its cache): the ledger counts it
/// until this drops; the last drop of a cache being deregistered completes the
/// deregistration.
pub struct Hold {
    pub(super) producer: Producer,
    pub(super) id: RegId,
}

impl std::fmt::Debug for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Hold({})", self.id.0)
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        let done = self.producer.inner.ledger.lock().unhold(self.id);
        if done.is_some() {
            self.producer.inner.deregistered.notify_waiters();
        }
    }
}

impl Producer {
    /// Starts a lease for `holder` serving publications `pubs` (held by it from now
    /// on); the guard ends it unless it is granted.
    pub(super) fn begin(&self, holder: &Holder, incarnation: Option<u64>, pubs: Vec<PubId>) -> Staging<'_> {
        let terms = LeaseTerms {
            owner: holder.identity.clone(),
            owner_incarnation: incarnation,
            claimed_by: holder.claimed.clone(),
            publications: pubs,
        };
        let id = self.inner.ledger.lock().begin(terms, rand::random::<LeaseId>);
        Staging {
            producer: self,
            id,
            armed: true,
        }
    }

    /// Checks lease `lease_id` out for a send to `who` (tied to `eager_conn` for an
    /// eager get), or the refusal to answer.
    pub(super) fn check_out(
        &self,
        lease_id: LeaseId,
        who: &Who,
        eager_conn: Option<u64>,
    ) -> Result<Sending<'_>, (ErrorKind, String)> {
        let r = self
            .inner
            .ledger
            .lock()
            .check_out(lease_id, who, eager_conn, Instant::now());
        match r {
            CheckOut::Out(lease) => Ok(Sending {
                producer: self,
                id: lease_id,
                lease: Some(lease),
            }),
            CheckOut::Expired(out) => {
                self.act(out); // pages and charge back
                Err((ErrorKind::LeaseExpired, format!("lease {lease_id} expired")))
            }
            CheckOut::ExpiredEarlier => Err((ErrorKind::LeaseExpired, format!("lease {lease_id} expired"))),
            CheckOut::Refused(LeaseRefusal::Foreign) => {
                Err((ErrorKind::UnknownLease, format!("no lease {lease_id} for this peer")))
            }
            CheckOut::Refused(LeaseRefusal::Unknown) => Err((ErrorKind::UnknownLease, format!("no lease {lease_id}"))),
        }
    }
}
