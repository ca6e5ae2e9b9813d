//! Small in-process engines over loopback: one configuration ([`small_config`], and
//! [`config`] with a short I/O timeout) and a prefill/decode [`Pair`].
#![allow(dead_code)]

use std::time::Duration;

use kvferry::copy::CopyConfig;
use kvferry::engine::{Engine, EngineConfig, StoreConfig};

/// A small engine: 2 MiB staging arena of 64 KiB pages (not pinned), one copy thread
/// of 256 KiB slices, a 1 MiB store of 16 KiB blocks, loopback on an ephemeral port.
/// Its bytes go on the socket (`transport = tcp`): the suites built on it test the
/// socket mover (bytes on the wire, connection faults); `p2p_cma` tests the same-host
/// one, which an engine picks by default.
pub fn small_config(peer_id: &str) -> EngineConfig {
    let mut cfg = EngineConfig::default().peer_id(peer_id).arena(2 << 20, 64 << 10);
    cfg.producer.transport = kvferry::peer::Transport::Tcp;
    cfg.pinned = false;
    cfg.copy = CopyConfig {
        threads: 1,
        slice_bytes: 256 << 10,
    };
    cfg.store = StoreConfig::Bytes {
        bytes: 1 << 20,
        block_bytes: 16 << 10,
    };
    cfg
}

/// [`small_config`] with a 2 s I/O timeout.
pub fn config(peer_id: &str) -> EngineConfig {
    let mut cfg = small_config(peer_id);
    cfg.net.io_timeout = Duration::from_secs(2);
    cfg
}

/// A producer (`prefill`) and a consumer (`decode`) engine.
pub struct Pair {
    pub prefill: Engine,
    pub decode: Engine,
    /// The prefill engine's address.
    pub addr: String,
}

/// A [`Pair`] of [`config`] engines.
pub async fn pair() -> Pair {
    pair_with(config).await
}

/// A [`Pair`] whose engines `config` makes (given `prefill` and `decode`).
pub async fn pair_with(config: impl Fn(&str) -> EngineConfig) -> Pair {
    let prefill = Engine::start(config("prefill")).await.unwrap();
    let decode = Engine::start(config("decode")).await.unwrap();
    let addr = prefill.address().unwrap().to_string();
    Pair { prefill, decode, addr }
}

/// Deterministic bytes (xorshift), different for every seed: what the engine suites
/// fill a block or a chunk with, to compare what landed.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}
