//! One framed, handshaken TCP connection.
//!
//! Every read and write of a frame is bounded by the configured I/O timeout taken as a
//! *progress* timeout: it fails when no byte has moved for that long, never merely
//! because a large frame takes longer (see [`progress`](super::progress)); callers bound
//! the total with their own deadline. Waiting for the *start* of the next request on a
//! server is bounded by the idle timeout.
//!
//! # Cancellation
//!
//! Dropping a future of these methods may leave a frame half-written or half-read; the
//! connection must then be closed (pools only take a connection back through an
//! explicit `finish`).

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::progress::{self, MinRate, Progress};
use super::stream::Stream;
use super::{NetError, PeerInfo};
use crate::wire::{self, FrameHeader, FrameKind, Limits, Message, WireError};

/// A handshaken connection.
#[derive(Debug)]
pub struct Connection {
    /// Unique among this process's connections (for state tied to one connection).
    id: u64,
    stream: Stream,
    peer: PeerInfo,
    limits: Limits,
    io_timeout: Duration,
    /// The minimum rate of each frame (a server's connections; `None`: off).
    min_rate: Option<MinRate>,
    next_request: u64,
}

/// The `op` of the [`NetError::Timeout`] raised when no frame starts within the idle
/// bound of [`Connection::read_header`].
pub(crate) const IDLE_OP: &str = "wait for next frame";

/// A stall of `op` (no byte moved for `d`) becomes [`NetError::Timeout`].
fn stalled_is_timeout(op: &'static str, d: Duration, e: WireError) -> NetError {
    match e {
        WireError::Io(io) if progress::is_stall(&io) => NetError::Timeout { op, waited: d },
        WireError::Stalled(_) => NetError::Timeout { op, waited: d },
        e => NetError::Wire(e),
    }
}

impl Connection {
    pub(crate) fn new(stream: Stream, peer: PeerInfo, limits: Limits, io_timeout: Duration) -> Connection {
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Connection {
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            stream,
            peer,
            limits,
            io_timeout,
            min_rate: None,
            next_request: 1,
        }
    }

    pub(crate) fn set_peer(&mut self, peer: PeerInfo) {
        self.peer = peer;
    }

    pub(crate) fn set_io_timeout(&mut self, d: Duration) {
        self.io_timeout = d;
    }

    pub(crate) fn set_min_rate(&mut self, rate: Option<MinRate>) {
        self.min_rate = rate;
    }

    pub(crate) fn set_limits(&mut self, limits: Limits) {
        self.limits = limits;
    }

    /// True if the peer has closed this (idle) connection or sent something unasked:
    /// either way it must not be reused. Never blocks.
    pub fn is_stale(&self) -> bool {
        self.stream.is_stale()
    }

    /// True if this connection runs over TLS.
    pub fn is_tls(&self) -> bool {
        matches!(self.stream, Stream::Tls(_))
    }

    /// Reads a bulk body: vectored straight into `dst` on plain TCP (zero copy), through
    /// the generic reader (with the same progress timeout) over TLS.
    async fn read_bulk_body(&mut self, header: &FrameHeader, dst: &mut [&mut [u8]]) -> Result<(), WireError> {
        let (d, rate) = (self.io_timeout, self.min_rate);
        match &mut self.stream {
            Stream::Plain(tcp) if rate.is_none() => wire::read_bulk_body_tcp(tcp, header, dst, d).await,
            // With a minimum rate (a server's connections), through the generic reader,
            // which enforces it (still straight into `dst`).
            s => wire::read_bulk_body(&mut Progress::new(s, d).with_min_rate(rate), header, dst).await,
        }
    }

    /// This connection's id, unique within the process (never reused).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Who is on the other side.
    pub fn peer(&self) -> &PeerInfo {
        &self.peer
    }

    /// The frame limits in force.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// A fresh request id.
    pub fn next_request_id(&mut self) -> u64 {
        self.next_request += 1;
        self.next_request
    }

    fn lost(&self, e: NetError) -> NetError {
        match e {
            NetError::Wire(WireError::Closed) => NetError::Lost {
                peer: self.peer.to_string(),
                reason: "closed by peer".into(),
            },
            NetError::Wire(WireError::Io(io)) => NetError::Lost {
                peer: self.peer.to_string(),
                reason: io.to_string(),
            },
            NetError::Wire(WireError::Truncated) => NetError::Lost {
                peer: self.peer.to_string(),
                reason: "connection closed mid-frame".into(),
            },
            other => other,
        }
    }

    /// Sends a control message.
    pub async fn send(&mut self, request_id: u64, msg: &Message) -> Result<(), NetError> {
        let d = self.io_timeout;
        let r = wire::write_control(
            &mut Progress::new(&mut self.stream, d).with_min_rate(self.min_rate),
            request_id,
            msg,
        )
        .await;
        r.map_err(|e| self.lost(stalled_is_timeout("send control frame", d, e)))
    }

    /// Sends one bulk frame made of `parts`.
    pub async fn send_bulk(&mut self, request_id: u64, parts: &[&[u8]]) -> Result<(), NetError> {
        let d = self.io_timeout;
        let r = wire::write_bulk(
            &mut Progress::new(&mut self.stream, d).with_min_rate(self.min_rate),
            request_id,
            parts,
        )
        .await;
        r.map_err(|e| self.lost(stalled_is_timeout("send bulk frame", d, e)))
    }

    /// Sends one bulk frame made of `parts` whose crc32c is already known.
    pub async fn send_bulk_with_checksum(
        &mut self,
        request_id: u64,
        parts: &[&[u8]],
        checksum: u32,
    ) -> Result<(), NetError> {
        let d = self.io_timeout;
        let mut stream = Progress::new(&mut self.stream, d).with_min_rate(self.min_rate);
        let r = wire::write_bulk_with_checksum(&mut stream, request_id, parts, checksum).await;
        r.map_err(|e| self.lost(stalled_is_timeout("send bulk frame", d, e)))
    }

    /// Reads the next frame header, waiting at most `idle` for it to start; the rest of
    /// it fails only after the I/O timeout without a byte.
    pub async fn read_header(&mut self, idle: Duration) -> Result<FrameHeader, NetError> {
        let mut first = [0u8; 1];
        let n = match tokio::time::timeout(idle, self.stream.read(&mut first)).await {
            Err(_) => {
                return Err(NetError::Timeout {
                    op: IDLE_OP,
                    waited: idle,
                })
            }
            Ok(Err(e)) => return Err(self.lost(NetError::Wire(WireError::Io(e)))),
            Ok(Ok(n)) => n,
        };
        if n == 0 {
            return Err(self.lost(NetError::Wire(WireError::Closed)));
        }
        let d = self.io_timeout;
        let mut chained = (&first[..]).chain(Progress::new(&mut self.stream, d).with_min_rate(self.min_rate));
        let r = wire::read_frame_header(&mut chained, &self.limits).await;
        r.map_err(|e| match e {
            WireError::Closed => self.lost(NetError::Wire(WireError::Truncated)),
            e => self.lost(stalled_is_timeout("read frame header", d, e)),
        })
    }

    /// Reads a control message body for `header`, validated against the limits.
    pub async fn read_control_body(&mut self, header: &FrameHeader) -> Result<Message, NetError> {
        let d = self.io_timeout;
        let mut stream = Progress::new(&mut self.stream, d).with_min_rate(self.min_rate);
        let r = wire::read_control_body::<_, Message>(&mut stream, header, &self.limits).await;
        let msg = r.map_err(|e| self.lost(stalled_is_timeout("read control frame", d, e)))?;
        msg.validate(&self.limits)?;
        Ok(msg)
    }

    /// Reads the next frame, which must be a control message: its first byte must come
    /// within the I/O timeout, and the rest keep coming. A peer `Error` message is
    /// returned as [`NetError::Remote`].
    pub async fn recv(&mut self) -> Result<(u64, Message), NetError> {
        let header = self.read_header(self.io_timeout).await?;
        if header.kind != FrameKind::Control {
            return Err(NetError::Protocol(format!(
                "expected a control frame, got {:?}",
                header.kind
            )));
        }
        let msg = self.read_control_body(&header).await?;
        match msg {
            Message::Error { kind, message } => Err(NetError::Remote { kind, message }),
            m => Ok((header.request_id, m)),
        }
    }

    /// Receives a reply to `request_id`.
    pub async fn recv_reply(&mut self, request_id: u64) -> Result<Message, NetError> {
        let (id, msg) = self.recv().await?;
        if id != request_id {
            return Err(NetError::Protocol(format!(
                "reply for request {id}, expected {request_id}"
            )));
        }
        Ok(msg)
    }

    /// Sends a request and waits for its reply.
    pub async fn request(&mut self, msg: &Message) -> Result<Message, NetError> {
        let id = self.next_request_id();
        self.send(id, msg).await?;
        self.recv_reply(id).await
    }

    /// Reads one bulk frame for `request_id` into `dst` (whose lengths must add up to the
    /// frame's length) and returns the frame's verified checksum.
    pub async fn recv_bulk(&mut self, request_id: u64, dst: &mut [&mut [u8]]) -> Result<u32, NetError> {
        let header = self.read_header(self.io_timeout).await?;
        if header.kind == FrameKind::Control && header.request_id == request_id {
            // The peer refused instead of sending bytes.
            return match self.read_control_body(&header).await? {
                Message::Error { kind, message } => Err(NetError::Remote { kind, message }),
                other => Err(NetError::Unexpected {
                    expected: "a bulk frame",
                    got: other.name(),
                }),
            };
        }
        if header.kind != FrameKind::Bulk || header.request_id != request_id {
            return Err(NetError::Protocol(format!(
                "expected bulk frame for request {request_id}, got {:?} for {}",
                header.kind, header.request_id
            )));
        }
        let d = self.io_timeout;
        let r = self.read_bulk_body(&header, dst).await;
        r.map_err(|e| self.lost(stalled_is_timeout("read bulk frame", d, e)))?;
        Ok(header.checksum)
    }

    /// Reads the body of an already-read bulk `header` into `dst`.
    pub async fn read_bulk_into(&mut self, header: &FrameHeader, dst: &mut [&mut [u8]]) -> Result<u32, NetError> {
        if header.kind != FrameKind::Bulk {
            return Err(NetError::Protocol(format!(
                "expected a bulk frame, got {:?}",
                header.kind
            )));
        }
        let d = self.io_timeout;
        let r = self.read_bulk_body(header, dst).await;
        r.map_err(|e| self.lost(stalled_is_timeout("read bulk frame", d, e)))?;
        Ok(header.checksum)
    }

    /// The configured I/O timeout.
    pub fn io_timeout(&self) -> Duration {
        self.io_timeout
    }

    /// Discards the body of a frame (to stay in sync after refusing it).
    pub async fn skip(&mut self, header: &FrameHeader) -> Result<(), NetError> {
        let d = self.io_timeout;
        let r = wire::skip_body(
            &mut Progress::new(&mut self.stream, d).with_min_rate(self.min_rate),
            header,
        )
        .await;
        r.map_err(|e| self.lost(stalled_is_timeout("skip frame", d, e)))
    }

    /// Flushes and closes the write side (best effort).
    pub async fn shutdown(mut self) {
        let _ = tokio::time::timeout(Duration::from_millis(200), self.stream.shutdown()).await;
    }
}
