//! Async framing over any `AsyncRead`/`AsyncWrite`: headers, control frames, skipping.
//!
//! A control frame's payload is a postcard-encoded message, checksummed with crc32c like
//! a bulk payload. Readers check every announced length against [`Limits`] before
//! allocating: a control body allocates exactly `header.len` bytes, which is at most
//! [`Limits::max_control_bytes`], and decoding from that bounded slice cannot allocate
//! more than a small multiple of it.
//!
//! Cancellation: none of these functions is cancel-safe. Dropping one mid-way leaves
//! the stream at an unknown position inside a frame; the connection must then be torn
//! down, never reused. Writers flush before returning.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::{FrameHeader, FrameKind, Limits, WireError, HEADER_LEN};

/// Maps an unexpected EOF to [`WireError::Truncated`], other I/O errors to `Io`.
pub(crate) fn eof_is_truncated(e: std::io::Error) -> WireError {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        WireError::Truncated
    } else {
        WireError::Io(e)
    }
}

/// Reads and validates one frame header.
///
/// A clean end of stream before the first header byte is [`WireError::Closed`]; an end
/// of stream inside the header is [`WireError::Truncated`].
pub async fn read_frame_header<R: AsyncRead + Unpin>(r: &mut R, limits: &Limits) -> Result<FrameHeader, WireError> {
    let mut buf = [0u8; HEADER_LEN];
    let mut filled = 0;
    while filled < HEADER_LEN {
        let n = r.read(&mut buf[filled..]).await?;
        if n == 0 {
            return Err(if filled == 0 {
                WireError::Closed
            } else {
                WireError::Truncated
            });
        }
        filled += n;
    }
    FrameHeader::decode(&buf, limits)
}

/// Writes `msg` as one control frame with the given request id, then flushes.
pub async fn write_control<W: AsyncWrite + Unpin, M: serde::Serialize>(
    w: &mut W,
    request_id: u64,
    msg: &M,
) -> Result<(), WireError> {
    // Serialize behind a placeholder header so header and payload go out in one write.
    let mut buf =
        postcard::to_extend(msg, vec![0u8; HEADER_LEN]).map_err(|e| WireError::Decode(format!("encode: {e}")))?;
    let payload = &buf[HEADER_LEN..];
    let header = FrameHeader {
        kind: FrameKind::Control,
        request_id,
        len: payload.len() as u64,
        checksum: crate::checksum::checksum(payload),
    };
    buf[..HEADER_LEN].copy_from_slice(&header.encode());
    w.write_all(&buf).await?;
    w.flush().await?;
    Ok(())
}

/// Reads and decodes the payload of a control frame whose header was already read.
///
/// `header.kind` must be [`FrameKind::Control`] (else [`WireError::UnexpectedFrame`],
/// nothing read) and `header.len` within `limits` (else [`WireError::Oversize`], nothing
/// read or allocated). The payload is then read in full and checked: a checksum
/// mismatch or an undecodable or over-long payload is reported with the stream still at
/// a frame boundary.
pub async fn read_control_body<R: AsyncRead + Unpin, M: serde::de::DeserializeOwned>(
    r: &mut R,
    header: &FrameHeader,
    limits: &Limits,
) -> Result<M, WireError> {
    if header.kind != FrameKind::Control {
        return Err(WireError::UnexpectedFrame {
            expected: FrameKind::Control,
            got: header.kind,
        });
    }
    header.check_len(limits)?;
    let len = usize::try_from(header.len).map_err(|_| WireError::Oversize {
        what: "control frame",
        len: header.len,
        limit: usize::MAX as u64,
    })?;
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await.map_err(eof_is_truncated)?;
    let actual = crate::checksum::checksum(&body);
    if actual != header.checksum {
        return Err(WireError::ChecksumMismatch {
            expected: header.checksum,
            actual,
        });
    }
    let (msg, rest) = postcard::take_from_bytes::<M>(&body).map_err(|e| WireError::Decode(e.to_string()))?;
    if !rest.is_empty() {
        return Err(WireError::Decode(format!(
            "{} trailing bytes after message",
            rest.len()
        )));
    }
    Ok(msg)
}

/// Reads one control frame: returns its request id and decoded message.
///
/// A bulk frame here is [`WireError::UnexpectedFrame`]; its payload is left unread.
pub async fn read_control<R: AsyncRead + Unpin, M: serde::de::DeserializeOwned>(
    r: &mut R,
    limits: &Limits,
) -> Result<(u64, M), WireError> {
    let header = read_frame_header(r, limits).await?;
    let msg = read_control_body(r, &header, limits).await?;
    Ok((header.request_id, msg))
}

/// Reads and discards the payload of a frame whose header was already read, in bounded
/// chunks (nothing proportional to `header.len` is allocated). The checksum is not
/// verified.
pub async fn skip_body<R: AsyncRead + Unpin>(r: &mut R, header: &FrameHeader) -> Result<(), WireError> {
    let mut scratch = [0u8; 8192];
    let mut left = header.len;
    while left > 0 {
        let want = scratch.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        let n = r.read(&mut scratch[..want]).await?;
        if n == 0 {
            return Err(WireError::Truncated);
        }
        left -= n as u64;
    }
    Ok(())
}
