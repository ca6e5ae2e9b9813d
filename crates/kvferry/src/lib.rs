//! kvferry: moves the KV cache of LLM inference between engine memory (GPU or host),
//! a pinned host staging arena, and peer instances — without corrupting, leaking or
//! hanging when a transfer is cancelled, times out, or a device or peer stalls.
//!
//! Start with [`engine::Engine`], the front door; it assembles everything below.
//!
//! Layers, bottom up (see `docs/architecture.md`):
//!
//! - [`checksum`]: crc32c, computed and combined; a leaf every layer may use.
//! - [`error_code`]: the stable [`ErrorCode`] every error type reports through `code()`.
//! - [`mem`]: the staging arena, its pages and leases, and registered regions.
//! - [`copy`]: dedicated copy threads executing [`copy::CopyPlan`]s; a cancelled or
//!   failed copy releases nothing until every started slice has stopped.
//!
//! The central design move: the memory a job touches is *owned by the job* until the
//! job has drained. Dropping a future (Rust's cancellation) therefore cannot free
//! memory under a live writer, and no `Drop` ever blocks.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]
#![warn(missing_docs)]

pub mod checksum;
pub mod cluster;
pub mod copy;
pub mod device;
pub mod directory;
pub mod engine;
pub mod error_code;
pub mod layout;
pub mod mem;
pub mod metrics;
pub mod net;
pub mod peer;
pub mod stats;
pub mod sync;
pub mod wire;

pub use error_code::ErrorCode;
