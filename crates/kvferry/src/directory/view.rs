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
//! - Every change of a revision is applied: one etcd revision may carry many changes
//!   (a transaction with several puts, a range delete such as `etcdctl del --prefix`),
//!   and they all share that revision. A change *below* the revision already applied
//!   is ignored (the view already reflects it); a change *at* it is applied, which is
//!   harmless when it was applied already: within one revision each key changes at
//!   most once (etcd refuses a transaction touching a key twice), so the state at a
//!   revision already contains each of its changes and re-applying one is a no-op.
//!   That also keeps a revision whose changes arrive split over several watch
//!   messages (or over a reconnect that resumes at [`PeerView::next_step`]) whole.
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
    /// Watch for changes starting at revision `from` (the revision applied: a
    /// revision whose changes arrived only in part is read again, whole).
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
            Step::Watch { from: self.revision }
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

    /// A put seen by the watch at `revision` (ignored below the revision applied).
    pub fn put(&mut self, record: PeerRecord, revision: i64, now: Instant) -> Vec<PeerEvent> {
        self.confirmed(now);
        if revision < self.revision {
            return Vec::new();
        }
        self.revision = revision;
        self.upsert(record, now).into_iter().collect()
    }

    /// A delete of `peer_id` seen by the watch at `revision` (ignored below the
    /// revision applied).
    pub fn deleted(&mut self, peer_id: &str, revision: i64, now: Instant) -> Vec<PeerEvent> {
        self.confirmed(now);
        if revision < self.revision {
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
        assert_eq!(v.next_step(), Step::Watch { from: 10 });
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
        assert_eq!(v.next_step(), Step::Watch { from: 10 });
    }

    #[test]
    fn replayed_revisions_change_nothing() {
        let t0 = Instant::now();
        let mut v = PeerView::new(STALE);
        v.listed(vec![rec("a", 1)], 10, t0);
        assert!(v.deleted("a", 9, t0).is_empty(), "older than the list");
        assert!(v.put(rec("a", 2), 9, t0).is_empty(), "older than the list");
        // The change that made the listed state, replayed at the list's revision.
        assert!(v.put(rec("a", 1), 10, t0).is_empty(), "at the list's revision");
        assert_eq!(v.record("a").unwrap().incarnation, 1);
    }

    #[test]
    fn every_change_of_one_revision_is_applied() {
        let t0 = Instant::now();
        let mut v = PeerView::new(STALE);
        let all: Vec<PeerRecord> = (0..20).map(|i| rec(&format!("p{i}"), i + 1)).collect();
        v.listed(all.clone(), 10, t0);
        // One range delete: twenty deletes, all at revision 11.
        let lost: Vec<PeerEvent> = all.iter().flat_map(|r| v.deleted(&r.peer_id, 11, t0)).collect();
        assert_eq!(lost.len(), 20, "{lost:?}");
        assert!(v.snapshot(t0).peers.is_empty());
        // One transaction with five puts: all at revision 12.
        let joined: Vec<PeerEvent> = (0..5)
            .flat_map(|i| v.put(rec(&format!("q{i}"), 50 + i), 12, t0))
            .collect();
        assert_eq!(joined.len(), 5, "{joined:?}");
        assert_eq!(v.snapshot(t0).peers.len(), 5);
        // A revision split over a reconnect: the watch resumes at it, and the part
        // already applied changes nothing the second time.
        assert_eq!(v.next_step(), Step::Watch { from: 12 });
        assert!(v.put(rec("q0", 50), 12, t0).is_empty());
        assert_eq!(v.snapshot(t0).peers.len(), 5);
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
        assert_eq!(v.next_step(), Step::Watch { from: 40 });
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
        assert_eq!(v.next_step(), Step::Watch { from: 10 }, "resume at the last revision");
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

    /// The view against a model of etcd: random single puts and deletes, transactions,
    /// range deletes, compactions, disconnections and relists, with the watch's
    /// messages cut at random points (a revision may be split over two messages or a
    /// reconnect). Whenever everything was delivered, the view equals a fresh list, and
    /// the events it emitted, applied to a mirror, give the same peers.
    mod model {
        use super::*;
        use proptest::prelude::*;
        use std::collections::BTreeMap;

        const KEYS: usize = 6;

        #[derive(Clone, Debug)]
        enum Op {
            Put(usize, u64),
            Delete(usize),
            /// Distinct keys: `Some(incarnation)` puts, `None` deletes.
            Txn(Vec<(usize, Option<u64>)>),
            /// Deletes every key at index `from` or above (`0`: the whole prefix).
            DeleteRange(usize),
            Compact,
            Disconnect,
            /// Delivers up to this many pending changes.
            Deliver(usize),
            /// Delivers everything pending, then compares.
            Sync,
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                4 => (0..KEYS, 1u64..4).prop_map(|(k, i)| Op::Put(k, i)),
                2 => (0..KEYS).prop_map(Op::Delete),
                2 => proptest::collection::btree_map(0..KEYS, proptest::option::of(1u64..4), 1..KEYS)
                    .prop_map(|m| Op::Txn(m.into_iter().collect())),
                1 => (0..3usize).prop_map(Op::DeleteRange),
                1 => Just(Op::Compact),
                1 => Just(Op::Disconnect),
                3 => (1..8usize).prop_map(Op::Deliver),
                1 => Just(Op::Sync),
            ]
        }

        fn key(k: usize) -> String {
            format!("p{k}")
        }

        /// What etcd holds and every change it made, by revision.
        struct Etcd {
            state: BTreeMap<String, PeerRecord>,
            revision: i64,
            compacted: i64,
            log: Vec<(i64, String, Option<PeerRecord>)>,
        }

        impl Etcd {
            /// One revision with these changes (none that change nothing: etcd makes no
            /// revision for a delete of nothing).
            fn commit(&mut self, changes: Vec<(String, Option<PeerRecord>)>) {
                let changes: Vec<_> = changes
                    .into_iter()
                    .filter(|(k, v)| v.is_some() || self.state.contains_key(k))
                    .collect();
                if changes.is_empty() {
                    return;
                }
                self.revision += 1;
                for (k, v) in changes {
                    match &v {
                        Some(r) => self.state.insert(k.clone(), r.clone()),
                        None => self.state.remove(&k),
                    };
                    self.log.push((self.revision, k, v));
                }
            }
        }

        /// The watch the view's edge holds: the next change of the log to deliver.
        struct Edge {
            cursor: Option<usize>,
        }

        fn deliver(v: &mut PeerView, e: &Etcd, edge: &mut Edge, mut n: usize, now: Instant, out: &mut Vec<PeerEvent>) {
            while n > 0 {
                let pos = match (edge.cursor, v.next_step()) {
                    (Some(p), _) => p,
                    (None, Step::List) => {
                        out.extend(v.listed(e.state.values().cloned().collect(), e.revision, now));
                        edge.cursor = Some(e.log.len());
                        continue;
                    }
                    (None, Step::Watch { from }) => {
                        if from < e.compacted {
                            v.compacted();
                            continue;
                        }
                        let p = e.log.iter().position(|(r, _, _)| *r >= from).unwrap_or(e.log.len());
                        edge.cursor = Some(p);
                        p
                    }
                };
                let Some((rev, k, val)) = e.log.get(pos) else { return };
                out.extend(match val {
                    Some(r) => v.put(r.clone(), *rev, now),
                    None => v.deleted(k, *rev, now),
                });
                edge.cursor = Some(pos + 1);
                n -= 1;
            }
        }

        fn apply_events(mirror: &mut BTreeMap<String, PeerRecord>, events: &[PeerEvent]) {
            for ev in events {
                match ev {
                    PeerEvent::Joined(r) => {
                        assert!(
                            mirror.insert(r.peer_id.clone(), r.clone()).is_none(),
                            "joined twice: {ev:?}"
                        );
                    }
                    PeerEvent::Restarted { old, new } => {
                        let was = mirror.insert(new.peer_id.clone(), new.clone());
                        assert_eq!(was.as_ref().map(|r| r.incarnation), Some(old.incarnation), "{ev:?}");
                        assert_ne!(old.incarnation, new.incarnation, "{ev:?}");
                    }
                    PeerEvent::Lost(r) => {
                        assert!(mirror.remove(&r.peer_id).is_some(), "lost an unknown peer: {ev:?}");
                    }
                }
            }
        }

        fn check(v: &PeerView, e: &Etcd, mirror: &BTreeMap<String, PeerRecord>, now: Instant) {
            let seen: BTreeMap<String, PeerRecord> = v
                .snapshot(now)
                .peers
                .into_iter()
                .map(|p| (p.record.peer_id.clone(), p.record))
                .collect();
            assert_eq!(seen, e.state, "the view differs from a fresh list");
            // Incarnations only: a same-incarnation update is silent by design.
            let inc = |m: &BTreeMap<String, PeerRecord>| {
                m.iter().map(|(k, r)| (k.clone(), r.incarnation)).collect::<Vec<_>>()
            };
            assert_eq!(
                inc(mirror),
                inc(&e.state),
                "the events emitted do not add up to the view"
            );
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(256))]
            #[test]
            fn the_view_equals_a_fresh_list(ops in proptest::collection::vec(op(), 1..80)) {
                let now = Instant::now();
                let mut v = PeerView::new(STALE);
                let mut e = Etcd { state: BTreeMap::new(), revision: 1, compacted: 0, log: Vec::new() };
                let mut edge = Edge { cursor: None };
                let mut events = Vec::new();
                let mut mirror = BTreeMap::new();
                for op in ops.into_iter().chain([Op::Sync]) {
                    match op {
                        // A record's capabilities change with the put, so that a silent
                        // same-incarnation update is checked too.
                        Op::Put(k, i) => {
                            let mut r = rec(&key(k), i);
                            r.capabilities = vec![format!("r{}", e.revision + 1)];
                            e.commit(vec![(key(k), Some(r))]);
                        }
                        Op::Delete(k) => e.commit(vec![(key(k), None)]),
                        Op::Txn(ch) => e.commit(
                            ch.into_iter()
                                .map(|(k, i)| (key(k), i.map(|i| rec(&key(k), i))))
                                .collect(),
                        ),
                        Op::DeleteRange(from) => {
                            let doomed = (from..KEYS).map(|k| (key(k), None)).collect();
                            e.commit(doomed);
                        }
                        // A new watch from below this revision is refused (a watch already
                        // running keeps going, as in etcd).
                        Op::Compact => e.compacted = e.revision,
                        Op::Disconnect => {
                            v.disconnected();
                            edge.cursor = None;
                        }
                        Op::Deliver(n) => deliver(&mut v, &e, &mut edge, n, now, &mut events),
                        Op::Sync => {
                            deliver(&mut v, &e, &mut edge, usize::MAX, now, &mut events);
                            apply_events(&mut mirror, &std::mem::take(&mut events));
                            check(&v, &e, &mirror, now);
                        }
                    }
                }
            }
        }
    }
}
