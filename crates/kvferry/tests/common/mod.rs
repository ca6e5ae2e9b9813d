//! Test helpers: a copy body that parks inside slices and counts the threads in it.
#![allow(dead_code)]

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry::copy::{CopyBody, SliceWork};
use parking_lot::{Condvar, Mutex};

/// Parks every slice (after copying it) until `release()`; counts threads inside.
/// Slices listed in `fail` return an error (once another slice has started), without
/// parking.
#[derive(Default)]
pub struct ParkingBody {
    pub inside: AtomicUsize,
    pub ran: AtomicUsize,
    open: Mutex<bool>,
    cv: Condvar,
    pub fail: Mutex<HashSet<usize>>,
}

impl ParkingBody {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    pub fn failing(slices: &[usize]) -> Arc<Self> {
        let b = Self::default();
        b.fail.lock().extend(slices.iter().copied());
        Arc::new(b)
    }

    pub fn release(&self) {
        *self.open.lock() = true;
        self.cv.notify_all();
    }

    /// Releases parked threads when dropped (so a failing test cannot leave copy
    /// threads parked forever, which would hang the engine's shutdown).
    pub fn release_on_drop(self: &Arc<Self>) -> ReleaseOnDrop {
        ReleaseOnDrop(self.clone())
    }

    pub fn inside(&self) -> usize {
        self.inside.load(Ordering::SeqCst)
    }

    /// Waits (bounded) until `n` threads are parked inside.
    pub fn wait_inside(&self, n: usize) {
        let t = Instant::now();
        while self.inside() < n {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "only {} threads entered",
                self.inside()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl CopyBody for ParkingBody {
    fn run(&self, work: &SliceWork<'_>) -> Result<(), String> {
        if self.fail.lock().contains(&work.index) {
            // Fail only once a sibling slice has started, so the test observes an
            // error "while siblings are still writing" deterministically.
            let t = Instant::now();
            while self.ran.load(Ordering::SeqCst) == 0 && t.elapsed() < Duration::from_secs(2) {
                std::thread::sleep(Duration::from_millis(1));
            }
            return Err(format!("injected failure in slice {}", work.index));
        }
        self.inside.fetch_add(1, Ordering::SeqCst);
        self.ran.fetch_add(1, Ordering::SeqCst);
        let copied = work.copy();
        let mut open = self.open.lock();
        while !*open {
            self.cv.wait(&mut open);
        }
        drop(open);
        self.inside.fetch_sub(1, Ordering::SeqCst);
        copied
    }
}

pub struct ReleaseOnDrop(Arc<ParkingBody>);

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        self.0.release();
    }
}

/// Asserts `check()` holds every 10 ms for `window`.
pub async fn holds_for(window: Duration, check: impl FnMut() -> Result<(), String>) {
    holds_for_every(window, Duration::from_millis(10), check).await
}

/// Asserts `check()` holds every `every` for `window` (and was sampled at least 10
/// times).
pub async fn holds_for_every(window: Duration, every: Duration, mut check: impl FnMut() -> Result<(), String>) {
    let t = Instant::now();
    let mut samples = 0;
    while t.elapsed() < window {
        if let Err(e) = check() {
            panic!("invariant broken after {:?} ({samples} samples): {e}", t.elapsed());
        }
        samples += 1;
        tokio::time::sleep(every).await;
    }
    assert!(samples >= 10, "window too short to sample ({samples} samples)");
}

/// Waits (bounded) for `cond`.
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let t = Instant::now();
    while !cond() {
        assert!(t.elapsed() < Duration::from_secs(10), "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}
pub mod child;
pub mod drain;
pub mod engines;
pub mod halves;
pub mod p2p;
pub mod raw;
pub mod tls;

/// The releases `e` reports within `within` (empty if none): waits on its release
/// notification, never polls.
pub async fn released_within(e: &kvferry::engine::Engine, within: Duration) -> Vec<kvferry::peer::Released> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let r = e.take_released();
        if !r.is_empty() || tokio::time::Instant::now() >= deadline {
            return r;
        }
        e.wait_released(deadline).await;
    }
}
