//! Synchronisation primitives, switched to [loom](https://docs.rs/loom)'s model-checked
//! versions under `cfg(kvferry_loom)`.
//!
//! Only the small concurrency protocols that loom models (the slice ledger of a copy
//! job and the page ownership it guards) go through this module; everything else uses
//! `std` and `parking_lot` directly.

#[cfg(kvferry_loom)]
pub use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
#[cfg(kvferry_loom)]
pub use loom::sync::Arc;

#[cfg(not(kvferry_loom))]
pub use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
#[cfg(not(kvferry_loom))]
pub use std::sync::Arc;
