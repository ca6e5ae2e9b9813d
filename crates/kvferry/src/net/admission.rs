//! Admission before authentication: which connection gets one of the server's
//! handshaking places, and which is closed to make room. No I/O: every method takes
//! `now`, and closing a connection is cancelling the token it was admitted with; the
//! server ([`super::server`]) does the waiting, counting and logging.
//!
//! # Sources and classes
//!
//! A connection is charged to its *source*: its IPv4 address, or its IPv6 /64 (one host
//! usually owns a whole /64) ([`source_of`]). Its *class*, fixed when it takes a place,
//! orders who is closed first (lowest first):
//!
//! - *suspect*: its source failed authentication `auth_failure_limit` times within the
//!   window ([`AuthLimiter`]);
//! - *stranger*: any other;
//! - *proven*: its source completed a handshake within [`PROVEN_MEMORY`] **and** no
//!   other handshaking connection of that source holds the proven rank. Whatever else
//!   shares a proven address (a NAT, a host, a stranger beside an honest client) takes
//!   places as a stranger: an address's past success buys one place's priority, never
//!   the address's whole share.
//!
//! # Who is closed to make room
//!
//! When every place is taken, a newcomer from source `a`:
//!
//! 1. **Fair share**: closes at once the lowest-class, then oldest, connection of the
//!    source holding the most places, if that source holds at least two more than `a`
//!    does. However its connections are ranked, one source cannot hold more than its
//!    share of the places while another waits, so a flood from one address (or one
//!    NAT) never locks out the rest.
//! 2. **Stale places**: otherwise closes the lowest-class, then oldest, connection that
//!    has held its place for [`stale`](Places::new) time (an eighth of the handshake
//!    timeout in the server), whatever its class.
//! 3. Otherwise it waits (within its own handshake timeout) until a place frees or the
//!    oldest place turns stale.
//!
//! Class alone never closes a connection: a connection is closed by rule 1 only while
//! its source holds more than its share, and by rule 2 only once stale. So a peer that
//! proves the secret within a round trip or two is never closed by others' floods or
//! failures, whatever its address's past: a suspect source is only the first closed
//! among stale places.
//!
//! # Bounds
//!
//! The tables of sources ([`AuthLimiter`], [`ProvenSources`]) keep at most 4,096
//! entries each; [`Places`] holds at most its capacity.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv6Addr};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

/// How long a source address that completed a handshake keeps its priority.
pub const PROVEN_MEMORY: Duration = Duration::from_secs(600);

/// Source addresses remembered (as proven, or for their failures) at most.
const MAX_TRACKED_SOURCES: usize = 4096;

/// The unit a connection is charged to: an IPv4 address, or an IPv6 /64 (an
/// IPv4-mapped IPv6 address counts as its IPv4 address).
pub(super) fn source_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & !((1u128 << 64) - 1))),
        },
    }
}

/// Priority of a handshaking connection for places, lowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Class {
    /// Its source failed authentication too often.
    Suspect,
    /// A source not seen to prove itself recently, or a proven source's second place.
    Stranger,
    /// The one place of a source that completed a handshake within [`PROVEN_MEMORY`].
    Proven,
}

/// Why a connection was closed to make room.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Reason {
    /// Its source held more than its share of the places.
    Share,
    /// It had held its place for the stale time.
    Stale,
}

/// A connection closed to make room (its token is already cancelled).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Closed {
    /// Its class.
    pub class: Class,
    /// Its source.
    pub source: IpAddr,
    /// Why.
    pub reason: Reason,
}

/// A handshaking connection.
struct Place {
    /// When it took its place.
    since: Instant,
    class: Class,
    source: IpAddr,
    token: CancellationToken,
}

/// The handshaking places: at most `cap` connections that have spoken and not yet
/// finished their handshake, keyed by accept order.
pub(super) struct Places {
    cap: usize,
    stale: Duration,
    held: BTreeMap<u64, Place>,
}

impl Places {
    /// `cap` places; a place held for `stale` may be taken by any newcomer.
    pub fn new(cap: usize, stale: Duration) -> Places {
        Places {
            cap,
            stale,
            held: BTreeMap::new(),
        }
    }

    /// Connections holding a place now.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// The class a connection from `ip` gets if it takes a place now: `suspect` says
    /// whether its source is suspect, `proven` whether it proved itself recently.
    pub fn class_for(&self, ip: IpAddr, suspect: bool, proven: bool) -> Class {
        if suspect {
            return Class::Suspect;
        }
        let source = source_of(ip);
        let taken = self
            .held
            .values()
            .any(|p| p.source == source && p.class == Class::Proven);
        if proven && !taken {
            Class::Proven
        } else {
            Class::Stranger
        }
    }

    /// Enters connection `id` from `ip` with `class` if there is room, closing others
    /// by the rules of the module docs (returned, tokens cancelled); otherwise returns
    /// when to try again at the latest (`Err`), having closed nothing.
    pub fn admit(
        &mut self,
        id: u64,
        ip: IpAddr,
        class: Class,
        token: &CancellationToken,
        now: Instant,
    ) -> Result<Vec<Closed>, Instant> {
        let source = source_of(ip);
        let mut closed = Vec::new();
        while self.held.len() >= self.cap.max(1) {
            let Some((victim, reason)) = self.victim(source, now) else {
                let first_stale = self.held.values().map(|p| p.since + self.stale).min().unwrap_or(now);
                return Err(first_stale.max(now));
            };
            if let Some(p) = self.held.remove(&victim) {
                p.token.cancel();
                closed.push(Closed {
                    class: p.class,
                    source: p.source,
                    reason,
                });
            }
        }
        self.held.insert(
            id,
            Place {
                since: now,
                class,
                source,
                token: token.clone(),
            },
        );
        Ok(closed)
    }

    /// Connection `id` no longer holds a place (authenticated, failed or closed); true
    /// if it held one.
    pub fn leave(&mut self, id: u64) -> bool {
        self.held.remove(&id).is_some()
    }

    /// The connection a newcomer from `source` may close now, and why.
    fn victim(&self, source: IpAddr, now: Instant) -> Option<(u64, Reason)> {
        let mut counts: HashMap<IpAddr, usize> = HashMap::new();
        for p in self.held.values() {
            *counts.entry(p.source).or_default() += 1;
        }
        let mine = counts.get(&source).copied().unwrap_or(0);
        // The largest holder (ties: the one with the lowest-ranked, oldest place).
        let largest = counts.values().copied().max().unwrap_or(0);
        if largest >= mine + 2 {
            let over = self
                .held
                .iter()
                .filter(|(_, p)| counts[&p.source] == largest)
                .min_by_key(|(id, p)| (p.class, **id))
                .map(|(id, _)| *id);
            if let Some(id) = over {
                return Some((id, Reason::Share));
            }
        }
        self.held
            .iter()
            .filter(|(_, p)| p.since + self.stale <= now)
            .min_by_key(|(id, p)| (p.class, **id))
            .map(|(id, _)| (*id, Reason::Stale))
    }
}

/// Sources that completed a handshake within [`PROVEN_MEMORY`], with when (bounded:
/// when full, expired entries go first, then the oldest).
#[derive(Default)]
pub(super) struct ProvenSources {
    at: HashMap<IpAddr, Instant>,
}

impl ProvenSources {
    /// Whether `ip`'s source completed a handshake within [`PROVEN_MEMORY`].
    pub fn is_proven(&self, ip: IpAddr, now: Instant) -> bool {
        self.at
            .get(&source_of(ip))
            .is_some_and(|t| now.duration_since(*t) < PROVEN_MEMORY)
    }

    /// Remembers that `ip`'s source completed a handshake at `now`.
    pub fn note(&mut self, ip: IpAddr, now: Instant) {
        let key = source_of(ip);
        if !self.at.contains_key(&key) && self.at.len() >= MAX_TRACKED_SOURCES {
            self.at.retain(|_, t| now.duration_since(*t) < PROVEN_MEMORY);
            if self.at.len() >= MAX_TRACKED_SOURCES {
                if let Some(k) = self.at.iter().min_by_key(|(_, t)| **t).map(|(k, _)| *k) {
                    self.at.remove(&k);
                }
            }
        }
        self.at.insert(key, now);
    }
}

/// Failed authentications per source: after `limit` within `window`, the source is
/// suspect for `window`. Bounded: at most 4,096 entries; when full, expired entries go
/// first, then the unblocked one whose window started earliest.
pub(super) struct AuthLimiter {
    limit: u32,
    window: Duration,
    sources: HashMap<IpAddr, Failures>,
}

struct Failures {
    since: Instant,
    count: u32,
    blocked_until: Option<Instant>,
}

impl Failures {
    fn expired(&self, now: Instant, window: Duration) -> bool {
        self.blocked_until.is_none_or(|t| t <= now) && now.duration_since(self.since) >= window
    }
}

impl AuthLimiter {
    pub fn new(limit: u32, window: Duration) -> AuthLimiter {
        AuthLimiter {
            limit,
            window,
            sources: HashMap::new(),
        }
    }

    /// Lifts the block of `ip`'s source and forgets its failures (it proved itself).
    pub fn forgive(&mut self, ip: IpAddr) {
        self.sources.remove(&source_of(ip));
    }

    /// How much longer `ip`'s source is suspect, if it is.
    pub fn blocked(&self, ip: IpAddr, now: Instant) -> Option<Duration> {
        let until = self.sources.get(&source_of(ip))?.blocked_until?;
        (until > now).then(|| until - now)
    }

    /// Counts a failure from `ip`; true if that starts a block.
    pub fn record_failure(&mut self, ip: IpAddr, now: Instant) -> bool {
        let key = source_of(ip);
        if !self.sources.contains_key(&key) && self.sources.len() >= MAX_TRACKED_SOURCES {
            let window = self.window;
            self.sources.retain(|_, f| !f.expired(now, window));
            if self.sources.len() >= MAX_TRACKED_SOURCES {
                // Blocked sources last: a burst of new addresses does not lift a block.
                let oldest = self
                    .sources
                    .iter()
                    .min_by_key(|(_, f)| (f.blocked_until.is_some_and(|t| t > now), f.since))
                    .map(|(k, _)| *k);
                if let Some(k) = oldest {
                    self.sources.remove(&k);
                }
            }
        }
        let f = self.sources.entry(key).or_insert(Failures {
            since: now,
            count: 0,
            blocked_until: None,
        });
        if f.blocked_until.is_some_and(|t| t > now) {
            return false;
        }
        if f.expired(now, self.window) {
            *f = Failures {
                since: now,
                count: 0,
                blocked_until: None,
            };
        }
        f.count += 1;
        if f.count < self.limit {
            return false;
        }
        *f = Failures {
            since: now,
            count: 0,
            blocked_until: Some(now + self.window),
        };
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STALE: Duration = Duration::from_millis(375);

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn tokens(n: usize) -> Vec<CancellationToken> {
        (0..n).map(|_| CancellationToken::new()).collect()
    }

    #[test]
    fn a_newcomer_waits_for_a_stale_place_then_takes_the_lowest_oldest() {
        let mut p = Places::new(2, STALE);
        let t0 = Instant::now();
        let t = tokens(4);
        let (a, b, c) = (ip("10.0.0.1"), ip("10.0.0.2"), ip("10.0.0.3"));
        assert_eq!(p.admit(1, a, Class::Stranger, &t[1], t0), Ok(vec![]));
        assert_eq!(p.admit(2, b, Class::Suspect, &t[2], t0), Ok(vec![]));
        // Balanced (one place each): nothing is closed before it is stale, whatever
        // the classes.
        assert_eq!(p.admit(3, c, Class::Proven, &t[3], t0), Err(t0 + STALE));
        assert!(!t[1].is_cancelled() && !t[2].is_cancelled());
        // Once stale: the suspect goes first, though it is not the oldest.
        let closed = p.admit(3, c, Class::Stranger, &t[3], t0 + STALE).unwrap();
        assert_eq!(closed.len(), 1);
        assert_eq!((closed[0].class, closed[0].reason), (Class::Suspect, Reason::Stale));
        assert!(t[2].is_cancelled() && !t[1].is_cancelled());
    }

    #[test]
    fn one_source_cannot_hold_more_than_its_share_however_it_is_ranked() {
        let mut p = Places::new(8, STALE);
        let t0 = Instant::now();
        let t = tokens(12);
        let flood = ip("10.0.0.2");
        // A proven address's first place is proven, the rest strangers.
        assert_eq!(p.class_for(flood, false, true), Class::Proven);
        p.admit(0, flood, Class::Proven, &t[0], t0).unwrap();
        assert_eq!(p.class_for(flood, false, true), Class::Stranger);
        for i in 1..8 {
            p.admit(i, flood, Class::Stranger, &t[i as usize], t0).unwrap();
        }
        // A suspect newcomer from elsewhere closes the flood's oldest stranger at once.
        let suspect = ip("10.0.0.6");
        let closed = p.admit(8, suspect, Class::Suspect, &t[8], t0 + STALE / 2).unwrap();
        assert_eq!(closed[0].reason, Reason::Share);
        assert_eq!((closed[0].class, closed[0].source), (Class::Stranger, flood));
        assert!(
            t[1].is_cancelled() && !t[0].is_cancelled(),
            "the proven place goes last"
        );
        // The flood's next connection cannot close the newcomer (not stale, and the
        // flood is the largest holder): it closes its own oldest stale place instead.
        assert_eq!(p.admit(9, flood, Class::Stranger, &t[9], t0), Err(t0 + STALE));
        let closed = p.admit(9, flood, Class::Stranger, &t[9], t0 + STALE).unwrap();
        assert_eq!(closed[0].source, flood);
        assert!(!t[8].is_cancelled());
        // Fresh sources keep taking places at once until shares are even.
        for (next, s) in (10u64..).zip(["10.0.0.7", "10.0.0.8"]) {
            let closed = p
                .admit(next, ip(s), Class::Stranger, &t[next as usize], t0 + STALE)
                .unwrap();
            assert_eq!((closed[0].source, closed[0].reason), (flood, Reason::Share));
        }
        assert_eq!(p.len(), 8);
    }

    #[test]
    fn a_source_never_closes_an_equal_share_before_it_is_stale() {
        let mut p = Places::new(4, STALE);
        let t0 = Instant::now();
        let t = tokens(6);
        for (i, s) in ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"].iter().enumerate() {
            p.admit(i as u64, ip(s), Class::Stranger, &t[i], t0).unwrap();
        }
        // The largest holder (2) has one more than the newcomer's source (1), not two.
        p.leave(3);
        p.admit(3, ip("10.0.0.3"), Class::Stranger, &t[3], t0).unwrap();
        assert_eq!(p.admit(4, ip("10.0.0.3"), Class::Stranger, &t[4], t0), Err(t0 + STALE));
        assert!(t.iter().all(|t| !t.is_cancelled()));
    }

    #[test]
    fn proving_memory_expires_and_stays_bounded() {
        let mut s = ProvenSources::default();
        let t0 = Instant::now();
        s.note(ip("10.0.0.1"), t0);
        assert!(s.is_proven(ip("10.0.0.1"), t0 + Duration::from_secs(1)));
        assert!(!s.is_proven(ip("10.0.0.1"), t0 + PROVEN_MEMORY));
        assert!(s.is_proven(ip("::ffff:10.0.0.1"), t0), "mapped IPv4 is the same source");
        for i in 0..(2 * MAX_TRACKED_SOURCES as u32) {
            s.note(IpAddr::V4(i.into()), t0 + Duration::from_millis(i as u64));
        }
        assert!(s.at.len() <= MAX_TRACKED_SOURCES);
    }

    #[test]
    fn blocks_after_the_limit_within_the_window_then_forgets() {
        let w = Duration::from_secs(60);
        let mut l = AuthLimiter::new(3, w);
        let t0 = Instant::now();
        let a = ip("10.0.0.1");
        let b = ip("10.0.0.2");
        assert!(!l.record_failure(a, t0));
        assert!(!l.record_failure(a, t0 + Duration::from_secs(1)));
        assert_eq!(l.blocked(a, t0 + Duration::from_secs(2)), None);
        assert!(l.record_failure(a, t0 + Duration::from_secs(2)));
        assert!(l.blocked(a, t0 + Duration::from_secs(3)).is_some());
        assert_eq!(l.blocked(b, t0 + Duration::from_secs(3)), None, "per source");
        assert_eq!(l.blocked(a, t0 + Duration::from_secs(62)), None, "the block ends");
        l.record_failure(a, t0 + Duration::from_secs(63));
        l.forgive(a);
        assert!(l.sources.is_empty());
        // Failures spread wider than the window never block.
        let mut l = AuthLimiter::new(2, w);
        assert!(!l.record_failure(b, t0));
        assert!(!l.record_failure(b, t0 + Duration::from_secs(61)));
        assert!(l.record_failure(b, t0 + Duration::from_secs(62)));
    }

    #[test]
    fn ipv6_counts_per_64_and_mapped_ipv4_as_ipv4() {
        let mut l = AuthLimiter::new(2, Duration::from_secs(60));
        let t = Instant::now();
        l.record_failure(ip("2001:db8::1"), t);
        assert!(l.record_failure(ip("2001:db8::ffff:2"), t));
        assert!(l.blocked(ip("2001:db8::77"), t).is_some());
        assert!(l.blocked(ip("2001:db8:0:1::1"), t).is_none());
        l.record_failure(ip("::ffff:10.1.2.3"), t);
        assert!(l.record_failure(ip("10.1.2.3"), t));
    }

    #[test]
    fn state_stays_bounded() {
        let mut l = AuthLimiter::new(5, Duration::from_secs(60));
        let t = Instant::now();
        for i in 0..(3 * MAX_TRACKED_SOURCES as u32) {
            l.record_failure(IpAddr::V4(i.into()), t + Duration::from_millis(i as u64));
        }
        assert!(l.sources.len() <= MAX_TRACKED_SOURCES);
        // A blocked source is not pushed out by a burst of new ones.
        let mut l = AuthLimiter::new(2, Duration::from_secs(60));
        let bad = ip("192.0.2.1");
        l.record_failure(bad, t);
        assert!(l.record_failure(bad, t));
        for i in 0..(2 * MAX_TRACKED_SOURCES as u32) {
            l.record_failure(IpAddr::V4((i + 1).into()), t + Duration::from_secs(1));
        }
        assert!(l.sources.len() <= MAX_TRACKED_SOURCES);
        assert!(l.blocked(bad, t + Duration::from_secs(30)).is_some());
    }
}
