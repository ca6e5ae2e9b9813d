//! The slice ledger of one copy job: which slices may still start, and when the last
//! started slice has stopped (the job has *drained*).
//!
//! Each slice is accounted exactly once, either by running ([`SliceLedger::begin`]
//! returned true, then [`SliceLedger::finish`]) or by being skipped (`begin` returned
//! false, then `finish`). `finish` returns true for exactly one caller: the one that
//! accounted the last slice. After that no copy thread touches the job's memory, so the
//! memory may be released. This protocol is model-checked with loom
//! (`tests/loom_drain.rs`, `RUSTFLAGS="--cfg kvferry_loom"`).

use crate::sync::{AtomicBool, AtomicUsize, Ordering};

/// Accounting of one job's slices.
#[derive(Debug)]
pub struct SliceLedger {
    remaining: AtomicUsize,
    stop: AtomicBool,
}

impl SliceLedger {
    /// A ledger for `slices` slices (at least one).
    pub fn new(slices: usize) -> Self {
        SliceLedger {
            remaining: AtomicUsize::new(slices),
            stop: AtomicBool::new(false),
        }
    }

    /// Asks that no further slice start (cancel, or a sibling failed).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
    }

    /// Whether [`stop`](Self::stop) was called.
    pub fn is_stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// Called by a copy thread before touching a slice's memory: true to run it, false
    /// to skip it. Either way the caller must call [`finish`](Self::finish) once.
    pub fn begin(&self) -> bool {
        !self.stop.load(Ordering::Acquire)
    }

    /// Accounts one slice as stopped. True for the call that accounted the last one:
    /// from then on no thread touches the job's memory.
    pub fn finish(&self) -> bool {
        self.remaining.fetch_sub(1, Ordering::AcqRel) == 1
    }

    /// Whether every slice has been accounted.
    #[cfg_attr(not(kvferry_loom), allow(dead_code))]
    pub fn is_drained(&self) -> bool {
        self.remaining.load(Ordering::Acquire) == 0
    }
}
