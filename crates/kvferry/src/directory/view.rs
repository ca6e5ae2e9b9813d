//! [`PeerView`]: a consumer's view of the live peers as a deterministic state machine —
//! list, then watch from the list's revision; a compacted watch or a lost connection
//! means list again; events are derived by comparing records; the view is stale while
//! the backend cannot confirm it.
//!
//! # Semantics
//!
//! The view is pure: no I/O and no clock. The backend's I/O edge feeds it what it saw
//! (a full list at a revision, a put or a delete at a revision, a compaction, a lost
//! or confirmed connection), each with the current time as an explicit `now`, and asks
//! [`PeerView::next_step`] what to do next: list, or watch from a revision. Unit tests
//! drive it with made-up instants and never sleep.
//!
//! - A record with an unknown id is [`PeerEvent::Joined`]; a known id with a new
//!   incarnation is [`PeerEvent::Restarted`]; a deleted id, or one missing from a new
//!   list, is [`PeerEvent::Lost`]. Same id and incarnation (e.g. a changed capability)
//!   updates the record silently.
//! - Changes at or below the revision already applied are ignored (a watch replaying
//!   what the list already showed changes nothing).
//! - The view is **stale** before the first list, from a disconnection until the next
//!   successful list or watch message, and when nothing confirmed it for longer than
//!   `stale_after`. A stale view still answers: peers known stay usable.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::time::Instant;

use super::record::{LivePeer, LivePeers, PeerEvent, PeerRecord};

/// What the I/O edge should do next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Read every record (and the revision it was read at).
    List,
    /// Watch for changes after `from - 1`, i.e. starting at revision `from`.
    Watch {
        /// First revision to report.
        from: i64,
    },
}

struct Entry {
    record: PeerRecord,
    since: Instant,
}

/// The view state machine.
pub struct PeerView {
    peers: BTreeMap<String, Entry>,
    /// Highest revision applied (0 before the first list).
    revision: i64,
    need_list: bool,
    connected: bool,
    last_confirmed: Option<Instant>,
    stale_after: Duration,
}

impl PeerView {
    /// An empty view (stale until listed) that goes stale when nothing confirmed it
    /// for `stale_after`.
    pub fn new(stale_after: Duration) -> PeerView {
        PeerView {
            peers: BTreeMap::new(),
            revision: 0,
            need_list: true,
            connected: false,
            last_confirmed: None,
            stale_after,
        }
    }

    /// What to do next.
    pub fn next_step(&self) -> Step {
        if self.need_list {
            Step::List
        } else {
            Step::Watch {
                from: self.revision + 1,
            }
        }
    }

    /// The revision applied so far.
    pub fn revision(&self) -> i64 {
        self.revision
    }

    /// A full list read at `revision`: replaces the view, and returns what changed.
    pub fn listed(&mut self, records: Vec<PeerRecord>, revision: i64, now: Instant) -> Vec<PeerEvent> {
        let mut events = Vec::new();
        let mut fresh: BTreeMap<String, PeerRecord> = records.into_iter().map(|r| (r.peer_id.clone(), r)).collect();
        let known: Vec<String> = self.peers.keys().cloned().collect();
        for id in known {
            if !fresh.contains_key(&id) {
                if let Some(e) = self.peers.remove(&id) {
                    events.push(PeerEvent::Lost(e.record));
                }
            }
        }
        for (_, r) in std::mem::take(&mut fresh) {
            events.extend(self.upsert(r, now));
        }
        self.revision = self.revision.max(revision);
        self.need_list = false;
        self.confirmed(now);
        events
    }

    /// A put seen by the watch at `revision`.
    pub fn put(&mut self, record: PeerRecord, revision: i64, now: Instant) -> Vec<PeerEvent> {
        self.confirmed(now);
        if revision <= self.revision {
            return Vec::new();
        }
        self.revision = revision;
        self.upsert(record, now).into_iter().collect()
    }

    /// A delete of `peer_id` seen by the watch at `revision`.
    pub fn deleted(&mut self, peer_id: &str, revision: i64, now: Instant) -> Vec<PeerEvent> {
        self.confirmed(now);
        if revision <= self.revision {
            return Vec::new();
        }
        self.revision = revision;
        self.peers
            .remove(peer_id)
            .map(|e| PeerEvent::Lost(e.record))
            .into_iter()
            .collect()
    }

    /// The watch was told its start revision is compacted: list again.
    pub fn compacted(&mut self) {
        self.need_list = true;
    }

    /// The backend answered (a list, a watch message, a health check): the view is
    /// confirmed as of `now`.
    pub fn confirmed(&mut self, now: Instant) {
        self.connected = true;
        self.last_confirmed = Some(now);
    }

    /// The backend could not be reached: the view is stale until it answers again.
    /// The watch resumes from the last revision (a compaction meanwhile means a list).
    pub fn disconnected(&mut self) {
        self.connected = false;
    }

    /// Whether the view cannot be confirmed at `now`.
    pub fn is_stale(&self, now: Instant) -> bool {
        match self.last_confirmed {
            None => true,
            Some(t) => !self.connected || self.need_list || now.saturating_duration_since(t) > self.stale_after,
        }
    }

    /// The address of `peer_id`, if known.
    pub fn resolve(&self, peer_id: &str) -> Option<String> {
        self.peers.get(peer_id).map(|e| e.record.address.clone())
    }

    /// The record of `peer_id`, if known.
    pub fn record(&self, peer_id: &str) -> Option<&PeerRecord> {
        self.peers.get(peer_id).map(|e| &e.record)
    }

    /// The live peers at `now`, by id.
    pub fn snapshot(&self, now: Instant) -> LivePeers {
        LivePeers {
            peers: self
                .peers
                .values()
                .map(|e| LivePeer {
                    record: e.record.clone(),
                    known_for: now.saturating_duration_since(e.since),
                })
                .collect(),
            stale: self.is_stale(now),
        }
    }

    fn upsert(&mut self, record: PeerRecord, now: Instant) -> Option<PeerEvent> {
        let id = record.peer_id.clone();
        match self.peers.get_mut(&id) {
            None => {
                self.peers.insert(
                    id,
                    Entry {
                        record: record.clone(),
                        since: now,
                    },
                );
                Some(PeerEvent::Joined(record))
            }
            Some(e) if e.record.incarnation != record.incarnation => {
                let old = std::mem::replace(&mut e.record, record.clone());
                e.since = now;
                Some(PeerEvent::Restarted { old, new: record })
            }
            Some(e) => {
                e.record = record;
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record with a fixed registration time (so that two built apart compare equal).
    fn rec(id: &str, inc: u64) -> PeerRecord {
        PeerRecord {
            registered_unix_ms: 1,
            ..PeerRecord::new(id, format!("127.0.0.1:{}", 7000 + inc), inc)
        }
    }

    const STALE: Duration = Duration::from_secs(5);

    #[test]
    fn list_then_watch_from_the_next_revision() {
        let t0 = Instant::now();
        let mut v = PeerView::new(STALE);
        assert_eq!(v.next_step(), Step::List);
        assert!(v.is_stale(t0), "stale before the first list");
        let ev = v.listed(vec![rec("a", 1), rec("b", 2)], 10, t0);
        assert_eq!(ev, vec![PeerEvent::Joined(rec("a", 1)), PeerEvent::Joined(rec("b", 2))]);
        assert_eq!(v.next_step(), Step::Watch { from: 11 });
        assert!(!v.is_stale(t0));
        assert_eq!(v.resolve("a").as_deref(), Some("127.0.0.1:7001"));
    }

    #[test]
    fn events_are_derived_from_incarnations() {
        let t0 = Instant::now();
        let mut v = PeerView::new(STALE);
        v.listed(vec![rec("a", 1)], 5, t0);
        // Same incarnation, new capability: silent update.
        let mut a = rec("a", 1);
        a.capabilities.push("direct".into());
        assert!(v.put(a.clone(), 6, t0).is_empty());
        assert_eq!(v.record("a").unwrap().capabilities, vec!["direct".to_string()]);
        // New incarnation: restarted, with the old record.
        let ev = v.put(rec("a", 3), 7, t0);
        assert_eq!(
            ev,
            vec![PeerEvent::Restarted {
                old: a,
                new: rec("a", 3)
            }]
        );
        // New id: joined; delete: lost; delete of an unknown id: nothing.
        assert_eq!(v.put(rec("c", 4), 8, t0), vec![PeerEvent::Joined(rec("c", 4))]);
        assert_eq!(v.deleted("c", 9, t0), vec![PeerEvent::Lost(rec("c", 4))]);
        assert!(v.deleted("zz", 10, t0).is_empty());
        assert_eq!(v.next_step(), Step::Watch { from: 11 });
    }

    #[test]
    fn replayed_revisions_change_nothing() {
        let t0 = Instant::now();
        let mut v = PeerView::new(STALE);
        v.listed(vec![rec("a", 1)], 10, t0);
        assert!(v.deleted("a", 9, t0).is_empty(), "older than the list");
        assert!(v.put(rec("a", 2), 10, t0).is_empty(), "at the list's revision");
        assert_eq!(v.record("a").unwrap().incarnation, 1);
    }

    #[test]
    fn compaction_relists_and_the_relist_derives_what_was_missed() {
        let t0 = Instant::now();
        let mut v = PeerView::new(STALE);
        v.listed(vec![rec("a", 1), rec("b", 2)], 10, t0);
        v.compacted();
        assert_eq!(v.next_step(), Step::List);
        assert!(v.is_stale(t0), "stale until listed again");
        // While compacted: b died, a restarted, c joined.
        let ev = v.listed(vec![rec("a", 5), rec("c", 6)], 40, t0);
        assert_eq!(
            ev,
            vec![
                PeerEvent::Lost(rec("b", 2)),
                PeerEvent::Restarted {
                    old: rec("a", 1),
                    new: rec("a", 5)
                },
                PeerEvent::Joined(rec("c", 6)),
            ]
        );
        assert_eq!(v.next_step(), Step::Watch { from: 41 });
    }

    #[test]
    fn disconnection_keeps_the_peers_and_flags_the_view_stale() {
        let t0 = Instant::now();
        let mut v = PeerView::new(STALE);
        v.listed(vec![rec("a", 1)], 10, t0);
        v.disconnected();
        let t1 = t0 + Duration::from_secs(1);
        let snap = v.snapshot(t1);
        assert!(snap.stale);
        assert_eq!(snap.peers.len(), 1, "known peers stay usable");
        assert_eq!(v.next_step(), Step::Watch { from: 11 }, "resume from the last revision");
        v.confirmed(t1);
        assert!(!v.is_stale(t1));
    }

    #[test]
    fn silence_longer_than_stale_after_is_stale() {
        let t0 = Instant::now();
        let mut v = PeerView::new(STALE);
        v.listed(vec![], 1, t0);
        assert!(!v.is_stale(t0 + STALE));
        assert!(v.is_stale(t0 + STALE + Duration::from_millis(1)));
        v.confirmed(t0 + STALE * 2);
        assert!(!v.is_stale(t0 + STALE * 2));
    }

    #[test]
    fn known_for_counts_from_this_incarnation() {
        let t0 = Instant::now();
        let mut v = PeerView::new(STALE);
        v.listed(vec![rec("a", 1)], 1, t0);
        let t1 = t0 + Duration::from_secs(3);
        v.put(rec("a", 2), 2, t1);
        let t2 = t1 + Duration::from_secs(2);
        assert_eq!(v.snapshot(t2).peers[0].known_for, Duration::from_secs(2));
    }
}
