//! Requests held until a key arrives: `AwaitPublished`.
//!
//! A disaggregated prefill answers its client before it publishes the request's
//! blocks (vLLM publishes a step later), so a decode's get can reach the producer
//! first and miss. Retrying on a timer makes every such get cost the timer's interval
//! (the vLLM connector's 4, 8, 16, 32, 50 ms: a pull of one millisecond's bytes took
//! tens of milliseconds). Instead the consumer sends `AwaitPublished { key, wait_ms }`
//! and the producer answers the moment the key is published or put into its store —
//! [`Producer::note_arrival`] wakes every waiting request, which looks again — or
//! once the wait has passed. Nothing here polls: a waiting request sleeps on the
//! producer's `arrivals` notification and on its own deadline, nothing else.
//!
//! The wait is capped at [`MAX_AWAIT`] whatever the consumer asks, and holds no
//! staging, quota or get permit: only its connection, which the consumer chose to
//! spend on it.
//!
//! # Cancellation
//!
//! [`Producer::await_key`] holds a notification and a timer, nothing else: dropped
//! (its connection closed, the server stopped), it leaves nothing behind.

use std::time::Duration;

use tokio::time::Instant;

use super::Producer;
use crate::wire::ChunkKey;

/// The longest one `AwaitPublished` is held, whatever it asks (a consumer wanting
/// longer asks again).
const MAX_AWAIT: Duration = Duration::from_secs(10);

/// How an `AwaitPublished` ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Awaited {
    /// The key was there when asked, or arrived (woken by its publication or put).
    Here,
    /// The wait passed; `here`: whether the key is there after all (it arrived in the
    /// same instant). Counted as a miss either way: the request was ended by a timer.
    Passed { here: bool },
}

impl Awaited {
    /// What the reply says: whether the key is there now.
    pub(super) fn here(self) -> bool {
        matches!(self, Awaited::Here | Awaited::Passed { here: true })
    }
}

impl Producer {
    /// Whether `key` can be served now: published, or in the store.
    fn has_key(&self, key: &ChunkKey) -> bool {
        let published = !self
            .inner
            .ledger
            .lock()
            .lookup(std::slice::from_ref(key), Instant::now())
            .is_empty();
        published || self.inner.store.lookup(std::slice::from_ref(key)) > 0
    }

    /// Waits until `key` is published or stored, or `wait` (at most [`MAX_AWAIT`])
    /// passed without it. Woken by the arrival, never by a timer, except the one that
    /// ends the wait.
    pub(super) async fn await_key(&self, key: &ChunkKey, wait: Duration) -> Awaited {
        let until = Instant::now() + wait.min(MAX_AWAIT);
        loop {
            // Registered before the check: an arrival between the check and the
            // wait is not lost.
            let arrived = self.inner.arrivals.notified();
            tokio::pin!(arrived);
            arrived.as_mut().enable();
            if self.has_key(key) {
                return Awaited::Here;
            }
            if Instant::now() >= until {
                return Awaited::Passed { here: false };
            }
            tokio::select! {
                // An arrival and the end of the wait in the same instant: the arrival.
                biased;
                _ = arrived => {}
                _ = tokio::time::sleep_until(until) => return Awaited::Passed { here: self.has_key(key) },
                _ = self.inner.stop.cancelled() => return Awaited::Passed { here: self.has_key(key) },
            }
        }
    }

    /// A key was published or stored: every request waiting for a key looks again.
    pub(super) fn note_arrival(&self) {
        self.inner.arrivals.notify_waiters();
    }
}
