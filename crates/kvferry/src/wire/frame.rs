//! The fixed 32-byte frame header.
//!
//! Every frame on a kvferry connection is a header followed by `len` payload bytes.
//! Layout (all integers little-endian):
//!
//! | bytes  | field        | meaning                                     |
//! |--------|--------------|---------------------------------------------|
//! | 0..4   | magic        | [`MAGIC`] (`"KVF1"`)                        |
//! | 4      | version      | [`VERSION`]                                 |
//! | 5      | kind         | [`FrameKind`]                               |
//! | 6..8   | reserved     | must be zero                                |
//! | 8..16  | request_id   | correlates requests, replies and bulk data  |
//! | 16..24 | len          | payload length in bytes                     |
//! | 24..28 | checksum     | crc32c of the payload                       |
//! | 28..32 | header_crc   | crc32c of bytes 0..28                       |
//!
//! [`FrameHeader::decode`] checks, in order: magic, version, header crc, kind, reserved,
//! then the length against [`Limits`]. A header that decodes is therefore internally
//! consistent and announces a payload the reader is willing to receive.

use super::{Limits, WireError};

/// The four bytes every frame starts with.
pub const MAGIC: [u8; 4] = *b"KVF1";
/// The wire protocol version this build speaks.
pub const VERSION: u8 = 1;
/// Size of an encoded [`FrameHeader`] in bytes.
pub const HEADER_LEN: usize = 32;

/// What a frame's payload is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// A postcard-encoded control message, at most [`Limits::max_control_bytes`].
    Control = 1,
    /// Raw chunk bytes, at most [`Limits::max_bulk_bytes`].
    Bulk = 2,
}

impl FrameKind {
    /// Parses the kind byte of a header.
    pub fn from_u8(b: u8) -> Result<FrameKind, WireError> {
        match b {
            1 => Ok(FrameKind::Control),
            2 => Ok(FrameKind::Bulk),
            other => Err(WireError::UnknownFrameKind(other)),
        }
    }

    /// The payload limit for frames of this kind, and its name for errors.
    pub(crate) fn limit(self, limits: &Limits) -> (&'static str, u64) {
        match self {
            FrameKind::Control => ("control frame", limits.max_control_bytes),
            FrameKind::Bulk => ("bulk frame", limits.max_bulk_bytes),
        }
    }
}

/// A decoded frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// What the payload is.
    pub kind: FrameKind,
    /// Correlates a request, its reply, and the bulk frames belonging to it.
    pub request_id: u64,
    /// Payload length in bytes.
    pub len: u64,
    /// crc32c of the payload.
    pub checksum: u32,
}

impl FrameHeader {
    /// Encodes the header, computing the header crc.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[5] = self.kind as u8;
        // b[6..8]: reserved, zero.
        b[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b[24..28].copy_from_slice(&self.checksum.to_le_bytes());
        let crc = crate::checksum::checksum(&b[..28]);
        b[28..32].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes and validates a header; the announced length must be within `limits`
    /// for the frame's kind, else [`WireError::Oversize`].
    pub fn decode(buf: &[u8; HEADER_LEN], limits: &Limits) -> Result<FrameHeader, WireError> {
        let magic = [buf[0], buf[1], buf[2], buf[3]];
        if magic != MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        if buf[4] != VERSION {
            return Err(WireError::UnsupportedVersion {
                got: buf[4],
                supported: VERSION,
            });
        }
        let header_crc = le_u32(buf, 28);
        let actual = crate::checksum::checksum(&buf[..28]);
        if header_crc != actual {
            return Err(WireError::BadHeader(format!(
                "header crc mismatch: header says {header_crc:#010x}, computed {actual:#010x}"
            )));
        }
        let kind = FrameKind::from_u8(buf[5])?;
        let reserved = u16::from_le_bytes([buf[6], buf[7]]);
        if reserved != 0 {
            return Err(WireError::BadHeader(format!(
                "reserved field is {reserved:#06x}, must be 0"
            )));
        }
        let header = FrameHeader {
            kind,
            request_id: le_u64(buf, 8),
            len: le_u64(buf, 16),
            checksum: le_u32(buf, 24),
        };
        header.check_len(limits)?;
        Ok(header)
    }

    /// Checks `len` against the limit for this frame's kind.
    pub(crate) fn check_len(&self, limits: &Limits) -> Result<(), WireError> {
        let (what, limit) = self.kind.limit(limits);
        if self.len > limit {
            return Err(WireError::Oversize {
                what,
                len: self.len,
                limit,
            });
        }
        Ok(())
    }
}

fn le_u32(buf: &[u8; HEADER_LEN], at: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&buf[at..at + 4]);
    u32::from_le_bytes(b)
}

fn le_u64(buf: &[u8; HEADER_LEN], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&buf[at..at + 8]);
    u64::from_le_bytes(b)
}
