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
        checksum = crate::checksum::append(checksum, p);
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
    let head = header.encode();
    write_all_vectored(w, &head, parts).await?;
    w.flush().await?;
    Ok(())
}

/// Most slices handed to one vectored write (Linux's `IOV_MAX` is 1024).
const MAX_IOVECS: usize = 1024;

/// Writes `head` then every part with vectored writes: a chunk made of hundreds of
/// small pieces (one per layer and K/V of each block) goes out in a few system calls,
/// not one per piece.
async fn write_all_vectored<W: AsyncWrite + Unpin>(w: &mut W, head: &[u8], parts: &[&[u8]]) -> Result<(), WireError> {
    let mut slices: Vec<std::io::IoSlice<'_>> = Vec::with_capacity(parts.len() + 1);
    slices.push(std::io::IoSlice::new(head));
    slices.extend(parts.iter().filter(|p| !p.is_empty()).map(|p| std::io::IoSlice::new(p)));
    let mut bufs: &mut [std::io::IoSlice<'_>] = &mut slices;
    while !bufs.is_empty() {
        let n = bufs.len().min(MAX_IOVECS);
        let written = w.write_vectored(&bufs[..n]).await?;
        if written == 0 {
            return Err(WireError::Io(std::io::Error::new(
                std::io::ErrorKind::WriteZero,
                "connection accepted no more bytes",
            )));
        }
        std::io::IoSlice::advance_slices(&mut bufs, written);
    }
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
            actual = crate::checksum::append(actual, piece);
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

/// As [`read_bulk_body`], reading a TCP stream with vectored reads: a destination made
/// of many small pieces (one per layer and K/V of each block) fills in a few system
/// calls. Each read is capped near [`VERIFY_PIECE`] bytes and checksummed right after
/// it arrived, while still in cache. Fails with [`WireError::Stalled`] when no byte
/// arrived for `progress_timeout` (a slow but steady stream never fails).
pub async fn read_bulk_body_tcp(
    stream: &mut tokio::net::TcpStream,
    header: &FrameHeader,
    dst: &mut [&mut [u8]],
    progress_timeout: std::time::Duration,
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
    // Position: slice `idx`, byte `off` within it.
    let (mut idx, mut off) = (0usize, 0usize);
    while idx < dst.len() && dst[idx].is_empty() {
        idx += 1;
    }
    let mut deadline = tokio::time::Instant::now() + progress_timeout;
    while idx < dst.len() {
        match tokio::time::timeout_at(deadline, stream.readable()).await {
            Err(_) => return Err(WireError::Stalled(progress_timeout)),
            Ok(r) => r?,
        }
        let read = {
            let mut iov: Vec<std::io::IoSliceMut<'_>> = Vec::new();
            let mut budget = VERIFY_PIECE;
            let (first, rest) = dst[idx..].split_first_mut().expect("idx < len");
            let head = &mut first[off..];
            let take = head.len().min(budget);
            budget -= take;
            iov.push(std::io::IoSliceMut::new(&mut head[..take]));
            for d in rest.iter_mut() {
                if budget == 0 || iov.len() == MAX_IOVECS {
                    break;
                }
                let take = d.len().min(budget);
                budget -= take;
                iov.push(std::io::IoSliceMut::new(&mut d[..take]));
            }
            match stream.try_read_vectored(&mut iov) {
                Ok(0) => return Err(WireError::Truncated),
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(WireError::Io(e)),
            }
        };
        deadline = tokio::time::Instant::now() + progress_timeout;
        // Checksum what just arrived and advance the position.
        let mut left = read;
        while left > 0 {
            let d = &dst[idx];
            let take = (d.len() - off).min(left);
            actual = crate::checksum::append(actual, &d[off..off + take]);
            off += take;
            left -= take;
            if off == d.len() {
                idx += 1;
                off = 0;
                while idx < dst.len() && dst[idx].is_empty() {
                    idx += 1;
                }
            }
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
