//! Wire format: frames, control messages, limits.
//!
//! A connection carries a sequence of frames, each a fixed 32-byte [`FrameHeader`]
//! followed by its payload: a postcard-encoded control message ([`FrameKind::Control`])
//! or raw chunk bytes ([`FrameKind::Bulk`]). Both are crc32c-checksummed (with
//! [`crate::checksum`]).
//!
//! Invariant of this layer: malformed input is a typed [`WireError`], never a panic or
//! an unbounded allocation. Every peer-announced length is checked against [`Limits`]
//! before anything is allocated for it.
//!
//! - [`frame`] — header layout, encode/decode.
//! - [`limits`] — the size bounds.
//! - [`codec`] — async header/control reading and writing, skipping payloads.
//! - [`bulk`] — gather-write and scatter-read of bulk payloads.
//! - [`key`] — [`ChunkKey`], the content key of a chunk.
//! - [`message`] — the P2P control protocol, [`Message`].
//! - [`selection`] — partial gets: [`WireSelection`], [`SelectedShape`], [`SelectionError`].
//! - [`auth`] — HMAC challenge-response helpers for the handshake.
//! - [`error`] — [`WireError`].

pub mod auth;
pub mod bulk;
pub mod codec;
pub mod error;
pub mod frame;
pub mod key;
pub mod limits;
pub mod message;
pub mod selection;

pub use bulk::{read_bulk_body, read_bulk_body_tcp, write_bulk, write_bulk_with_checksum};
pub use codec::{read_control, read_control_body, read_frame_header, skip_body, write_control};
pub use error::WireError;
pub use frame::{FrameHeader, FrameKind, HEADER_LEN, MAGIC, VERSION};
pub use key::ChunkKey;
pub use limits::Limits;
pub use message::{
    read_message, ChunkMeta, CmaOffer, ErrorKind, LeaseId, Message, MAX_BOOT_ID_BYTES, MAX_DEVICE_IPC_HANDLE_BYTES,
    MAX_DEVICE_IPC_KINDS, MAX_DEVICE_IPC_KIND_BYTES, MAX_EXPORTED_BUFFERS, MAX_MAPPED_RUNS,
};
pub use selection::{SelectedShape, SelectionError, WireSelection};
