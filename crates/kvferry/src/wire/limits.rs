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
}

impl Limits {
    /// Default for [`Limits::max_control_bytes`]: 1 MiB.
    pub const DEFAULT_MAX_CONTROL_BYTES: u64 = 1 << 20;
    /// Default for [`Limits::max_bulk_bytes`]: 256 MiB.
    pub const DEFAULT_MAX_BULK_BYTES: u64 = 256 << 20;
    /// Default for [`Limits::max_keys`]: 4096.
    pub const DEFAULT_MAX_KEYS: usize = 4096;
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_control_bytes: Self::DEFAULT_MAX_CONTROL_BYTES,
            max_bulk_bytes: Self::DEFAULT_MAX_BULK_BYTES,
            max_keys: Self::DEFAULT_MAX_KEYS,
        }
    }
}
