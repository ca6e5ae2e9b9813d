//! The consumer: lookup, eager get, delayed pull (stage now, resolve later), push, and
//! a blocking get with a timeout for synchronous callers.
//!
//! Every transfer runs as its own background task that owns everything it touches:
//! the receiver staging lease, the connection, the landing copy job. The caller awaits
//! the task's result under its deadline. When the caller stops waiting (deadline,
//! drop), the task is cancelled and **drains**: a receive in progress is dropped (the
//! connection closes, nothing writes the pages any more), a landing copy is cancelled
//! and awaited until its started slices have stopped, the staging pages return, and
//! `Done` is sent so the producer releases promptly. A [`DrainFence`] returned with
//! every failure fires when that is finished: only then are the destination blocks
//! quiet and may be reused.
//!
//! # Cancellation
//!
//! Dropping any future of this module cancels its transfer as above; nothing is freed
//! under a live writer, nothing leaks, and the fence still fires.

//!
//! # Paths
//!
//! A [`Destination`] names its [`TransferPath`]: **direct** (the default for a
//! [`KvCache`](crate::layout::KvCache)) reads the socket straight into the destination
//! blocks, verifying each chunk's checksum as it arrives, with no staging page and no
//! copy; **staged** receives into staging pages and lands with one copy after every
//! chunk verified. Either way the destination is owned by the transfer task until it
//! has stopped, and a failed direct transfer reports its blocks as dirty. The
//! destination's cache is one [`KvCacheRef`](crate::device::KvCacheRef), host or
//! device memory: a device cache is always staged, then landed by a host-to-device
//! scatter on the cache's copy stream.
//!
//! The module is split: [`types`] (public types), `client` (the [`Consumer`] API) and
//! `transfer` (the transfer task and its per-transfer context), `peer_watch` (failing a
//! peer's transfers at once when the directory says it restarted or left), and `shared`
//! (what those three share: the request a transfer runs, its error, reply checks), so
//! that they do not import each other in a cycle.

pub(in crate::peer) mod client;
mod exchange;
mod get;
mod land_device;
mod peer_watch;
pub(in crate::peer) mod shared;
pub(in crate::peer) mod transfer;
pub mod types;

pub use client::Consumer;
pub use peer_watch::PeerGone;
pub use types::{
    ConsumerConfig, ConsumerStats, Destination, GetFailure, Landed, StagedHandle, StagedSelection, Transfer,
    TransferPath,
};
