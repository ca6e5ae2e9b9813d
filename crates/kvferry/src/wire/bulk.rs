//! Bulk frames: raw chunk bytes gathered from, and scattered into, caller buffers.
//!
//! A bulk frame carries one chunk. The writer sends the concatenation of several parts
//! without copying them together; the reader scatters the payload into several
//! destination parts in order. No buffer is allocated here: the caller owns all
//! memory, so a bulk read allocates nothing whatever the header announces.
//!
//! Cancellation: not cancel-safe (see [`codec`](super::codec)); on cancel or error
//! mid-payload the destination holds partial data and the connection must be dropped.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::codec::eof_is_truncated;
use super::{FrameHeader, FrameKind, WireError};

/// Bytes read before checksumming them: small enough to still be in a core's L2, large
/// enough that a read is few system calls (1 MiB measured best of 128 KiB – 4 MiB).
const VERIFY_PIECE: usize = 1 << 20;

/// Writes one bulk frame whose payload is the concatenation of `parts`, then flushes.
///
/// The checksum is computed over all parts first (one pass), then each part is written
/// as is.
pub async fn write_bulk<W: AsyncWrite + Unpin>(w: &mut W, request_id: u64, parts: &[&[u8]]) -> Result<(), WireError> {
    let mut checksum = 0u32;
    for p in parts {
        checksum = super::crc::append(checksum, p);
    }
    write_bulk_with_checksum(w, request_id, parts, checksum).await
}

/// As [`write_bulk`], with the payload's crc32c already known (e.g. computed when the
/// chunk was staged), saving a pass over the bytes. The receiver verifies it against
/// what arrives, so a wrong `checksum` is detected there, never silently accepted.
pub async fn write_bulk_with_checksum<W: AsyncWrite + Unpin>(
    w: &mut W,
    request_id: u64,
    parts: &[&[u8]],
    checksum: u32,
) -> Result<(), WireError> {
    let len: u64 = parts.iter().map(|p| p.len() as u64).sum();
    let header = FrameHeader {
        kind: FrameKind::Bulk,
        request_id,
        len,
        checksum,
    };
    w.write_all(&header.encode()).await?;
    for p in parts {
        w.write_all(p).await?;
    }
    w.flush().await?;
    Ok(())
}

/// Reads the payload of a bulk frame whose header was already read, scattering it into
/// `dst` in order, and verifies its checksum.
///
/// `header.kind` must be [`FrameKind::Bulk`] (else [`WireError::UnexpectedFrame`]) and the
/// total length of `dst` must equal `header.len` (else [`WireError::LengthMismatch`]);
/// both are checked before any byte is read. A checksum mismatch
/// ([`WireError::ChecksumMismatch`]) is reported after the whole payload was read, so the
/// stream is still at a frame boundary, but `dst` holds the corrupt bytes.
pub async fn read_bulk_body<R: AsyncRead + Unpin>(
    r: &mut R,
    header: &FrameHeader,
    dst: &mut [&mut [u8]],
) -> Result<(), WireError> {
    if header.kind != FrameKind::Bulk {
        return Err(WireError::UnexpectedFrame {
            expected: FrameKind::Bulk,
            got: header.kind,
        });
    }
    let total: u64 = dst.iter().map(|d| d.len() as u64).sum();
    if total != header.len {
        return Err(WireError::LengthMismatch {
            expected: header.len,
            actual: total,
        });
    }
    let mut actual = 0u32;
    for d in dst.iter_mut() {
        // Checksum each piece right after it arrives, while it is still in cache.
        for piece in d.chunks_mut(VERIFY_PIECE) {
            r.read_exact(piece).await.map_err(eof_is_truncated)?;
            actual = super::crc::append(actual, piece);
        }
    }
    if actual != header.checksum {
        return Err(WireError::ChecksumMismatch {
            expected: header.checksum,
            actual,
        });
    }
    Ok(())
}
