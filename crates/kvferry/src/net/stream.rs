//! The byte stream under a [`Connection`](super::Connection): plain TCP, or TLS over
//! TCP ([`tls`](super::tls)).
//!
//! Plain TCP keeps its zero-copy fast paths (vectored reads straight into destination
//! blocks, see [`crate::wire::read_bulk_body_tcp`]); TLS goes through the generic
//! `AsyncRead`/`AsyncWrite` paths, since its bytes must be decrypted anyway.
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

/// Plain TCP or TLS.
#[derive(Debug)]
pub(crate) enum Stream {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS over TCP (boxed: the TLS state is large).
    Tls(Box<TlsStream<TcpStream>>),
}

impl Stream {
    /// The TCP socket underneath.
    pub(crate) fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(s) => s.get_ref().0,
        }
    }

    /// True if the peer has closed this idle stream or sent something unasked. Never
    /// blocks, consumes nothing.
    pub(crate) fn is_stale(&self) -> bool {
        let mut b = [0u8; 1];
        let mut buf = ReadBuf::new(&mut b);
        let mut cx = Context::from_waker(futures::task::noop_waker_ref());
        // Any byte on an idle connection (data, or a TLS close_notify) or EOF: stale.
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
