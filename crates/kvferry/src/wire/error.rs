//! The single error type of the wire layer.
//!
//! Every way a byte stream can be malformed maps to a typed variant of [`WireError`]:
//! decoding never panics and never allocates more than [`Limits`](super::Limits) allow.
//!
//! After any error raised while reading a header or a body, the stream position is
//! unspecified unless the variant says otherwise: [`WireError::ChecksumMismatch`] and
//! [`WireError::Decode`] are raised only after the whole payload was consumed, so the
//! stream is still at a frame boundary; [`WireError::LengthMismatch`] from
//! [`read_bulk_body`](super::read_bulk_body) is raised before any payload byte is read.

use super::FrameKind;

/// An error reading or writing kvferry frames and control messages.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The underlying transport failed.
    #[error("wire i/o error: {0}")]
    Io(#[from] std::io::Error),
    /// The peer closed the stream cleanly, before the first byte of a frame.
    #[error("connection closed")]
    Closed,
    /// The stream ended in the middle of a frame header or payload.
    #[error("stream ended mid-frame")]
    Truncated,
    /// No byte arrived for this long (a stalled peer; a slow but steady one never is).
    #[error("no progress for {0:?}")]
    Stalled(std::time::Duration),
    /// The frame did not start with [`MAGIC`](super::MAGIC).
    #[error("bad frame magic {0:02x?}")]
    BadMagic([u8; 4]),
    /// The frame carries a protocol version this build does not speak.
    #[error("unsupported wire version {got} (supported: {supported})")]
    UnsupportedVersion {
        /// The version found in the header.
        got: u8,
        /// The version this build speaks.
        supported: u8,
    },
    /// The frame kind byte is not a known [`FrameKind`].
    #[error("unknown frame kind {0}")]
    UnknownFrameKind(u8),
    /// The header is otherwise malformed (reserved bits set, header crc mismatch).
    #[error("bad frame header: {0}")]
    BadHeader(String),
    /// A length exceeds its configured limit; nothing was allocated for it.
    #[error("{what} of {len} bytes exceeds limit {limit}")]
    Oversize {
        /// What was too large (e.g. "control frame", "key list").
        what: &'static str,
        /// The length found.
        len: u64,
        /// The configured limit.
        limit: u64,
    },
    /// A payload's crc32c does not match the header's checksum.
    #[error("payload checksum mismatch: header says {expected:#010x}, payload is {actual:#010x}")]
    ChecksumMismatch {
        /// The checksum carried in the header.
        expected: u32,
        /// The checksum computed over the received payload.
        actual: u32,
    },
    /// The caller's buffers and the frame disagree on the payload length.
    #[error("length mismatch: expected {expected} bytes, got {actual}")]
    LengthMismatch {
        /// The length the frame header announces.
        expected: u64,
        /// The length the caller provided or the data had.
        actual: u64,
    },
    /// A control payload is not a valid encoding of the expected message (or, when
    /// writing, a message could not be encoded; derived types always can).
    #[error("cannot decode control message: {0}")]
    Decode(String),
    /// A frame of the wrong kind arrived.
    #[error("unexpected {got:?} frame (expected {expected:?})")]
    UnexpectedFrame {
        /// The kind the reader was waiting for.
        expected: FrameKind,
        /// The kind that arrived.
        got: FrameKind,
    },
}

impl WireError {
    /// The stable code of this error.
    pub fn code(&self) -> crate::ErrorCode {
        use crate::ErrorCode as C;
        match self {
            WireError::Io(_) => C::Io,
            WireError::Closed | WireError::Truncated | WireError::Stalled(_) => C::PeerLost,
            WireError::ChecksumMismatch { .. } => C::ChecksumMismatch,
            WireError::Oversize { .. } => C::TooLarge,
            _ => C::Protocol,
        }
    }
}
