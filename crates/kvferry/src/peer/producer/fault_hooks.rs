//! Fault injection for the producer's send path (chaos runs and tests): delays, slow
//! frames, connection resets and wire corruption, switched at run time through
//! [`ProducerFaults`]. The send path calls two hooks per bulk frame —
//! [`ProducerFaults::before_frame`] and [`ProducerFaults::corrupt_frame`] — and knows
//! nothing else about faults; with every switch at zero both are a few relaxed loads.
//!
//! # Cancellation
//!
//! `before_frame` only sleeps; dropping it mid-sleep injects nothing further.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::net::NetError;

/// Faults a producer can inject (for chaos and tests).
#[derive(Debug, Default)]
pub struct ProducerFaults {
    /// Corrupt one byte of the next N bulk frames sent (on the wire only; staged
    /// pages stay intact).
    pub corrupt_next_sends: AtomicU64,
    /// Delay before each bulk frame, in microseconds (a slow peer).
    pub send_delay_us: AtomicU64,
    /// Corrupt one byte of each bulk frame sent with this probability, in parts per
    /// million (on the wire only, as `corrupt_next_sends`).
    pub corrupt_ppm: AtomicU64,
    /// Delay a bulk frame by `slow_delay_us` with this probability, in parts per million.
    pub slow_ppm: AtomicU64,
    /// The delay of a frame picked by `slow_ppm`, in microseconds.
    pub slow_delay_us: AtomicU64,
    /// Drop the connection before a bulk frame with this probability, in parts per
    /// million (a connection reset in the middle of a transfer).
    pub reset_ppm: AtomicU64,
}

impl ProducerFaults {
    /// True with probability `ppm` parts per million; logs the fault when it fires.
    fn roll(ppm: &AtomicU64, what: &'static str) -> bool {
        let ppm = ppm.load(Ordering::Relaxed);
        let hit = ppm > 0 && rand::random::<u64>() % 1_000_000 < ppm;
        if hit {
            tracing::warn!(target: "kvferry::fault", "injected fault: {what}");
        }
        hit
    }

    /// Before each bulk frame to `peer`: the configured delay, a slow frame, or a
    /// reset (an error that ends the connection, as a reset does for the consumer;
    /// whatever the send holds is let go of as on any failed send).
    pub(crate) async fn before_frame(&self, peer: &(dyn std::fmt::Display + Sync)) -> Result<(), NetError> {
        let delay = self.send_delay_us.load(Ordering::Relaxed);
        if delay > 0 {
            tokio::time::sleep(Duration::from_micros(delay)).await;
        }
        if Self::roll(&self.slow_ppm, "slow send") {
            let us = self.slow_delay_us.load(Ordering::Relaxed);
            tokio::time::sleep(Duration::from_micros(us)).await;
        }
        if Self::roll(&self.reset_ppm, "connection reset") {
            return Err(NetError::Lost {
                peer: peer.to_string(),
                reason: "injected connection reset".into(),
            });
        }
        Ok(())
    }

    /// True if this frame is to be corrupted on the wire (counts down
    /// `corrupt_next_sends`, or rolls `corrupt_ppm`).
    pub(crate) fn corrupt_frame(&self) -> bool {
        self.corrupt_next_sends
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok()
            || Self::roll(&self.corrupt_ppm, "wire corruption")
    }
}

/// A copy of `parts` with one byte flipped (the frame checksum, computed over what is
/// sent, stays consistent; the staging checksum does not).
pub(crate) fn corrupted(parts: &[&[u8]]) -> Vec<u8> {
    let mut bad: Vec<u8> = parts.concat();
    let i = bad.len() / 2;
    if let Some(b) = bad.get_mut(i) {
        *b ^= 0x5A;
    }
    bad
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn corrupt_next_counts_down() {
        let f = ProducerFaults::default();
        assert!(!f.corrupt_frame());
        f.corrupt_next_sends.store(2, Ordering::SeqCst);
        assert!(f.corrupt_frame() && f.corrupt_frame() && !f.corrupt_frame());
        let bad = corrupted(&[b"ab", b"cd"]);
        assert_eq!(bad.len(), 4);
        assert_ne!(bad, b"abcd");
    }
}
