//! The producer's side of the CMA mover (see [`crate::peer::mover`]): the same-host
//! offer (`MoverHello` → `MoverOffer`) and mapped gets (`GetMapped` →
//! `StagedMapped`).
//!
//! A mapped get is staged exactly as an eager get (published host blocks pinned,
//! store chunks pinned, device blocks gathered into staging pages), with the same
//! quotas and checksums. Instead of writing the bytes, the producer answers where
//! they are: `(address, length)` runs of its own memory whose concatenation is the
//! stream. The lease then waits in the ledger, tied to the connection like an eager
//! get's: it ends with the consumer's `Done` (which follows the read on the same
//! connection), with the connection's close after the grace, or at its TTL. Until then
//! the memory the runs name stays pinned and mapped. Nothing on this side runs during
//! the read: the consumer's kernel reads this process's pages.
//!
//! # Never corrupt, here
//!
//! The consumer verifies every chunk against the checksums in the reply, which were
//! taken when the bytes were staged or published; a producer that writes its
//! published blocks during the read is caught there, never landed as good.
//!
//! # Cancellation
//!
//! Both handlers answer synchronously once staging completed; a handler dropped while
//! staging ends the staging as an eager get's does.

use rand::RngCore;

use super::Producer;
use crate::peer::ledger::Who;
use crate::peer::mover::{boot_id, Transport};
use crate::wire::{ChunkMeta, CmaOffer, ErrorKind, LeaseId, Message, SelectedShape, MAX_MAPPED_RUNS};

/// This process's same-host identity: its boot id and a probe pattern that lives as
/// long as the producer.
pub(super) struct SameHost {
    boot_id: Option<String>,
    probe: Box<[u8; 32]>,
}

impl SameHost {
    pub(super) fn new() -> SameHost {
        let mut probe = Box::new([0u8; 32]);
        rand::thread_rng().fill_bytes(&mut probe[..]);
        SameHost {
            boot_id: boot_id(),
            probe,
        }
    }
}

impl Producer {
    /// What this producer offers a consumer whose boot id is `theirs`.
    pub(super) fn mover_offer(&self, theirs: &str) -> Message {
        let incarnation = self.inner.incarnation;
        let refuse = |why: &str| Message::MoverOffer {
            incarnation,
            cma: None,
            refused: why.to_string(),
        };
        let same = &self.inner.same_host;
        if self.inner.cfg.transport == Transport::Tcp {
            return refuse("the producer's transport is tcp");
        }
        match &same.boot_id {
            None => refuse("the producer cannot read its boot id"),
            Some(_) if theirs.is_empty() => refuse("the consumer did not say its boot id"),
            Some(mine) if mine != theirs => refuse("another host (boot ids differ)"),
            Some(_) => Message::MoverOffer {
                incarnation,
                cma: Some(CmaOffer {
                    pid: std::process::id(),
                    probe_addr: same.probe.as_ptr() as u64,
                    probe: *same.probe,
                }),
                refused: String::new(),
            },
        }
    }

    /// The reply to a mapped get staged as `lease_id` (0: a miss): where each chunk's
    /// bytes are. The lease is checked back in, tied to connection `conn` (ended by
    /// `Done`, the connection's close after the grace, or its TTL).
    pub(super) fn map_lease(
        &self,
        lease_id: LeaseId,
        chunks: Vec<ChunkMeta>,
        shape: Option<SelectedShape>,
        who: &Who,
        conn: u64,
    ) -> Result<Message, (ErrorKind, String)> {
        let incarnation = self.inner.incarnation;
        if lease_id == 0 {
            return Ok(Message::StagedMapped {
                lease_id,
                incarnation,
                chunks,
                shape,
                runs: Vec::new(),
            });
        }
        let sending = self.check_out(lease_id, who, Some(conn))?;
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for i in 0..sending.lease().chunks.len() {
            let parts = sending
                .lease()
                .parts(i)
                .map_err(|e| (ErrorKind::Internal, e.to_string()))?;
            for p in parts.iter().filter(|p| !p.is_empty()) {
                let (addr, len) = (p.as_ptr() as u64, p.len() as u64);
                match runs.last_mut() {
                    // Contiguous with the previous run: one run (fewer iovecs).
                    Some((a, l)) if *a + *l == addr => *l += len,
                    _ => runs.push((addr, len)),
                }
            }
        }
        if runs.len() > MAX_MAPPED_RUNS {
            // The guard drops: the lease ends, as a failed eager send's does.
            drop(sending);
            let why = format!(
                "the grant needs {} memory runs, over the {MAX_MAPPED_RUNS} one reply may name; get it over the socket",
                runs.len()
            );
            return Err((ErrorKind::TooLarge, why));
        }
        sending.check_in();
        Ok(Message::StagedMapped {
            lease_id,
            incarnation,
            chunks,
            shape,
            runs,
        })
    }
}
