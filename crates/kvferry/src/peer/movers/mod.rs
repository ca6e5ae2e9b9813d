//! Bulk movers: what carries a grant's bytes from the producer's memory to the
//! consumer's destination. Every mover lives in this room, one file each, behind one
//! interface ([`BulkMover`]); the choice between them is made in one place
//! ([`choose_for_pair`] once per producer incarnation, [`choose`] once per transfer).
//!
//! Control — the handshake, `Get`, the lease grant, `Done`, `Release`, the producer's
//! ledger — always runs on the authenticated connection. The bytes move by one of:
//!
//! - **socket** (`socket.rs`): the producer writes them onto the connection, with a
//!   crc32c per frame (the default anywhere, and the fallback);
//! - **cma** (`cma.rs`; same host, host memory): the producer's grant names where the
//!   bytes are in its memory (`Message::StagedMapped`), and the consumer reads them
//!   itself with `process_vm_readv` on its copy threads;
//! - **device IPC** (`device_ipc.rs`; same host, device memory, on top of CMA's
//!   choice): the producer's grant names its exported device allocations and `(buffer,
//!   offset, length)` runs of them; the consumer opens the export once per producer
//!   incarnation on its own device and copies device to device on its own streams
//!   (sim: shared memory, see `device::shm`; CUDA IPC is the same seam).
//!
//! # One interface
//!
//! A mover is one type implementing [`BulkMover`]: for one transfer it sends the
//! request that asks the producer for a grant it can read (`Get`/`Pull`,
//! `GetMapped`/`PullMapped`, `GetDeviceMapped`), checks the grant against the request,
//! starts its reads into the transfer's destination ([`Sink`]), and polls them to their
//! end. What every mover shares is not its own: the transfer task's fence and drain
//! (`consumer::transfer`), the verification of every landed chunk against the grant's
//! checksums and the `Done` that follows (`one_sided.rs`, `consumer::shared`), the
//! counters, and the producer's ledger (a grant stays pinned until `Done`, TTL or
//! release, whichever mover reads it).
//!
//! Adding a mover (an RDMA one, say) is: a file here with a type implementing
//! [`BulkMover`] (its request, its grant — e.g. addresses and registration keys — and
//! its reads), a [`Mover`] and a [`Route`] variant, the offer it needs at the
//! handshake (a field of `MoverOffer`, judged by [`choose_for_pair`]), and a rule in
//! [`choose`]. The consumer's get and pull paths do not change: they call
//! `TransferCtx::choose_mover` and dispatch the route (`TransferCtx::carry`).
//!
//! # Choosing
//!
//! **Per peer pair**, once per producer incarnation (`MoverHello` → `MoverOffer`): the
//! producer offers CMA when its [`Transport`] allows it and the consumer's boot id is
//! its own (the same running kernel, so the same host). The consumer then reads the
//! producer's 32-byte probe pattern through the kernel and compares it: that proves
//! the pid names the producer from here (no other pid namespace) and that this process
//! may read it (ptrace rules, uid, containers). Once CMA is chosen the consumer also
//! asks which device-IPC kinds the producer grants by (`DeviceIpcHello`). Any refusal
//! — the other side's transport, another host, `EPERM`, a wrong probe, a peer that
//! does not answer the probe — chooses the socket, never fails a transfer, and is
//! recorded with its reason ([`PeerMover`]), in the logs and in the consumer's stats.
//!
//! **Per transfer** ([`choose`]), from the pair's choice, the consumer's
//! [`Transport`], the request ([`Ask`]: a get, a delayed pull, selected or not) and
//! the destination ([`Dest`]: host memory, or device memory of some IPC kind): a
//! device destination of a kind the producer offered goes by device IPC, a selected
//! pull by the socket, anything else the pair qualifies for by CMA. A mover may still
//! hand a transfer back ([`Carried::Refused`]: the producer cannot name the bytes in
//! one reply, or its export cannot be opened here); nothing was read then, and the same
//! transfer continues on the socket, on the same connection.
//!
//! # Cancellation
//!
//! A transfer is cancelled by dropping the future of [`BulkMover::carry`] (the
//! transfer's token, or its deadline through `run_fenced`) — start is the call, poll
//! is the future's, cancel is the drop. The drain promise: the transfer's fence fires
//! only after every posted read stopped touching the destination. Each mover keeps
//! it as follows, and a new one must too (its **quiesce**):
//!
//! - socket: the reads are the connection's receives; dropping the future drops the
//!   connection, and nothing writes the destination after that.
//! - cma: the reads run on the copy engine's threads, which a drop cannot stop; before
//!   the first read starts the mover stores the copy job's fence in the transfer
//!   (`TransferCtx::copy_fence`), and the transfer waits for it before its own fence
//!   fires (each started read is one bounded system call).
//! - device IPC: the device may still be copying; before waiting, the mover records
//!   the copy's event as the transfer's unconfirmed device copy
//!   (`TransferCtx::unconfirmed`), and the transfer's fence fires only once the device
//!   settled it (bounded; a device that never confirms keeps the destination reported
//!   busy).
//!
//! # Security
//!
//! A CMA read needs ptrace rights over the producer, which the kernel checks: a
//! process with those rights can read the producer's memory anyway. The grant only
//! names which ranges to read; it is given on an authenticated connection, under the
//! same rules as the socket's bytes (TLS peers included: see docs/security.md).

mod choice;
mod cma;
mod device_ipc;
mod one_sided;
mod socket;

pub(in crate::peer) use cma::Cma;
pub(in crate::peer) use device_ipc::DeviceIpc;
pub(in crate::peer) use socket::Socket;

use crate::net::PooledConnection;
use crate::peer::consumer::shared::Request;
use crate::peer::consumer::transfer::{Sink, TransferCtx};
use crate::peer::error::PeerError;
use crate::wire::ChunkMeta;
use serde::{Deserialize, Serialize};

/// Which movers a side may use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// The fastest mover both sides qualify for: CMA on one host, else the socket.
    #[default]
    Auto,
    /// The socket only (neither offered nor used).
    Tcp,
}

impl Transport {
    /// The option's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Auto => "auto",
            Transport::Tcp => "tcp",
        }
    }
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Transport {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Transport::Auto),
            "tcp" => Ok(Transport::Tcp),
            other => Err(format!("unknown transport {other:?} (expected \"auto\" or \"tcp\")")),
        }
    }
}

/// The mover chosen for a peer pair, by the name stats, logs and benchmarks print.
/// (Device IPC rides on a CMA choice: [`PeerMover::device_ipc`].)
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mover {
    /// Bytes on the connection ([`Transport::Tcp`] asks for this one only).
    Socket,
    /// Cross-memory attach from the producer's process.
    Cma,
}

impl Mover {
    /// The mover's name, as stats and benchmarks print it.
    pub fn as_str(self) -> &'static str {
        match self {
            Mover::Socket => "socket",
            Mover::Cma => "cma",
        }
    }
}

/// The mover chosen for one producer incarnation, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PeerMover {
    /// The producer's address.
    pub peer: String,
    /// The producer incarnation the choice holds for.
    pub incarnation: u64,
    /// The mover.
    pub mover: Mover,
    /// Why the socket was chosen when not asked for (`None` when the choice is CMA, or
    /// the socket was asked for).
    pub fallback: Option<String>,
    /// The producer's pid (CMA only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    /// Device-IPC kinds the producer grants device memory by (asked once CMA is
    /// chosen; empty: none). A device destination of one of these kinds is landed by
    /// a device-to-device copy from the producer's exported memory.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub device_ipc: Vec<String>,
    /// Why device memory from this producer is not copied device to device although
    /// CMA was chosen (the producer's answer, or a failed open of its export).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_fallback: Option<String>,
}

/// This host's boot id: equal on two processes only under the same running kernel.
/// `None` when it cannot be read (then no same-host mover is offered or asked for).
pub fn boot_id() -> Option<String> {
    let id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let id = id.trim();
    (!id.is_empty() && id.len() <= crate::wire::MAX_BOOT_ID_BYTES).then(|| id.to_string())
}

/// The device-IPC kinds this build can export and open: the sim's shared memory, and
/// (feature `cuda`) CUDA IPC only where `KVFERRY_CUDA_IPC=1` — it has never run on a
/// GPU yet (`scripts/gpu-check.sh` has its case).
pub fn device_ipc_kinds() -> Vec<String> {
    #[allow(unused_mut)]
    let mut kinds = vec![crate::device::SIM_IPC.to_string()];
    #[cfg(feature = "cuda")]
    if std::env::var("KVFERRY_CUDA_IPC").is_ok_and(|v| v == "1") {
        kinds.push(crate::device::CUDA_IPC.to_string());
    }
    kinds
}

/// What a transfer asks for, as far as choosing its mover goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::peer) enum Ask {
    /// An eager get (`selected`: with a selection — head slices, a block subset).
    Get { selected: bool },
    /// A delayed pull of a staged lease (`selected`: a staged selection's stream).
    Pull { selected: bool },
}

/// Where a transfer's bytes land, as far as choosing its mover goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::peer) enum Dest {
    /// Host memory (a host cache, directly or through staging pages).
    Host,
    /// A device cache; `ipc_kind`: the device-IPC kind its device opens, if any.
    Device { ipc_kind: Option<&'static str> },
}

/// The mover one transfer starts with ([`choose`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(in crate::peer) enum Route {
    /// The bytes on the connection.
    Socket,
    /// Read from process `pid` with `process_vm_readv`.
    Cma { pid: u32 },
    /// Copied device to device from process `pid`'s export of kind `kind` (a grant
    /// the producer gives as CMA instead is read by CMA).
    DeviceIpc { pid: u32, kind: &'static str },
}

/// The one choice of a transfer's mover, for gets and delayed pulls alike: from the
/// consumer's `transport`, the peer pair's choice (`pair`: `None` before one was made,
/// or when the transfer's connection reached another producer incarnation), what is
/// asked and where it lands.
pub(in crate::peer) fn choose(transport: Transport, pair: Option<&PeerMover>, ask: Ask, dest: Dest) -> Route {
    if transport == Transport::Tcp {
        return Route::Socket;
    }
    let Some(pid) = pair.filter(|p| p.mover == Mover::Cma).and_then(|p| p.pid) else {
        return Route::Socket;
    };
    match (ask, dest) {
        // A staged selection is one stream the producer gathers: over the socket.
        (Ask::Pull { selected: true }, _) => Route::Socket,
        (Ask::Pull { selected: false }, _) => Route::Cma { pid },
        (Ask::Get { .. }, Dest::Device { ipc_kind: Some(kind) })
            if pair.is_some_and(|p| p.device_ipc.iter().any(|k| k == kind)) =>
        {
            Route::DeviceIpc { pid, kind }
        }
        (Ask::Get { .. }, _) => Route::Cma { pid },
    }
}

/// What the producer said to a consumer's `MoverHello`, and what the probe found.
#[derive(Debug)]
pub(in crate::peer) enum Offer {
    /// This host's boot id cannot be read: nothing was asked.
    NoBootId,
    /// No same-host mover offered (the producer's reason, or why its answer is none).
    Refused(String),
    /// CMA offered by process `pid`; `probe`: the probe read's outcome (`Ok(true)`: the
    /// pattern read through the kernel is the one offered).
    Cma { pid: u32, probe: Result<bool, String> },
}

/// The one choice of a peer pair's mover, from the producer's offer and the probe
/// (device IPC is asked for afterwards, only when this is CMA).
pub(in crate::peer) fn choose_for_pair(peer: &str, incarnation: u64, offer: Offer) -> PeerMover {
    let (mover, fallback, pid) = match offer {
        Offer::NoBootId => (
            Mover::Socket,
            Some("this host's boot id cannot be read".to_string()),
            None,
        ),
        Offer::Refused(why) => (Mover::Socket, Some(why), None),
        Offer::Cma { pid, probe: Ok(true) } => (Mover::Cma, None, Some(pid)),
        Offer::Cma { pid, probe: Ok(false) } => (
            Mover::Socket,
            Some(format!(
                "pid {pid} is another process from here (another pid namespace?)"
            )),
            None,
        ),
        Offer::Cma { probe: Err(e), .. } => (
            Mover::Socket,
            Some(format!("the kernel refused the probe read: {e}")),
            None,
        ),
    };
    PeerMover {
        peer: peer.to_string(),
        incarnation,
        mover,
        fallback,
        pid,
        device_ipc: Vec::new(),
        device_fallback: None,
    }
}

/// How a mover's work on one transfer ended.
pub(in crate::peer) enum Carried {
    /// Landed and verified (and the grant released); `reuse`: the connection is at a
    /// frame boundary and may go back to the pool.
    Landed { chunks: Vec<ChunkMeta>, reuse: bool },
    /// The mover handed the transfer back before reading anything (the producer cannot
    /// name these bytes in one reply, or its export cannot be opened here; any grant
    /// already released): the socket carries it, on the same connection.
    Refused,
}

/// One mover, on the consumer: the per-transfer half of the seam (the per-pair half is
/// [`choose_for_pair`] and the offer the producer makes at the handshake).
///
/// # Cancellation
///
/// See the module's: dropping [`carry`](Self::carry)'s future is the cancel, and a
/// mover whose reads can outlive that drop records, before the first read starts,
/// what the transfer's drain waits for (`TransferCtx::copy_fence`,
/// `TransferCtx::unconfirmed`).
pub(in crate::peer) trait BulkMover {
    /// Carries what `req` asks for on `conn` (its next request is `id`): sends the
    /// request for a grant this mover reads, checks the grant against the request,
    /// reads its bytes into `sink` (chunk `i` holds at most `caps[i]` bytes; a selected
    /// stream is one entry), verifies every chunk against the grant's checksums, and
    /// releases the grant with `Done` on the same connection. A lease the transfer must
    /// release if it ends early is left in `TransferCtx::lease_to_release`.
    async fn carry(
        &self,
        t: &mut TransferCtx<'_>,
        conn: &mut PooledConnection,
        id: u64,
        req: &Request,
        sink: &mut Sink,
        caps: &[usize],
    ) -> Result<Carried, PeerError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transport_spellings_round_trip() {
        for t in [Transport::Auto, Transport::Tcp] {
            assert_eq!(t.as_str().parse::<Transport>().unwrap(), t);
        }
        assert!("rdma".parse::<Transport>().unwrap_err().contains("auto"));
        assert_eq!(boot_id(), boot_id(), "stable within one boot");
    }

    fn pair(mover: Mover, pid: Option<u32>, device_ipc: &[&str]) -> PeerMover {
        PeerMover {
            peer: "p:1".into(),
            incarnation: 7,
            mover,
            fallback: None,
            pid,
            device_ipc: device_ipc.iter().map(|k| k.to_string()).collect(),
            device_fallback: None,
        }
    }

    const GETS: [Ask; 2] = [Ask::Get { selected: false }, Ask::Get { selected: true }];
    const PULLS: [Ask; 2] = [Ask::Pull { selected: false }, Ask::Pull { selected: true }];
    const DESTS: [Dest; 3] = [
        Dest::Host,
        Dest::Device { ipc_kind: None },
        Dest::Device {
            ipc_kind: Some("sim-shm"),
        },
    ];

    /// Every (transport, pair, ask, destination) over one table: the one choice, for
    /// gets and pulls alike.
    #[test]
    fn one_choice_for_gets_and_pulls() {
        let cma = pair(Mover::Cma, Some(42), &[]);
        let cma_dev = pair(Mover::Cma, Some(42), &["sim-shm"]);
        let socket = pair(Mover::Socket, None, &[]);
        for ask in GETS.into_iter().chain(PULLS) {
            for dest in DESTS {
                // `tcp`, no choice yet, or a socket pair: the socket, whatever else.
                for p in [None, Some(&cma), Some(&cma_dev), Some(&socket)] {
                    assert_eq!(choose(Transport::Tcp, p, ask, dest), Route::Socket, "{ask:?} {dest:?}");
                }
                assert_eq!(choose(Transport::Auto, None, ask, dest), Route::Socket);
                assert_eq!(choose(Transport::Auto, Some(&socket), ask, dest), Route::Socket);
            }
        }
        for dest in DESTS {
            // A pull of whole chunks by CMA (the staged lease is host memory), a
            // staged selection over the socket — whatever the pair offers.
            for p in [&cma, &cma_dev] {
                let pull = |selected| choose(Transport::Auto, Some(p), Ask::Pull { selected }, dest);
                assert_eq!(pull(false), Route::Cma { pid: 42 }, "{dest:?}");
                assert_eq!(pull(true), Route::Socket, "{dest:?}");
            }
            for ask in GETS {
                assert_eq!(choose(Transport::Auto, Some(&cma), ask, dest), Route::Cma { pid: 42 });
                // Device IPC only for a device destination of a kind the pair agreed on.
                let want = match dest {
                    Dest::Device { ipc_kind: Some(kind) } => Route::DeviceIpc { pid: 42, kind },
                    _ => Route::Cma { pid: 42 },
                };
                assert_eq!(
                    choose(Transport::Auto, Some(&cma_dev), ask, dest),
                    want,
                    "{ask:?} {dest:?}"
                );
            }
        }
        // A device of another kind than the one offered: CMA.
        let other = Dest::Device {
            ipc_kind: Some("cuda-ipc"),
        };
        assert_eq!(
            choose(Transport::Auto, Some(&cma_dev), Ask::Get { selected: false }, other),
            Route::Cma { pid: 42 }
        );
    }

    /// Every refusal picks the socket and says why; only a probe that read the offered
    /// pattern picks CMA.
    #[test]
    fn a_refused_offer_or_probe_picks_the_socket_with_its_reason() {
        let chosen = |offer| choose_for_pair("p:1", 7, offer);
        let cma = chosen(Offer::Cma {
            pid: 42,
            probe: Ok(true),
        });
        assert_eq!((cma.mover, cma.pid, cma.fallback.clone()), (Mover::Cma, Some(42), None));
        assert_eq!((cma.peer.as_str(), cma.incarnation), ("p:1", 7));
        let refusals = [
            (Offer::NoBootId, "boot id"),
            (Offer::Refused("transport is tcp".into()), "transport is tcp"),
            (
                Offer::Cma {
                    pid: 42,
                    probe: Ok(false),
                },
                "another process",
            ),
            (
                Offer::Cma {
                    pid: 42,
                    probe: Err("Operation not permitted (os error 1)".into()),
                },
                "kernel refused the probe read: Operation not permitted",
            ),
        ];
        for (offer, why) in refusals {
            let m = chosen(offer);
            assert_eq!((m.mover, m.pid), (Mover::Socket, None), "{why}");
            let fallback = m.fallback.as_deref().expect("a refusal has a reason");
            assert!(fallback.contains(why), "{fallback:?} does not say {why:?}");
            // And such a pair carries every transfer over the socket.
            for ask in GETS.into_iter().chain(PULLS) {
                for dest in DESTS {
                    assert_eq!(choose(Transport::Auto, Some(&m), ask, dest), Route::Socket);
                }
            }
        }
    }
}
