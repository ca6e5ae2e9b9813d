//! Progress timeouts: an I/O operation fails only when no byte moved for a while.
//!
//! [`Progress`] wraps a stream for the duration of one frame read or write. Every poll
//! that moves at least one byte pushes the deadline to `now + timeout`; a poll that
//! finds the stream not ready waits on that deadline and, once it passes, fails with an
//! [`io::Error`] recognised by [`is_stall`]. A transfer that keeps moving, however
//! slowly, never trips it; the caller's own deadline bounds the total.
//!
//! With a [`MinRate`] (a server's connections, see `NetConfig::min_rate`) a frame also
//! fails once, after its grace, fewer bytes moved than the minimum rate allows for
//! the time since the grace ended: a peer trickling a byte now and then (which resets
//! the progress timeout every time) cannot hold a transfer, and what it holds, for
//! long. The check is cumulative, so a fast frame that pauses briefly never trips it.
//!
//! The vectored bulk read ([`wire::read_bulk_body_tcp`](crate::wire::read_bulk_body_tcp)),
//! whose reads go straight to the socket, takes the same progress timeout itself.
//!
//! # Cancellation
//!
//! [`Progress`] holds no state outside the wrapped stream, and dropping a read or write
//! through it (a caller's deadline, a `select!` arm) loses nothing it owns. A frame
//! cut off in the middle leaves the stream at an unknown position in the framing, so
//! the owner of the connection must close it rather than use it again: a pool takes a
//! connection back only through an explicit `PooledConnection::finish`, so one
//! abandoned mid-frame is closed.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// A minimum transfer rate, enforced after a grace period.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MinRate {
    /// Bytes per second a frame must average, counted from the end of the grace.
    pub bytes_per_sec: u64,
    /// How long a frame may take before the rate counts.
    pub grace: Duration,
}

/// The error payload of a stall, so that it is told apart from any other timeout.
#[derive(Debug)]
enum Stalled {
    /// No byte moved for this long.
    Silent(Duration),
    /// Fewer bytes than the minimum rate allows.
    TooSlow { moved: u64, rate: MinRate },
}

impl std::fmt::Display for Stalled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stalled::Silent(d) => write!(f, "no progress for {d:?}"),
            Stalled::TooSlow { moved, rate } => write!(
                f,
                "slower than the minimum rate of {} B/s after a grace of {:?} ({moved} bytes moved)",
                rate.bytes_per_sec, rate.grace
            ),
        }
    }
}

impl std::error::Error for Stalled {}

fn stalled(why: Stalled) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, why)
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
    rate: Option<MinRate>,
    start: Instant,
    moved: u64,
}

impl<'a, S> Progress<'a, S> {
    pub(crate) fn new(inner: &'a mut S, timeout: Duration) -> Progress<'a, S> {
        let now = Instant::now();
        Progress {
            inner,
            timeout,
            deadline: now + timeout,
            sleep: None,
            rate: None,
            start: now,
            moved: 0,
        }
    }

    /// Also fails a frame slower than `rate` (none: progress timeout only).
    pub(crate) fn with_min_rate(mut self, rate: Option<MinRate>) -> Progress<'a, S> {
        self.rate = rate.filter(|r| r.bytes_per_sec > 0);
        self
    }

    /// When the bytes moved so far stop satisfying the minimum rate.
    fn rate_deadline(&self) -> Option<Instant> {
        let r = self.rate?;
        let allowed = Duration::from_secs_f64(self.moved as f64 / r.bytes_per_sec as f64);
        Some(self.start + r.grace + allowed)
    }

    fn too_slow(&self, now: Instant) -> Option<io::Error> {
        let r = self.rate?;
        (self.rate_deadline()? <= now).then(|| {
            stalled(Stalled::TooSlow {
                moved: self.moved,
                rate: r,
            })
        })
    }

    /// `n` bytes moved; an error if the frame is still too slow.
    fn progressed(&mut self, n: usize) -> Option<io::Error> {
        let now = Instant::now();
        self.deadline = now + self.timeout;
        self.moved += n as u64;
        self.too_slow(now)
    }

    /// The inner stream is not ready: pending until the deadline, then a stall.
    fn poll_stalled<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        let deadline = match self.rate_deadline() {
            Some(r) => r.min(self.deadline),
            None => self.deadline,
        };
        let sleep = self
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if sleep.deadline() != deadline {
            sleep.as_mut().reset(deadline);
        }
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => {
                let e = self
                    .too_slow(Instant::now())
                    .unwrap_or_else(|| stalled(Stalled::Silent(self.timeout)));
                Poll::Ready(Err(e))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn after_write(&mut self, cx: &mut Context<'_>, r: Poll<io::Result<usize>>) -> Poll<io::Result<usize>> {
        match r {
            Poll::Ready(Ok(n)) => {
                if n > 0 {
                    if let Some(e) = self.progressed(n) {
                        return Poll::Ready(Err(e));
                    }
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
                let n = buf.filled().len() - before;
                if n > 0 {
                    if let Some(e) = this.progressed(n) {
                        return Poll::Ready(Err(e));
                    }
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

    #[tokio::test(start_paused = true)]
    async fn a_trickle_below_the_minimum_rate_fails_after_the_grace() {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        let writer = tokio::spawn(async move {
            loop {
                if a.write_all(&[1]).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        });
        let rate = MinRate {
            bytes_per_sec: 1024,
            grace: Duration::from_secs(3),
        };
        let mut got = [0u8; 100];
        let start = Instant::now();
        let e = Progress::new(&mut b, Duration::from_secs(1))
            .with_min_rate(Some(rate))
            .read_exact(&mut got)
            .await
            .unwrap_err();
        assert!(is_stall(&e), "{e}");
        assert!(e.to_string().contains("minimum rate"), "{e}");
        let t = start.elapsed();
        assert!(t >= Duration::from_secs(3) && t < Duration::from_millis(3100), "{t:?}");
        writer.abort();
        // A fast frame with a pause inside its grace passes.
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        let writer = tokio::spawn(async move {
            a.write_all(&[2; 4096]).await.unwrap();
            tokio::time::sleep(Duration::from_millis(2500)).await;
            a.write_all(&[3; 4096]).await.unwrap();
            a
        });
        let mut got = vec![0u8; 8192];
        Progress::new(&mut b, Duration::from_secs(5))
            .with_min_rate(Some(rate))
            .read_exact(&mut got)
            .await
            .unwrap();
        drop(writer.await.unwrap());
    }
}
