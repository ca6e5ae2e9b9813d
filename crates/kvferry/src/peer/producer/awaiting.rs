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
pub const MAX_AWAIT: Duration = Duration::from_secs(10);

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

    /// Waits until `key` is published or stored (true), or `wait` (at most
    /// [`MAX_AWAIT`]) passed without it (false). Woken by the arrival, never by a
    /// timer, except the one that ends the wait.
    pub(super) async fn await_key(&self, key: &ChunkKey, wait: Duration) -> bool {
        let until = Instant::now() + wait.min(MAX_AWAIT);
        loop {
            // Registered before the check: an arrival between the check and the
            // wait is not lost.
            let arrived = self.inner.arrivals.notified();
            tokio::pin!(arrived);
            arrived.as_mut().enable();
            if self.has_key(key) {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            tokio::select! {
                _ = arrived => {}
                _ = tokio::time::sleep_until(until) => return self.has_key(key),
                _ = self.inner.stop.cancelled() => return self.has_key(key),
            }
        }
    }

    /// A key was published or stored: every request waiting for a key looks again.
    pub(super) fn note_arrival(&self) {
        self.inner.arrivals.notify_waiters();
    }
}
