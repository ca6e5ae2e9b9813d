//! Lingering: one worker of a runtime keeps polling for I/O, instead of sleeping, for a
//! short window after a transfer starts.
//!
//! A request/response round trip wakes the engine's runtime threads twice or more: the
//! server to read the request, the client to read the answer. A thread asleep in
//! `epoll_wait` on an idle CPU pays the CPU's wake-up for each (tens of microseconds,
//! more on a virtual machine whose idle CPUs halt), which is most of the cost of a
//! small or missing get. While a [`Linger`] window is open, one task of the runtime
//! loops on `yield_now`: tokio polls its I/O driver without blocking before it
//! resumes a yielded task, so readiness is picked up as it happens, and the worker
//! running the loop never sleeps. Other tasks run between the yields.
//!
//! A Python engine opens the window only while its transfers are short (the adaptive
//! spin budget of [`crate::spin`] is non-zero), so throughput runs, whose transfers
//! are long, do not pay for a spinning worker. The window is bounded: at most the engine's
//! `wait_spin_us` after the last transfer started.
//!
//! # Cancellation
//!
//! The lingering task runs until its runtime shuts down; it is dropped at an await
//! point like any task.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::runtime::Handle;
use tokio::sync::Notify;

/// One runtime's lingering window.
#[derive(Debug)]
pub struct Linger {
    base: Instant,
    /// Nanoseconds after `base` until which the task keeps polling.
    until_ns: AtomicU64,
    /// Wakes the task when a window opens while it sleeps.
    wake: Notify,
    /// Polls made (yields), for tests and stats.
    polls: AtomicU64,
}

impl Linger {
    /// Starts the lingering task on `runtime` (asleep until the first [`poke`](Self::poke)).
    pub fn start(runtime: &Handle) -> Arc<Linger> {
        let l = Arc::new(Linger {
            base: Instant::now(),
            until_ns: AtomicU64::new(0),
            wake: Notify::new(),
            polls: AtomicU64::new(0),
        });
        runtime.spawn(run(l.clone()));
        l
    }

    fn now_ns(&self) -> u64 {
        self.base.elapsed().as_nanos().min(u64::MAX as u128) as u64
    }

    /// Keeps a worker polling until `window` from now (or later, if another window
    /// already reaches further).
    pub fn poke(&self, window: Duration) {
        let now = self.now_ns();
        let until = now.saturating_add(window.as_nanos().min(u64::MAX as u128) as u64);
        let before = self.until_ns.fetch_max(until, Ordering::AcqRel);
        // The task may have seen the old window close (or never opened one) and gone
        // to sleep: wake it. If the old window is still open it is polling and sees the
        // new end itself (it reads `until_ns` after every poll).
        if before <= now {
            self.wake.notify_one();
        }
    }

    /// Polls made so far.
    pub fn polls(&self) -> u64 {
        self.polls.load(Ordering::Relaxed)
    }
}

async fn run(l: Arc<Linger>) {
    loop {
        l.wake.notified().await;
        while l.now_ns() < l.until_ns.load(Ordering::Acquire) {
            let n = l.polls.fetch_add(1, Ordering::Relaxed);
            // Now and then give the CPU to any other runnable thread (a copy thread,
            // a sibling worker just woken): this worker is not meant to starve them.
            if n % 8 == 7 {
                std::thread::yield_now();
            }
            tokio::task::yield_now().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poke_keeps_a_worker_polling_for_its_window_then_it_sleeps() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let l = Linger::start(rt.handle());
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(l.polls(), 0, "asleep until poked");
        l.poke(Duration::from_millis(30));
        std::thread::sleep(Duration::from_millis(10));
        let during = l.polls();
        assert!(during > 0, "polling inside the window");
        // Other tasks still run on the (only) worker while it lingers.
        assert_eq!(rt.block_on(async { tokio::spawn(async { 7 }).await.unwrap() }), 7);
        std::thread::sleep(Duration::from_millis(60));
        let after = l.polls();
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(l.polls(), after, "asleep again once the window closed");
        l.poke(Duration::from_millis(5));
        std::thread::sleep(Duration::from_millis(20));
        assert!(l.polls() > after, "a later poke opens a new window");
    }
}
