//! [`MissCache`]: keys recently found on no live peer, remembered for a short TTL so
//! that a burst of lookups for an absent key does not fan out to every peer each time.
//!
//! # Semantics
//!
//! Pure: every method takes `now`. A miss is remembered until `now >= recorded + ttl`;
//! the cache holds at most `capacity` keys (when full, expired entries are dropped
//! first, then the oldest). A key found later (e.g. after a peer joined) is cleared
//! with [`MissCache::clear`] — the engine clears the whole cache on any peer event.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use tokio::time::Instant;

use crate::wire::ChunkKey;

/// Recently missed keys.
pub struct MissCache {
    ttl: Duration,
    capacity: usize,
    entries: HashMap<ChunkKey, Instant>,
    order: VecDeque<(ChunkKey, Instant)>,
}

impl MissCache {
    /// A cache remembering misses for `ttl`, at most `capacity` of them.
    pub fn new(ttl: Duration, capacity: usize) -> MissCache {
        MissCache {
            ttl,
            capacity: capacity.max(1),
            entries: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    /// Whether `key` missed less than the TTL before `now`.
    pub fn is_miss(&self, key: &ChunkKey, now: Instant) -> bool {
        self.entries
            .get(key)
            .is_some_and(|t| now.saturating_duration_since(*t) < self.ttl)
    }

    /// Remembers that `key` missed at `now`.
    pub fn insert(&mut self, key: ChunkKey, now: Instant) {
        self.expire(now);
        while self.entries.len() >= self.capacity {
            match self.order.pop_front() {
                Some((k, t)) => {
                    if self.entries.get(&k) == Some(&t) {
                        self.entries.remove(&k);
                    }
                }
                None => break,
            }
        }
        self.entries.insert(key, now);
        self.order.push_back((key, now));
    }

    /// Forgets every miss.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.order.clear();
    }

    /// Keys remembered.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn expire(&mut self, now: Instant) {
        while let Some((k, t)) = self.order.front().copied() {
            if now.saturating_duration_since(t) < self.ttl {
                break;
            }
            self.order.pop_front();
            if self.entries.get(&k) == Some(&t) {
                self.entries.remove(&k);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn misses_expire_after_the_ttl() {
        let t0 = Instant::now();
        let mut c = MissCache::new(Duration::from_millis(500), 8);
        let k = ChunkKey::from_name("a");
        assert!(!c.is_miss(&k, t0));
        c.insert(k, t0);
        assert!(c.is_miss(&k, t0 + Duration::from_millis(499)));
        assert!(!c.is_miss(&k, t0 + Duration::from_millis(500)));
    }

    #[test]
    fn capacity_evicts_the_oldest() {
        let t0 = Instant::now();
        let mut c = MissCache::new(Duration::from_secs(10), 2);
        let (a, b, d) = (
            ChunkKey::from_name("a"),
            ChunkKey::from_name("b"),
            ChunkKey::from_name("d"),
        );
        c.insert(a, t0);
        c.insert(b, t0 + Duration::from_millis(1));
        c.insert(d, t0 + Duration::from_millis(2));
        assert_eq!(c.len(), 2);
        assert!(!c.is_miss(&a, t0 + Duration::from_millis(3)));
        assert!(c.is_miss(&b, t0 + Duration::from_millis(3)));
        assert!(c.is_miss(&d, t0 + Duration::from_millis(3)));
        c.clear();
        assert!(c.is_empty());
    }

    #[test]
    fn a_reinserted_key_is_not_evicted_by_its_old_entry() {
        let t0 = Instant::now();
        let mut c = MissCache::new(Duration::from_secs(1), 4);
        let a = ChunkKey::from_name("a");
        c.insert(a, t0);
        c.insert(a, t0 + Duration::from_millis(900));
        // The first entry expires at t0+1s; the second keeps the key a miss.
        c.insert(ChunkKey::from_name("x"), t0 + Duration::from_millis(1100));
        assert!(c.is_miss(&a, t0 + Duration::from_millis(1500)));
    }
}
