//! Size limits enforced on everything read from the wire.
//!
//! Every length announced by a peer is checked against [`Limits`] *before* anything is
//! allocated for it, so a hostile or corrupt peer cannot make a reader allocate more than
//! the configured bounds.

use serde::{Deserialize, Serialize};

/// Upper bounds on peer-announced sizes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Largest accepted control-frame payload in bytes (default 1 MiB).
    pub max_control_bytes: u64,
    /// Largest accepted bulk-frame payload (one chunk) in bytes (default 256 MiB).
    pub max_bulk_bytes: u64,
    /// Largest accepted number of keys in one control message (default 4096).
    pub max_keys: usize,
    /// Largest accepted control-frame payload before the handshake has completed
    /// (default 1 KiB). A handshake message needs a few hundred bytes; a stranger
    /// announcing more is refused from the header alone, before anything is allocated.
    #[serde(default = "Limits::default_max_handshake_bytes")]
    pub max_handshake_bytes: u64,
}

impl Limits {
    /// Default for [`Limits::max_control_bytes`]: 1 MiB.
    pub const DEFAULT_MAX_CONTROL_BYTES: u64 = 1 << 20;
    /// Default for [`Limits::max_bulk_bytes`]: 256 MiB.
    pub const DEFAULT_MAX_BULK_BYTES: u64 = 256 << 20;
    /// Default for [`Limits::max_keys`]: 4096.
    pub const DEFAULT_MAX_KEYS: usize = 4096;
    /// Default for [`Limits::max_handshake_bytes`]: 1 KiB.
    pub const DEFAULT_MAX_HANDSHAKE_BYTES: u64 = 1 << 10;
    /// Smallest accepted [`Limits::max_handshake_bytes`]: the largest handshake message
    /// (a `Hello` or `Challenge` with a 256-byte peer id) needs about 310 bytes.
    pub const MIN_HANDSHAKE_BYTES: u64 = 512;

    fn default_max_handshake_bytes() -> u64 {
        Self::DEFAULT_MAX_HANDSHAKE_BYTES
    }

    /// The limits in force before the handshake has completed: control frames of at
    /// most [`Limits::max_handshake_bytes`] (and never more than
    /// [`Limits::max_control_bytes`]); the other bounds unchanged (a bulk frame is
    /// refused from its header as unexpected, its payload never read).
    pub fn handshake(&self) -> Limits {
        Limits {
            max_control_bytes: self.max_handshake_bytes.min(self.max_control_bytes),
            ..self.clone()
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_control_bytes: Self::DEFAULT_MAX_CONTROL_BYTES,
            max_bulk_bytes: Self::DEFAULT_MAX_BULK_BYTES,
            max_keys: Self::DEFAULT_MAX_KEYS,
            max_handshake_bytes: Self::DEFAULT_MAX_HANDSHAKE_BYTES,
        }
    }
}
