//! Host memory: the pinned staging [`Arena`], its [`Lease`]s of pages, and registered
//! [`Region`]s of engine memory.
//!
//! # Ownership
//!
//! Every arena page is in exactly one state at any instant: **free** (on the free
//! list), **leased** (owned by exactly one [`Lease`]), or **quarantined** (possibly
//! still targeted by hardware that could not be drained; never reused until explicitly
//! released). `free + leased + quarantined == total` holds at all times and is what
//! [`ArenaStats`] reports.
//!
//! A [`Lease`] is `Send + 'static` and not `Clone`: it is moved into whatever uses its
//! pages (a copy job, a socket write) and handed back when that user has finished. Its
//! pages go back to the free list when it is dropped — wherever that is. Because the
//! lease (and through it the arena's memory) is owned by the job that touches it, a
//! caller that stops waiting cannot free pages under a live writer.
//!
//! # Cancellation
//!
//! [`Arena::alloc`] is cancel-safe: dropping its future removes the waiter from the
//! FIFO queue; pages handed to a waiter that has just gone away return to the free list
//! at once. [`Arena::close`] may be dropped at any time; the arena stays closed.

mod arena;
mod backing;
mod lease;
mod region;
mod region_set;
mod size;

pub use arena::{Arena, ArenaConfig, ArenaStats, CloseReport};
pub use backing::{Backing, BackingError, BackingKind, BackingRequest, ExternalFree};
pub use lease::{Lease, Quarantined};
pub use region::{HostMemory, Region};
pub use region_set::RegionSet;
pub use size::{ByteSize, ByteSizeError};

use std::time::Duration;

/// Errors from the memory layer.
#[derive(Debug, thiserror::Error)]
pub enum MemError {
    /// The configuration is unusable (zero pages, zero page size, too large).
    #[error("invalid arena configuration: {0}")]
    InvalidConfig(String),
    /// Backing memory could not be mapped.
    #[error(transparent)]
    Backing(#[from] BackingError),
    /// A request for zero pages.
    #[error("a lease needs at least one page")]
    ZeroPages,
    /// More pages were requested than the arena has in total; waiting cannot help.
    #[error("requested {requested} pages but the arena has only {total} in total")]
    TooLarge {
        /// Pages requested.
        requested: usize,
        /// Pages in the arena.
        total: usize,
    },
    /// Not enough free pages right now (`try_alloc`).
    #[error("arena exhausted: requested {requested} pages, {free} free")]
    Exhausted {
        /// Pages requested.
        requested: usize,
        /// Pages free at the time.
        free: usize,
    },
    /// The deadline passed before enough pages were free.
    #[error("timed out after {waited:?} waiting for {requested} arena pages")]
    Timeout {
        /// Pages requested.
        requested: usize,
        /// How long the caller waited.
        waited: Duration,
    },
    /// The arena is closing or closed and accepts no new allocations.
    #[error("arena is closed")]
    Closed,
    /// A byte range lies outside the memory it addresses.
    #[error("range {offset}+{len} is out of bounds for {size} bytes")]
    OutOfBounds {
        /// Start of the range.
        offset: usize,
        /// Length of the range.
        len: usize,
        /// Size of the memory.
        size: usize,
    },
}

impl MemError {
    /// The stable code of this error.
    pub fn code(&self) -> crate::ErrorCode {
        use crate::ErrorCode as C;
        match self {
            MemError::InvalidConfig(_) | MemError::ZeroPages => C::InvalidConfig,
            MemError::Backing(_) => C::Memory,
            MemError::TooLarge { .. } => C::TooLarge,
            MemError::Exhausted { .. } => C::StagingExhausted,
            MemError::Timeout { .. } => C::Timeout,
            MemError::Closed => C::Closed,
            MemError::OutOfBounds { .. } => C::InvalidArgument,
        }
    }
}
