//! Peers: the [`Producer`] (a chunk store, staging with TTL leases, serving lookups and
//! pulls) and the [`Consumer`] (lookup, eager get, delayed pull, push, and a blocking
//! get with a timeout for synchronous callers).
//!
//! # The three promises, here
//!
//! - **Never corrupt**: a producer copies chunks into staging pages *before*
//!   advertising them; every chunk carries a crc32c computed at staging time and
//!   verified on receipt (a mismatch fails the transfer and is never landed); the
//!   consumer lands only after all bytes arrived, and destination blocks are reported
//!   quiet only by a [`DrainFence`](crate::copy::DrainFence) that fires after the
//!   landing copy drained.
//! - **Never leak**: staging pages are owned by whichever task is using them (the
//!   gather, the socket write, the receive, the landing copy) and return when it ends —
//!   on success, error, cancel, timeout or peer death. Producer leases also expire by
//!   TTL if a consumer vanishes.
//! - **Never hang**: every consumer call has a deadline; the blocking get returns within
//!   its timeout plus a small bound, leaving cancellation and drain to a background task.

mod consumer;
mod error;
mod ledger;
pub mod movers;
mod producer;
pub mod publish;
mod quota;
pub mod selection;
mod unit_crcs;

pub use consumer::{
    Consumer, ConsumerConfig, ConsumerStats, Destination, GetFailure, Landed, PeerGone, StagedHandle, StagedSelection,
    Transfer, TransferPath,
};
pub use error::PeerError;
pub use ledger::LeaseRefusal;
pub use movers::{Mover, PeerMover, Transport};
pub(crate) use producer::DeregisterError;
pub use producer::{
    ChunkLocation, ChunkPins, ChunkStore, Hold, PinnedRegion, Producer, ProducerConfig, ProducerFaults, ProducerStats,
    StoreStats,
};
pub use publish::{ReleaseReason, Released};
pub use selection::Selection;
