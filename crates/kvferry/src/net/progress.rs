//! Progress timeouts: an I/O operation fails only when no byte moved for a while.
//!
//! [`Progress`] wraps a stream for the duration of one frame read or write. Every poll
//! that moves at least one byte pushes the deadline to `now + timeout`; a poll that
//! finds the stream not ready waits on that deadline and, once it passes, fails with an
//! [`io::Error`] recognised by [`is_stall`]. A transfer that keeps moving, however
//! slowly, never trips it; the caller's own deadline bounds the total.
//!
//! The vectored bulk read ([`wire::read_bulk_body_tcp`](crate::wire::read_bulk_body_tcp)),
//! whose reads go straight to the socket, takes the same progress timeout itself.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// The error payload of a stall, so that it is told apart from any other timeout.
#[derive(Debug)]
struct Stalled(Duration);

impl std::fmt::Display for Stalled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "no progress for {:?}", self.0)
    }
}

impl std::error::Error for Stalled {}

fn stalled(d: Duration) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, Stalled(d))
}

/// True if `e` is a stall raised by [`Progress`].
pub(crate) fn is_stall(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|r| r.is::<Stalled>())
}

/// A stream whose reads and writes fail after `timeout` without progress.
pub(crate) struct Progress<'a, S> {
    inner: &'a mut S,
    timeout: Duration,
    deadline: Instant,
    /// Created on the first wait only: a frame that never waits allocates nothing.
    sleep: Option<Pin<Box<Sleep>>>,
}

impl<'a, S> Progress<'a, S> {
    pub(crate) fn new(inner: &'a mut S, timeout: Duration) -> Progress<'a, S> {
        Progress {
            inner,
            timeout,
            deadline: Instant::now() + timeout,
            sleep: None,
        }
    }

    fn progressed(&mut self) {
        self.deadline = Instant::now() + self.timeout;
    }

    /// The inner stream is not ready: pending until the deadline, then a stall.
    fn poll_stalled<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        let deadline = self.deadline;
        let sleep = self
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if sleep.deadline() != deadline {
            sleep.as_mut().reset(deadline);
        }
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(stalled(self.timeout))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn after_write(&mut self, cx: &mut Context<'_>, r: Poll<io::Result<usize>>) -> Poll<io::Result<usize>> {
        match r {
            Poll::Ready(Ok(n)) => {
                if n > 0 {
                    self.progressed();
                }
                Poll::Ready(Ok(n))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => self.poll_stalled(cx),
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Progress<'_, S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut *this.inner).poll_read(cx, buf) {
            Poll::Ready(r) => {
                if buf.filled().len() > before {
                    this.progressed();
                }
                Poll::Ready(r)
            }
            Poll::Pending => this.poll_stalled(cx),
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Progress<'_, S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut *this.inner).poll_write(cx, buf);
        this.after_write(cx, r)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut *this.inner).poll_write_vectored(cx, bufs);
        this.after_write(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match Pin::new(&mut *this.inner).poll_flush(cx) {
            Poll::Ready(r) => Poll::Ready(r),
            Poll::Pending => this.poll_stalled(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match Pin::new(&mut *this.inner).poll_shutdown(cx) {
            Poll::Ready(r) => Poll::Ready(r),
            Poll::Pending => this.poll_stalled(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test(start_paused = true)]
    async fn a_trickle_never_stalls_and_silence_does() {
        let (mut a, mut b) = tokio::io::duplex(64);
        let writer = tokio::spawn(async move {
            for i in 0..20u8 {
                a.write_all(&[i]).await.unwrap();
                tokio::time::sleep(Duration::from_millis(400)).await;
            }
            // Then silence, connection open.
            tokio::time::sleep(Duration::from_secs(3600)).await;
            drop(a);
        });
        let mut got = [0u8; 20];
        let start = Instant::now();
        Progress::new(&mut b, Duration::from_secs(1))
            .read_exact(&mut got)
            .await
            .unwrap();
        assert!(
            start.elapsed() >= Duration::from_millis(7600),
            "the trickle took 8 s in all"
        );
        let mut one = [0u8; 1];
        let start = Instant::now();
        let e = Progress::new(&mut b, Duration::from_secs(1))
            .read_exact(&mut one)
            .await
            .unwrap_err();
        assert!(is_stall(&e), "{e}");
        assert_eq!(start.elapsed(), Duration::from_secs(1));
        writer.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_blocked_writer_stalls() {
        let (mut a, _b) = tokio::io::duplex(16);
        let start = Instant::now();
        let e = Progress::new(&mut a, Duration::from_millis(500))
            .write_all(&[0u8; 64])
            .await
            .unwrap_err();
        assert!(is_stall(&e), "{e}");
        assert_eq!(start.elapsed(), Duration::from_millis(500));
        assert!(!is_stall(&io::Error::new(io::ErrorKind::TimedOut, "other")));
    }
}
