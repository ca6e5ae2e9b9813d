//! Bulk movers: what carries a grant's bytes from the producer's memory to the
//! consumer's destination, chosen per peer pair.
//!
//! Control — the handshake, `Get`, the lease grant, `Done`, `Release`, the producer's
//! ledger — always runs on the authenticated connection. The bytes move by one of:
//!
//! - **socket**: the producer writes them onto the connection, with a crc32c per frame
//!   (the default anywhere, and the fallback);
//! - **cma** (same host, host memory): the producer's grant names where the bytes are
//!   in its memory (`Message::StagedMapped`), and the consumer reads them itself with
//!   `process_vm_readv` on its copy threads, then verifies every chunk against the
//!   grant's checksums before anything counts as landed.
//!
//! - **device IPC** (same host, device memory; on top of CMA's choice): the
//!   producer's grant names its exported device allocations and `(buffer, offset,
//!   length)` runs of them; the consumer opens the export once per producer
//!   incarnation on its own device and copies device to device on its own streams
//!   (sim: shared memory, see `device::shm`; CUDA IPC is the same seam, not built
//!   yet), then verifies every chunk against the grant's checksums.
//!
//! # Choosing
//!
//! A consumer asks each producer incarnation once (`MoverHello` → `MoverOffer`): the
//! producer offers CMA when its [`Transport`] allows it and the consumer's boot id is
//! its own (the same running kernel, so the same host). The consumer then reads the
//! producer's 32-byte probe pattern through the kernel and compares it: that proves
//! the pid names the producer from here (no other pid namespace) and that this process
//! may read it (ptrace rules, uid, containers). Any refusal — the other side's
//! transport, another host, `EPERM`, a wrong probe, a peer that does not answer the
//! probe — chooses the socket, never fails a transfer, and is recorded with its
//! reason ([`PeerMover`]), in the logs and in the consumer's stats.
//!
//! # Security
//!
//! A CMA read needs ptrace rights over the producer, which the kernel checks: a
//! process with those rights can read the producer's memory anyway. The grant only
//! names which ranges to read; it is given on an authenticated connection, under the
//! same rules as the socket's bytes (TLS peers included: see docs/security.md).

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

/// The mover that carries a peer's bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mover {
    /// Bytes on the connection.
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
}
