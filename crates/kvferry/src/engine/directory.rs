//! Where a peer's name becomes an address: re-exports of [`crate::directory`]'s trait
//! and static backend, kept here so `kvferry::engine::{Directory, StaticDirectory}`
//! still name them.

pub use crate::directory::{Directory, StaticDirectory};
