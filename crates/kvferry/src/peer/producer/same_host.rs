//! This process's same-host identity, which a producer offers a consumer asking for
//! the same-host mover (see `mapped`): the host's boot id, and a random probe pattern
//! the consumer reads through the kernel to prove it may read this process's memory.
//! Made once per producer; names nothing of the producer.

use rand::RngCore;

use crate::peer::movers::boot_id;

/// This process's same-host identity: its boot id and a probe pattern that lives as
/// long as the producer.
pub(super) struct SameHost {
    pub(super) boot_id: Option<String>,
    pub(super) probe: Box<[u8; 32]>,
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
