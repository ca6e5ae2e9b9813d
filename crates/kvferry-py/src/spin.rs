//! Spin-then-sleep waiting with an adaptive spin budget.
//!
//! A thread that sleeps on a condition variable and is woken by another pays the
//! wake-up: tens of microseconds on an idle machine, more on a virtual machine whose
//! idle CPUs halt. For a wait that ends within that time (a `get_blocking` that misses,
//! a small chunk) the wake-up is most of the cost. A waiter therefore first polls for
//! its outcome for a *spin budget*, yielding its CPU between polls, and sleeps only if
//! the outcome has not come.
//!
//! Polling burns CPU that transfers need when waits are long (a 2.5 MiB chunk takes a
//! millisecond), so the budget adapts per engine, as the kernel's haltpoll governor
//! adapts its poll window: every transfer reports how long it took, from its start to
//! its outcome (whoever waits for it, and however: `wait`, `await`, polling `done()`);
//! one at most `max` long grows the budget (doubling, from `max / 8`, up to `max`),
//! since spinning that long would catch it; a longer one halves it (below `max / 8`
//! it drops to zero: no spinning until short transfers come back).
//!
//! The policy is a small state machine over durations handed in (no clock of its
//! own), so it is tested deterministically.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// An engine's spin budget, shared by every thread waiting on its transfers.
#[derive(Debug)]
pub struct AdaptiveSpin {
    max_ns: u64,
    budget_ns: AtomicU64,
}

impl AdaptiveSpin {
    /// A budget of at most `max` (zero: never spin), starting at `max`.
    pub fn new(max: Duration) -> AdaptiveSpin {
        let max_ns = max.as_nanos().min(u64::MAX as u128) as u64;
        AdaptiveSpin {
            max_ns,
            budget_ns: AtomicU64::new(max_ns),
        }
    }

    /// How long the next wait spins before it sleeps.
    pub fn budget(&self) -> Duration {
        Duration::from_nanos(self.budget_ns.load(Ordering::Relaxed))
    }

    /// The bound the budget grows to.
    pub fn max(&self) -> Duration {
        Duration::from_nanos(self.max_ns)
    }

    /// Records a transfer that took `waited` from its start to its outcome.
    pub fn record(&self, waited: Duration) {
        if self.max_ns == 0 {
            return;
        }
        let start = (self.max_ns / 8).max(1);
        let waited = waited.as_nanos().min(u64::MAX as u128) as u64;
        // Racing waiters may each apply their step; any interleaving keeps the budget
        // within 0..=max.
        let _ = self.budget_ns.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
            Some(if waited <= self.max_ns {
                b.saturating_mul(2).max(start).min(self.max_ns)
            } else if b / 2 < start {
                0
            } else {
                b / 2
            })
        });
    }
}

/// Polls `flag` for up to `budget`; true once it is set. Between short runs of
/// spin-loop hints it yields the CPU, so a runnable thread (a copy, the engine's
/// runtime) is never kept waiting by the spinner for long.
pub fn spin_until(flag: &AtomicBool, budget: Duration) -> bool {
    let start = Instant::now();
    let mut polls = 0u32;
    loop {
        if flag.load(Ordering::Acquire) {
            return true;
        }
        polls = polls.wrapping_add(1);
        if polls.is_multiple_of(32) {
            if start.elapsed() >= budget {
                return false;
            }
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn long_waits_shrink_the_budget_to_zero_and_short_ones_grow_it_back_to_max() {
        let s = AdaptiveSpin::new(200 * US);
        assert_eq!(s.budget(), 200 * US, "starts at max");
        s.record(150 * US);
        assert_eq!(s.budget(), 200 * US, "a short wait keeps it at max");
        s.record(1000 * US);
        assert_eq!(s.budget(), 100 * US);
        s.record(1000 * US);
        assert_eq!(s.budget(), 50 * US);
        s.record(1000 * US);
        assert_eq!(s.budget(), 25 * US, "max / 8 is the smallest non-zero budget");
        s.record(1000 * US);
        assert_eq!(s.budget(), Duration::ZERO, "below max / 8: no spinning");
        s.record(1000 * US);
        assert_eq!(s.budget(), Duration::ZERO);
        s.record(120 * US);
        assert_eq!(
            s.budget(),
            25 * US,
            "a wait spinning would have caught restarts at max / 8"
        );
        s.record(200 * US);
        assert_eq!(s.budget(), 50 * US);
        s.record(10 * US);
        s.record(10 * US);
        assert_eq!(s.budget(), 200 * US);
        s.record(10 * US);
        assert_eq!(s.budget(), 200 * US, "never above max");
    }

    #[test]
    fn a_zero_max_never_spins() {
        let s = AdaptiveSpin::new(Duration::ZERO);
        s.record(US);
        assert_eq!(s.budget(), Duration::ZERO);
    }

    #[test]
    fn spinning_sees_a_flag_set_by_another_thread_and_gives_up_after_its_budget() {
        let flag = std::sync::Arc::new(AtomicBool::new(false));
        let t0 = Instant::now();
        assert!(!spin_until(&flag, 2 * Duration::from_millis(1)));
        assert!(t0.elapsed() >= Duration::from_millis(2));
        let f2 = flag.clone();
        let setter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(1));
            f2.store(true, Ordering::Release);
        });
        assert!(
            spin_until(&flag, Duration::from_secs(10)),
            "seen long before the budget ran out"
        );
        setter.join().unwrap();
    }
}
