//! Fault injection on the consumer's side: a copy body that fails slices at a seeded
//! rate ([`FlakyBody`]), and staging arena hogs ([`hog`]). (The producers inject wire
//! corruption, slow sends and resets themselves; the command SIGKILLs them.)

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use kvferry::copy::{CopyBody, SliceWork};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::driver::Ctx;

/// The consumer's copy body: a memcpy that fails a slice at a given rate, half the
/// time after writing its bytes and half the time before.
pub struct FlakyBody {
    ppm: u64,
    injected: AtomicU64,
    rng: Mutex<StdRng>,
}

impl FlakyBody {
    /// Fails `ppm` slices per million.
    pub fn new(seed: u64, ppm: u64) -> FlakyBody {
        FlakyBody {
            ppm,
            injected: AtomicU64::new(0),
            rng: Mutex::new(StdRng::seed_from_u64(seed)),
        }
    }

    /// Slices failed so far.
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::Relaxed)
    }
}

impl CopyBody for FlakyBody {
    fn run(&self, work: &SliceWork<'_>) -> Result<(), String> {
        if self.ppm > 0 {
            let roll = self.rng.lock().unwrap().gen_range(0..1_000_000u64);
            if roll < self.ppm {
                self.injected.fetch_add(1, Ordering::Relaxed);
                if roll % 2 == 0 {
                    let _ = work.copy();
                }
                return Err("injected slice failure".into());
            }
        }
        work.copy()
    }
}

/// Holds most of the consumer's free staging pages for a while: transfers meanwhile
/// find the arena exhausted.
pub async fn hog(ctx: &Ctx, fraction: f64, hold: Duration) {
    let arena = ctx.consumer.arena();
    let n = (arena.stats().free_pages as f64 * fraction) as usize;
    if n == 0 {
        return;
    }
    if let Ok(lease) = arena.try_alloc(n) {
        ctx.ledger.fault("arena_hogs", 1);
        tokio::time::sleep(hold).await;
        drop(lease);
    }
}
