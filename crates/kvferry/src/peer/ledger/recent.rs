//! A bounded memory of recent events: the last `cap` items, each forgotten once it is
//! older than `window`. Used for leases that expired (a late pull answers "expired",
//! not "unknown") and keys whose publication was retired (a late `Release` answers
//! "released").
//!
//! # Cancellation
//!
//! Nothing here waits.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::time::Duration;

use tokio::time::Instant;

/// The last `cap` items noted within `window`.
#[derive(Debug)]
pub(crate) struct Recent<T: Copy + Eq + Hash> {
    cap: usize,
    window: Duration,
    /// In the order noted: the item and when.
    order: VecDeque<(T, Instant)>,
    /// Each item's latest note.
    latest: HashMap<T, Instant>,
}

impl<T: Copy + Eq + Hash> Recent<T> {
    /// Remembers at most `cap` items (at least 1) for at most `window`.
    pub(crate) fn new(cap: usize, window: Duration) -> Self {
        Recent {
            cap: cap.max(1),
            window,
            order: VecDeque::new(),
            latest: HashMap::new(),
        }
    }

    /// Notes `item` at `now`.
    pub(crate) fn note(&mut self, item: T, now: Instant) {
        self.order.push_back((item, now));
        self.latest.insert(item, now);
        while self.order.len() > self.cap {
            self.pop_front();
        }
    }

    /// True if `item` was noted within the window before `now` (and not pushed out).
    pub(crate) fn contains(&self, item: &T, now: Instant) -> bool {
        self.latest
            .get(item)
            .is_some_and(|at| now.saturating_duration_since(*at) <= self.window)
    }

    /// Forgets items older than the window.
    pub(crate) fn prune(&mut self, now: Instant) {
        while let Some((_, at)) = self.order.front() {
            if now.saturating_duration_since(*at) <= self.window {
                break;
            }
            self.pop_front();
        }
    }

    /// Items remembered now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.latest.len()
    }

    fn pop_front(&mut self) {
        if let Some((item, at)) = self.order.pop_front() {
            // Forget it only if this was its latest note.
            if self.latest.get(&item) == Some(&at) {
                self.latest.remove(&item);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_by_count_and_age() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut r = Recent::new(2, Duration::from_secs(10));
        r.note(1u32, t0);
        r.note(2, t0 + s);
        assert!(r.contains(&1, t0 + s) && r.contains(&2, t0 + s));
        r.note(3, t0 + 2 * s);
        assert!(!r.contains(&1, t0 + 2 * s), "pushed out by the cap");
        assert!(r.contains(&2, t0 + 11 * s) && !r.contains(&2, t0 + 12 * s), "aged out");
        // A second note of an item keeps it as long as its latest note.
        r.note(3, t0 + 5 * s);
        r.prune(t0 + 13 * s);
        assert!(r.contains(&3, t0 + 13 * s));
        assert_eq!(r.len(), 1);
        r.prune(t0 + 16 * s);
        assert_eq!(r.len(), 0);
    }
}
