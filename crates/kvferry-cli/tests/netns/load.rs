//! The transfer load of the chaos runs: a client loop that puts a chunk of random size
//! to a random server and gets it back from there, verifying every landed byte and
//! timing every call against its deadline, and the tally of what happened.
//!
//! # Cancellation
//! The loop blocks its thread; it checks its stop flag between transfers, and each
//! transfer is bounded by its deadline, so stopping takes at most one transfer.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvferry::peer::PeerError;
use rand::{Rng, SeedableRng};

use super::client::{pattern, NsClient};

/// The deadline of every transfer in the load.
pub const DEADLINE: Duration = Duration::from_secs(2);
/// How far past its deadline a call may return before it counts as late.
pub const SLACK: Duration = Duration::from_millis(1500);

/// Counts of one run.
#[derive(Default, Debug)]
pub struct Tally {
    /// Transfers started (a put, then a get).
    pub attempts: AtomicU64,
    /// Gets that landed the exact bytes put.
    pub landed: AtomicU64,
    /// Gets that missed (the server restarted between put and get).
    pub misses: AtomicU64,
    /// Puts or gets that failed with a typed error.
    pub errors: AtomicU64,
    /// Gets that landed bytes other than those put.
    pub corrupted: AtomicU64,
    /// Calls that returned past their deadline plus [`SLACK`].
    pub late: AtomicU64,
}

impl Tally {
    /// One counter's value.
    pub fn get(a: &AtomicU64) -> u64 {
        a.load(Ordering::Relaxed)
    }

    /// A one-line summary.
    pub fn summary(&self) -> String {
        let g = Tally::get;
        format!(
            "{} transfers, {} landed and verified, {} misses after restarts, {} typed errors, {} corrupted, {} late",
            g(&self.attempts),
            g(&self.landed),
            g(&self.misses),
            g(&self.errors),
            g(&self.corrupted),
            g(&self.late)
        )
    }
}

/// One client's loop: put a chunk to a random server, get it back (from the same
/// server), verify, until `stop`.
pub fn client_loop(c: &NsClient, name: &str, servers: &[String], seed: u64, stop: &AtomicBool, tally: &Tally) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let addr = &servers[rng.gen_range(0..servers.len())];
        let len = rng.gen_range(1_000..400_000usize);
        let key = format!("{name}-{n}-{len}");
        let data = pattern(&key, len);
        tally.attempts.fetch_add(1, Ordering::Relaxed);
        let t = Instant::now();
        let put = c.put(addr, &key, &data, DEADLINE);
        note_time(tally, t, &key, "put");
        if let Err(e) = put {
            check_typed(&e, &key);
            tally.errors.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let t = Instant::now();
        let got = c.get(addr, &key, DEADLINE);
        note_time(tally, t, &key, "get");
        match got {
            Ok(Some(bytes)) if bytes == data => {
                tally.landed.fetch_add(1, Ordering::Relaxed);
            }
            Ok(Some(bytes)) => {
                eprintln!("CORRUPTED {key}: {} bytes landed, {} expected", bytes.len(), data.len());
                tally.corrupted.fetch_add(1, Ordering::Relaxed);
            }
            // The server was restarted between the put and the get.
            Ok(None) => {
                tally.misses.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                check_typed(&e, &key);
                tally.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

fn note_time(tally: &Tally, t: Instant, key: &str, op: &str) {
    let took = t.elapsed();
    if took > DEADLINE + SLACK {
        eprintln!("LATE {op} {key}: returned after {took:?}, deadline {DEADLINE:?}");
        tally.late.fetch_add(1, Ordering::Relaxed);
    }
}

fn check_typed(e: &PeerError, key: &str) {
    assert!(
        !matches!(e, PeerError::InvalidArgument(_)),
        "{key}: a fault surfaced as an invalid argument: {e}"
    );
}
