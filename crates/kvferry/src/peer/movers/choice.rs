//! The one place a transfer's mover is chosen, for gets and delayed pulls alike
//! ([`TransferCtx::choose_mover`]), and the per-pair half of it: asking a producer
//! incarnation what it offers and probing it, once, cached per peer address
//! ([`Consumer::movers`] reports the choices).
//!
//! Once per producer incarnation the consumer asks (`MoverHello`, on the connection
//! its transfer checked out, so under the transfer's deadline and with no second
//! handshake) and, when offered, reads the producer's probe pattern through the
//! kernel; [`choose_for_pair`] judges the answers. The result — CMA with the
//! producer's pid, or the socket and why — is kept per peer address and replaced when
//! the incarnation changes. A transfer whose connection reached another incarnation
//! than the one chosen for asks again.
//!
//! # Cancellation
//!
//! The questions are requests on the transfer's connection; a dropped transfer drops
//! the connection, and nothing is recorded for an unfinished choice.

use std::sync::atomic::Ordering;

use super::{boot_id, choose, choose_for_pair, device_ipc_kinds, Ask, Dest, Offer, PeerMover, Route, Transport};
use crate::device::KvCacheRef;
use crate::net::{NetError, PooledConnection};
use crate::peer::consumer::client::Consumer;
use crate::peer::consumer::shared::Request;
use crate::peer::consumer::transfer::TransferCtx;
use crate::peer::error::PeerError;
use crate::wire::Message;

impl TransferCtx<'_> {
    /// The mover this transfer starts with, on `conn` (the connection it checked out):
    /// the pair's choice (asked and probed once per producer incarnation, on `conn`),
    /// then [`choose`] over it, the request and the destination. An error is the
    /// connection's (the transfer fails as it would have on its request).
    pub(in crate::peer) async fn choose_mover(
        &self,
        conn: &mut PooledConnection,
        req: &Request,
    ) -> Result<Route, PeerError> {
        let transport = self.consumer.inner.cfg.transport;
        let ask = match req {
            Request::Get { select, .. } => Ask::Get {
                selected: select.is_some(),
            },
            Request::Pull { handle } => Ask::Pull {
                selected: handle.selection.is_some(),
            },
        };
        let dest = match &self.dst.target {
            KvCacheRef::Host(_) => Dest::Host,
            KvCacheRef::Device(cache) => Dest::Device {
                ipc_kind: cache.device().ipc_kind(),
            },
        };
        // Nothing to ask when even the best pair would get the socket.
        if !pair_matters(transport, ask, dest) {
            return Ok(Route::Socket);
        }
        let peer = self.pool.addr().to_string();
        let pair = self.consumer.pair_mover(&peer, conn).await?;
        Ok(choose(transport, Some(&pair), ask, dest))
    }
}

impl Consumer {
    /// The mover chosen for each peer so far, and why (sorted by peer address).
    pub fn movers(&self) -> Vec<PeerMover> {
        let mut v: Vec<PeerMover> = self.inner.movers.lock().values().cloned().collect();
        v.sort_by(|a, b| a.peer.cmp(&b.peer));
        v
    }

    /// The mover chosen for `peer`'s current incarnation, the one `conn` (a connection
    /// checked out for a transfer) reached: asked and probed once per producer
    /// incarnation, on that connection (one handshake per transfer, as before). An
    /// error is the connection's; nothing is recorded then.
    pub(in crate::peer) async fn pair_mover(
        &self,
        peer: &str,
        conn: &mut PooledConnection,
    ) -> Result<PeerMover, PeerError> {
        let incarnation = conn.peer().incarnation;
        if let Some(m) = self.inner.movers.lock().get(peer) {
            if m.incarnation == incarnation {
                return Ok(m.clone());
            }
        }
        let offer = self.ask_offer(conn).await?;
        let mut choice = choose_for_pair(peer, incarnation, offer);
        if choice.pid.is_some() {
            (choice.device_ipc, choice.device_fallback) = self.ask_device_ipc(conn).await?;
        }
        match &choice.fallback {
            Some(why) => {
                self.inner.counters.mover_fallbacks.fetch_add(1, Ordering::Relaxed);
                tracing::info!(target: "kvferry::peer", peer, reason = %why, "mover: socket (same-host read not available)");
            }
            None => tracing::debug!(target: "kvferry::peer", peer, pid = choice.pid, "mover: cma"),
        }
        if let Some(why) = &choice.device_fallback {
            self.inner.counters.device_ipc_fallbacks.fetch_add(1, Ordering::Relaxed);
            tracing::info!(target: "kvferry::peer", peer, reason = %why, "device IPC not available: device memory over CMA");
        }
        self.inner.movers.lock().insert(peer.to_string(), choice.clone());
        Ok(choice)
    }

    /// Asks the producer on `conn` (CMA already chosen) which device-IPC kinds it
    /// grants by: `(kinds, why none)`. A refusal (an older producer) is "none".
    async fn ask_device_ipc(&self, conn: &mut PooledConnection) -> Result<(Vec<String>, Option<String>), PeerError> {
        let hello = Message::DeviceIpcHello {
            kinds: device_ipc_kinds(),
        };
        match conn.request(&hello).await {
            Ok(Message::DeviceIpcOffer { kinds, refused, .. }) if kinds.is_empty() => Ok((kinds, Some(refused))),
            Ok(Message::DeviceIpcOffer { kinds, .. }) => Ok((kinds, None)),
            Ok(other) => Ok((
                Vec::new(),
                Some(format!(
                    "the producer answered the device-IPC hello with {}",
                    other.name()
                )),
            )),
            Err(NetError::Remote { kind, message }) => Ok((
                Vec::new(),
                Some(format!("the producer does not offer device IPC ({kind:?}: {message})")),
            )),
            Err(e) => Err(e.into()),
        }
    }

    /// Gives up device IPC for `peer`'s current choice (its export could not be
    /// opened here): later transfers read device memory over CMA.
    pub(in crate::peer) fn device_ipc_refused(&self, peer: &str, why: String) {
        self.inner.counters.device_ipc_fallbacks.fetch_add(1, Ordering::Relaxed);
        tracing::info!(target: "kvferry::peer", peer, reason = %why, "device IPC given up: device memory over CMA");
        if let Some(m) = self.inner.movers.lock().get_mut(peer) {
            m.device_ipc.clear();
            m.device_fallback = Some(why);
        }
    }

    /// Asks the producer on `conn` for its offer and probes it.
    async fn ask_offer(&self, conn: &mut PooledConnection) -> Result<Offer, PeerError> {
        let Some(mine) = boot_id() else {
            return Ok(Offer::NoBootId);
        };
        let reply = match conn.request(&Message::MoverHello { boot_id: mine }).await {
            Ok(reply) => reply,
            // A refusal leaves the connection usable (an older producer, say).
            Err(NetError::Remote { kind, message }) => {
                return Ok(Offer::Refused(format!(
                    "the producer refused the mover probe ({kind:?}: {message})"
                )))
            }
            Err(e) => return Err(e.into()),
        };
        Ok(match reply {
            Message::MoverOffer { cma: Some(offer), .. } => {
                let mut got = [0u8; 32];
                let probe = crate::copy::read_remote(offer.pid, offer.probe_addr, &mut got)
                    .map(|()| got == offer.probe)
                    .map_err(|e| e.to_string());
                Offer::Cma { pid: offer.pid, probe }
            }
            Message::MoverOffer { refused, .. } => Offer::Refused(refused),
            other => Offer::Refused(format!(
                "the producer does not offer movers (it answered {})",
                other.name()
            )),
        })
    }
}

/// Whether the pair's choice can change what `ask` into `dest` goes by: false when
/// even a pair that qualifies for every mover would get the socket (then nothing is
/// asked).
fn pair_matters(transport: Transport, ask: Ask, dest: Dest) -> bool {
    let best = PeerMover {
        peer: String::new(),
        incarnation: 0,
        mover: super::Mover::Cma,
        fallback: None,
        pid: Some(1),
        device_ipc: device_ipc_kinds(),
        device_fallback: None,
    };
    choose(transport, Some(&best), ask, dest) != Route::Socket
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pair is asked only when its answer can change the mover: never under `tcp`,
    /// never for a staged selection's pull.
    #[test]
    fn the_pair_is_asked_only_when_its_answer_matters() {
        for dest in [Dest::Host, Dest::Device { ipc_kind: None }] {
            for selected in [false, true] {
                assert!(!pair_matters(Transport::Tcp, Ask::Get { selected }, dest));
                assert!(!pair_matters(Transport::Tcp, Ask::Pull { selected }, dest));
                assert!(pair_matters(Transport::Auto, Ask::Get { selected }, dest));
            }
            assert!(pair_matters(Transport::Auto, Ask::Pull { selected: false }, dest));
            assert!(!pair_matters(Transport::Auto, Ask::Pull { selected: true }, dest));
        }
    }
}
