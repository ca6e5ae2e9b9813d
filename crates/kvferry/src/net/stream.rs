//! The byte stream under a [`Connection`](super::Connection): plain TCP, or TLS over
//! TCP ([`tls`](super::tls)).
//!
//! Plain TCP keeps its zero-copy fast paths (vectored reads straight into destination
//! blocks, see [`crate::wire::read_bulk_body_tcp`]); TLS goes through the generic
//! `AsyncRead`/`AsyncWrite` paths, since its bytes must be decrypted anyway.
//!
//! Under TLS the socket is a [`TlsTcp`]: rustls pulls ciphertext at most 4 KiB per
//! read (its deframer grows by 4 KiB at a time), which straight from the socket is one
//! `recv` system call per 4 KiB — about 250,000 per GB received. [`TlsTcp`] reads
//! the socket [`TLS_READ_BUFFER`] bytes at a time and hands rustls its 4 KiB reads
//! from that buffer while they are still in cache. Writes go straight to the socket
//! (rustls already writes many records per vectored write).
//!
//! # Cancellation
//!
//! Dropping a read or write future mid-frame leaves the stream out of sync (and a TLS
//! stream possibly mid-record); the connection is then closed, never reused.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsStream;

/// Bytes [`TlsTcp`] reads from the socket at once (a sixteenth of the socket's 4 MiB
/// receive buffer; 4 KiB, rustls' own read size, and 1 MiB measured in
/// docs/benchmarks.md).
pub(crate) const TLS_READ_BUFFER: usize = 256 << 10;

/// Plaintext rustls takes per write before it must flush its records to the socket
/// (rustls' default is 64 KiB: one vectored write per four records; 64 KiB and 1 MiB
/// measured in docs/benchmarks.md).
pub(crate) const TLS_WRITE_BUFFER: usize = 256 << 10;

/// A TCP stream with a read buffer, under TLS (see the module docs). Writes are not
/// buffered.
#[derive(Debug)]
pub(crate) struct TlsTcp {
    tcp: TcpStream,
    /// Allocated on the first read that needs it (empty until then).
    buf: Box<[u8]>,
    /// Bytes `buf[start..end]` were read from the socket and not yet handed on.
    start: usize,
    end: usize,
}

impl TlsTcp {
    pub(crate) fn new(tcp: TcpStream) -> TlsTcp {
        TlsTcp {
            tcp,
            buf: Box::default(),
            start: 0,
            end: 0,
        }
    }

    /// The socket underneath.
    pub(crate) fn tcp(&self) -> &TcpStream {
        &self.tcp
    }

    /// Bytes read from the socket that no reader has taken yet.
    pub(crate) fn buffered(&self) -> usize {
        self.end - self.start
    }
}

impl AsyncRead for TlsTcp {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, out: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        if me.start == me.end {
            if out.remaining() >= TLS_READ_BUFFER {
                // As large as the buffer: straight into the caller's.
                return Pin::new(&mut me.tcp).poll_read(cx, out);
            }
            if me.buf.is_empty() {
                me.buf = vec![0u8; TLS_READ_BUFFER].into_boxed_slice();
            }
            let mut rb = ReadBuf::new(&mut me.buf);
            std::task::ready!(Pin::new(&mut me.tcp).poll_read(cx, &mut rb))?;
            let n = rb.filled().len();
            (me.start, me.end) = (0, n);
            if n == 0 {
                return Poll::Ready(Ok(())); // end of stream
            }
        }
        let n = out.remaining().min(me.end - me.start);
        out.put_slice(&me.buf[me.start..me.start + n]);
        me.start += n;
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for TlsTcp {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().tcp).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_shutdown(cx)
    }
}

/// Plain TCP or TLS.
#[derive(Debug)]
pub(crate) enum Stream {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS over TCP (boxed: the TLS state is large).
    Tls(Box<TlsStream<TlsTcp>>),
}

impl Stream {
    /// The TCP socket underneath.
    pub(crate) fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(s) => s.get_ref().0.tcp(),
        }
    }

    /// True if the peer has closed this idle stream or sent something unasked. Never
    /// blocks, consumes nothing.
    pub(crate) fn is_stale(&self) -> bool {
        let mut b = [0u8; 1];
        let mut buf = ReadBuf::new(&mut b);
        let mut cx = Context::from_waker(futures::task::noop_waker_ref());
        // Any byte on an idle connection (data, or a TLS close_notify) or EOF: stale;
        // under TLS, bytes already read into the buffer count as well.
        if let Stream::Tls(s) = self {
            if s.get_ref().0.buffered() > 0 {
                return true;
            }
        }
        !matches!(self.tcp().poll_peek(&mut cx, &mut buf), Poll::Pending)
    }
}

impl AsyncRead for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Plain(s) => s.is_write_vectored(),
            Stream::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A pair of connected loopback sockets.
    async fn pair() -> (TcpStream, TcpStream) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (a, b) = tokio::join!(TcpStream::connect(addr), l.accept());
        (a.unwrap(), b.unwrap().0)
    }

    #[tokio::test]
    async fn buffered_reads_hand_on_every_byte_in_order_and_count_as_stale() {
        let (mut tx, rx) = pair().await;
        let data: Vec<u8> = (0..3 * TLS_READ_BUFFER as u32 + 777)
            .map(|i| (i * 31 + 7) as u8)
            .collect();
        let send = data.clone();
        let writer = tokio::spawn(async move {
            tx.write_all(&send).await.unwrap();
            tx
        });
        let mut r = TlsTcp::new(rx);
        let mut got = Vec::with_capacity(data.len());
        // rustls' reads are 4 KiB or less; a read as large as the buffer bypasses it.
        let mut small = [0u8; 4096 - 5];
        while got.len() < TLS_READ_BUFFER {
            let n = r.read(&mut small).await.unwrap();
            assert!(n > 0);
            got.extend_from_slice(&small[..n]);
        }
        let mut big = vec![0u8; TLS_READ_BUFFER];
        while got.len() < data.len() {
            let n = r.read(&mut big).await.unwrap();
            assert!(n > 0);
            got.extend_from_slice(&big[..n]);
        }
        assert_eq!(got, data, "every byte, in order");
        let mut tx = writer.await.unwrap();
        assert_eq!(r.buffered(), 0);
        // Two more bytes, one taken: the other waits in the buffer (which
        // `Stream::is_stale` counts as an unread byte on an idle connection).
        tx.write_all(&[1, 2]).await.unwrap();
        let mut one = [0u8; 1];
        r.read_exact(&mut one).await.unwrap();
        assert_eq!(one, [1]);
        assert_eq!(r.buffered(), 1);
        r.read_exact(&mut one).await.unwrap();
        assert_eq!((one, r.buffered()), ([2], 0));
        drop(tx);
        assert_eq!(r.read(&mut small).await.unwrap(), 0, "end of stream");
    }
}
