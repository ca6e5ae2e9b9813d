//! The ledger against a simple model, with simulated time: random sequences of
//! publish, unpublish, stage (begin, grant or fail), check-out, check-in, a dropped
//! send, `Done`, `Release`, expiry, an orphaned eager get, a peer leaving, shutdown,
//! and registrations held, unheld and deregistered. After every step:
//!
//! - every lease is in exactly the state the model says (staging, staged, out, ended);
//! - nothing is released while checked out: no payload of a checked-out lease comes
//!   back, and no publication a checked-out lease serves is reported released;
//! - each publication is released once, for the reason it was first retired;
//! - quota: the pages charged (real [`Quotas`] guards owned by the payloads) equal the
//!   pages of the live leases, and are zero once everything ended;
//! - a lease expires only after its TTL (or its orphan grace);
//! - a `Release` answers what the model says (a `Done` accepted mid-send included);
//! - a deregistration completes exactly when its holders reach zero.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use tokio::time::Instant;

use super::*;
use crate::peer::publish::Released;
use crate::peer::quota::{Charge, Holder, QuotaLimits, Quotas};

/// A lease payload: its quota charge (real) and its number.
#[derive(Debug)]
struct Payload {
    lease: LeaseId,
    _charge: Charge,
}

/// A publication payload: its number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct PubNo(u64);

#[derive(Clone, Debug)]
enum Op {
    Publish {
        key: u8,
        once: bool,
        ttl: u16,
        reg: Option<u8>,
    },
    Unpublish {
        key: u8,
    },
    Begin {
        owner: u8,
        keys: u8,
    },
    Grant {
        lease: u8,
        pages: u8,
        ttl: u16,
    },
    FailStaging {
        lease: u8,
    },
    CheckOut {
        lease: u8,
        as_owner: u8,
        eager: Option<u8>,
    },
    CheckIn {
        lease: u8,
    },
    DropSend {
        lease: u8,
    },
    Done {
        lease: u8,
        as_owner: u8,
    },
    Release {
        keys: Vec<u8>,
    },
    Advance {
        ms: u16,
    },
    Expire,
    Orphan {
        conn: u8,
    },
    ReleasePeer {
        owner: u8,
    },
    ReleaseAll,
    Register {
        reg: u8,
    },
    Hold {
        reg: u8,
    },
    Unhold {
        reg: u8,
    },
    Deregister {
        reg: u8,
    },
    AbandonDeregister {
        reg: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..4, any::<bool>(), 1u16..400, proptest::option::of(0u8..2))
            .prop_map(|(key, once, ttl, reg)| Op::Publish { key, once, ttl, reg }),
        1 => (0u8..4).prop_map(|key| Op::Unpublish { key }),
        4 => (0u8..2, 0u8..4).prop_map(|(owner, keys)| Op::Begin { owner, keys }),
        4 => (any::<u8>(), 1u8..4, 1u16..400).prop_map(|(lease, pages, ttl)| Op::Grant { lease, pages, ttl }),
        1 => any::<u8>().prop_map(|lease| Op::FailStaging { lease }),
        4 => (any::<u8>(), 0u8..2, proptest::option::of(0u8..2))
            .prop_map(|(lease, as_owner, eager)| Op::CheckOut { lease, as_owner, eager }),
        3 => any::<u8>().prop_map(|lease| Op::CheckIn { lease }),
        1 => any::<u8>().prop_map(|lease| Op::DropSend { lease }),
        4 => (any::<u8>(), 0u8..2).prop_map(|(lease, as_owner)| Op::Done { lease, as_owner }),
        3 => proptest::collection::vec(0u8..4, 1..4).prop_map(|keys| Op::Release { keys }),
        3 => (1u16..300).prop_map(|ms| Op::Advance { ms }),
        3 => Just(Op::Expire),
        1 => (0u8..2).prop_map(|conn| Op::Orphan { conn }),
        1 => (0u8..2).prop_map(|owner| Op::ReleasePeer { owner }),
        1 => Just(Op::ReleaseAll),
        1 => (0u8..2).prop_map(|reg| Op::Register { reg }),
        2 => (0u8..2).prop_map(|reg| Op::Hold { reg }),
        2 => (0u8..2).prop_map(|reg| Op::Unhold { reg }),
        1 => (0u8..2).prop_map(|reg| Op::Deregister { reg }),
        1 => (0u8..2).prop_map(|reg| Op::AbandonDeregister { reg }),
    ]
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MState {
    Staging,
    Staged,
    Out,
}

#[derive(Debug)]
struct MLease {
    owner: u8,
    state: MState,
    pubs: Vec<PubId>,
    pages: usize,
    /// Earliest instant it may expire (granted + TTL, or the orphan grace).
    earliest_expiry: Option<Instant>,
    eager: Option<u64>,
    /// A `Done` was accepted while it was out.
    done_pending: bool,
}

#[derive(Debug)]
struct MPub {
    key: u8,
    once: bool,
    expires: Instant,
    live: bool,
    reason: Option<ReleaseReason>,
    reg: Option<u8>,
}

#[derive(Debug, Default)]
struct MReg {
    registered: bool,
    deregistering: bool,
    /// Holds taken explicitly (publications are counted from the model's pubs).
    explicit: usize,
}

struct Harness {
    ledger: Ledger<Payload, PubNo>,
    quotas: Arc<Quotas>,
    t0: Instant,
    now: Instant,
    leases: HashMap<LeaseId, MLease>,
    /// In creation order, so ops can name leases by a small index.
    order: Vec<LeaseId>,
    /// Payloads the "sends" hold.
    out: HashMap<LeaseId, Payload>,
    pubs: HashMap<PubId, MPub>,
    pub_nos: HashMap<PubNo, PubId>,
    released: HashSet<PubId>,
    retired_keys: HashSet<u8>,
    regs: HashMap<u8, MReg>,
    next_lease: LeaseId,
    grace: Duration,
}

fn key(k: u8) -> ChunkKey {
    ChunkKey::from_name(&format!("k{k}"))
}

fn owner(o: u8) -> String {
    format!("peer-{o}")
}

impl Harness {
    fn new() -> Harness {
        let t0 = Instant::now();
        let limits = LedgerLimits {
            recent_expired: 1 << 16,
            recent_retired: 1 << 16,
            recent_window: Duration::from_secs(3600),
        };
        Harness {
            ledger: Ledger::new(limits),
            quotas: Quotas::new(QuotaLimits {
                per_peer: 1 << 20,
                per_connection: 1 << 20,
                per_source: 1 << 20,
                unproven: 1 << 20,
            }),
            t0,
            now: t0,
            leases: HashMap::new(),
            order: Vec::new(),
            out: HashMap::new(),
            pubs: HashMap::new(),
            pub_nos: HashMap::new(),
            released: HashSet::new(),
            retired_keys: HashSet::new(),
            regs: HashMap::new(),
            next_lease: 1,
            grace: Duration::from_millis(50),
        }
    }

    fn pick(&self, i: u8) -> Option<LeaseId> {
        (!self.order.is_empty()).then(|| self.order[i as usize % self.order.len()])
    }

    fn model_retire(&mut self, id: PubId, reason: ReleaseReason) {
        let p = self.pubs.get_mut(&id).expect("model pub");
        if p.live {
            p.live = false;
            p.reason = Some(reason);
            self.retired_keys.insert(p.key);
        }
    }

    fn live_pub(&self, k: u8) -> Option<PubId> {
        self.pubs.iter().find(|(_, p)| p.live && p.key == k).map(|(id, _)| *id)
    }

    fn reg_holders(&self, r: u8) -> usize {
        let pubs = self
            .pubs
            .iter()
            .filter(|(id, p)| p.reg == Some(r) && !self.released.contains(id))
            .count();
        pubs + self.regs.get(&r).map_or(0, |m| m.explicit)
    }

    /// Checks and applies an outcome.
    fn absorb(&mut self, out: Outcome<Payload, PubNo>) -> Result<(), TestCaseError> {
        for e in out.ended {
            let m = self
                .leases
                .remove(&e.id)
                .ok_or_else(|| TestCaseError::fail("an unknown lease ended"))?;
            prop_assert!(m.state != MState::Out, "lease {} ended while checked out", e.id);
            prop_assert_eq!(
                e.payload.is_some(),
                m.state == MState::Staged,
                "payload back iff staged"
            );
            if let Some(p) = &e.payload {
                prop_assert_eq!(p.lease, e.id);
            }
            if e.reason == EndReason::Expired {
                let earliest = m.earliest_expiry.expect("granted leases expire");
                prop_assert!(self.now >= earliest, "expired {:?} before its TTL", earliest - self.now);
            }
            prop_assert_eq!(e.pages, m.pages);
            self.order.retain(|id| *id != e.id);
        }
        for (r, no) in out.released {
            let id = self.pub_nos[&no];
            prop_assert!(self.released.insert(id), "publication released twice");
            let m = &self.pubs[&id];
            prop_assert!(!m.live, "a live publication was released");
            prop_assert_eq!(Some(r.reason), m.reason, "released for its first retirement's reason");
            prop_assert_eq!(r.key, key(m.key));
            for (lid, l) in &self.leases {
                prop_assert!(
                    !l.pubs.contains(&id),
                    "publication released while lease {} ({:?}) holds it",
                    lid,
                    l.state
                );
            }
        }
        for RegId(r) in out.deregistered {
            let r = r as u8;
            let holders = self.reg_holders(r);
            let m = self.regs.get_mut(&r).expect("model reg");
            prop_assert!(m.deregistering && m.registered, "deregistered without being asked");
            prop_assert_eq!(holders, 0, "deregistered with holders");
            m.registered = false;
            m.deregistering = false;
        }
        Ok(())
    }

    fn step(&mut self, op: &Op) -> Result<(), TestCaseError> {
        let now = self.now;
        match op.clone() {
            Op::Publish { key: k, once, ttl, reg } => {
                let no = PubNo(self.pub_nos.len() as u64);
                let expires = now + Duration::from_millis(ttl as u64);
                let reg_ok = reg.map(|r| self.regs.get(&r).is_some_and(|m| m.registered && !m.deregistering));
                let r = self
                    .ledger
                    .publish(key(k), no, once, expires, reg.map(|r| RegId(r as u64)), now);
                match r {
                    Ok((id, out)) => {
                        prop_assert!(reg_ok != Some(false), "published on an unusable registration");
                        if let Some(old) = self.live_pub(k) {
                            self.model_retire(old, ReleaseReason::Replaced);
                        }
                        self.pubs.insert(
                            id,
                            MPub {
                                key: k,
                                once,
                                expires,
                                live: true,
                                reason: None,
                                reg,
                            },
                        );
                        self.pub_nos.insert(no, id);
                        self.absorb(out)?;
                    }
                    Err(_) => prop_assert_eq!(reg_ok, Some(false), "publication refused"),
                }
            }
            Op::Unpublish { key: k } => {
                let live = self.live_pub(k);
                let out = self.ledger.unpublish(&key(k), now);
                prop_assert_eq!(out.is_some(), live.is_some());
                if let (Some(id), Some(out)) = (live, out) {
                    self.model_retire(id, ReleaseReason::Released);
                    self.absorb(out)?;
                }
            }
            Op::Begin { owner: o, keys } => {
                let keys: Vec<ChunkKey> = (0..keys).map(key).collect();
                let found: Vec<PubId> = self.ledger.lookup(&keys, now).iter().map(|(id, _)| *id).collect();
                // The model's view of the leading live, unexpired publications.
                let mut expect = Vec::new();
                for k in 0..keys.len() as u8 {
                    match self.live_pub(k) {
                        Some(id) if self.pubs[&id].expires > now => expect.push(id),
                        _ => break,
                    }
                }
                prop_assert_eq!(&found, &expect, "lookup");
                let terms = LeaseTerms {
                    owner: owner(o),
                    owner_incarnation: None,
                    claimed_by: None,
                    publications: found.clone(),
                };
                let next = &mut self.next_lease;
                let id = self.ledger.begin(terms, || {
                    *next += 1;
                    *next
                });
                self.leases.insert(
                    id,
                    MLease {
                        owner: o,
                        state: MState::Staging,
                        pubs: found,
                        pages: 0,
                        earliest_expiry: None,
                        eager: None,
                        done_pending: false,
                    },
                );
                self.order.push(id);
            }
            Op::Grant { lease, pages, ttl } => {
                let Some(id) = self.pick(lease) else { return Ok(()) };
                if self.leases[&id].state != MState::Staging {
                    return Ok(());
                }
                let o = self.leases[&id].owner;
                let charge = self.quotas.charge(&Holder::local(&owner(o)), pages as usize).unwrap();
                let ttl = Duration::from_millis(ttl as u64);
                let r = self.ledger.grant(
                    id,
                    Payload {
                        lease: id,
                        _charge: charge,
                    },
                    pages as usize,
                    now,
                    ttl,
                );
                let m = self.leases.get_mut(&id).unwrap();
                m.state = MState::Staged;
                m.pages = pages as usize;
                m.earliest_expiry = Some(now + ttl);
                if let Err(out) = r {
                    prop_assert_eq!(out.ended.len(), 1, "a refused grant ends the lease");
                    self.absorb(out)?;
                }
            }
            Op::FailStaging { lease } => {
                let Some(id) = self.pick(lease) else { return Ok(()) };
                let staging = self.leases[&id].state == MState::Staging;
                let out = self.ledger.staging_failed(id, now);
                prop_assert_eq!(out.ended.len(), usize::from(staging));
                self.absorb(out)?;
            }
            Op::CheckOut { lease, as_owner, eager } => {
                let Some(id) = self.pick(lease) else { return Ok(()) };
                let m = &self.leases[&id];
                let who = Who::Local(owner(as_owner));
                let eager = eager.map(u64::from);
                let expired = m.earliest_expiry.is_some_and(|e| e <= now);
                let (state, mine) = (m.state, m.owner == as_owner);
                match self.ledger.check_out(id, &who, eager, now) {
                    CheckOut::Out(p) => {
                        prop_assert!(mine && state == MState::Staged && !expired, "checked out {state:?}");
                        prop_assert_eq!(p.lease, id);
                        self.out.insert(id, p);
                        let m = self.leases.get_mut(&id).unwrap();
                        m.state = MState::Out;
                        if eager.is_some() {
                            m.eager = eager;
                        }
                    }
                    CheckOut::Expired(out) => {
                        prop_assert!(mine && state == MState::Staged && expired);
                        self.absorb(out)?;
                    }
                    CheckOut::ExpiredEarlier => prop_assert!(false, "a live lease answered expired earlier"),
                    CheckOut::Refused(LeaseRefusal::Foreign) => prop_assert!(!mine),
                    CheckOut::Refused(LeaseRefusal::Unknown) => prop_assert!(mine && state != MState::Staged),
                }
            }
            Op::CheckIn { lease } | Op::DropSend { lease } => {
                let Some(id) = self.pick(lease) else { return Ok(()) };
                let Some(p) = self.out.remove(&id) else { return Ok(()) };
                self.leases.get_mut(&id).unwrap().state = MState::Staged;
                let done_pending = self.leases[&id].done_pending;
                let out = if matches!(op, Op::CheckIn { .. }) {
                    self.ledger.check_in(id, p, now)
                } else {
                    drop(p);
                    // The payload is gone with the send.
                    self.leases.get_mut(&id).unwrap().state = MState::Staging;
                    let out = self.ledger.send_dropped(id, now);
                    prop_assert_eq!(out.ended.len(), 1, "a dropped send ends its lease");
                    out
                };
                if done_pending {
                    prop_assert!(
                        out.ended.iter().any(|e| e.id == id),
                        "a Done accepted mid-send takes effect when the send ends"
                    );
                }
                self.absorb(out)?;
            }
            Op::Done { lease, as_owner } => {
                let Some(id) = self.pick(lease) else { return Ok(()) };
                let m = &self.leases[&id];
                let (state, mine) = (m.state, m.owner == as_owner);
                let pubs = m.pubs.clone();
                match self.ledger.done(id, &Who::Local(owner(as_owner)), now) {
                    Ok(out) => {
                        prop_assert!(mine && state != MState::Staging);
                        for p in pubs {
                            if self.pubs[&p].once {
                                self.model_retire(p, ReleaseReason::Done);
                            }
                        }
                        if state == MState::Out {
                            prop_assert!(out.ended.is_empty(), "a Done mid-send ends nothing yet");
                            self.leases.get_mut(&id).unwrap().done_pending = true;
                        } else {
                            prop_assert!(out.ended.iter().any(|e| e.id == id));
                        }
                        self.absorb(out)?;
                    }
                    Err(LeaseRefusal::Foreign) => prop_assert!(!mine),
                    Err(LeaseRefusal::Unknown) => prop_assert!(mine && state == MState::Staging),
                }
            }
            Op::Release { keys } => {
                let expect: Vec<bool> = keys
                    .iter()
                    .map(|k| match self.live_pub(*k) {
                        Some(id) => self.pubs[&id].once,
                        None => self.retired_keys.contains(k),
                    })
                    .collect();
                let ks: Vec<ChunkKey> = keys.iter().map(|k| key(*k)).collect();
                let (answers, out) = self.ledger.release_keys(&ks, now);
                prop_assert_eq!(answers, expect, "release answers");
                for k in keys {
                    if let Some(id) = self.live_pub(k).filter(|id| self.pubs[id].once) {
                        self.model_retire(id, ReleaseReason::Declined);
                    }
                }
                self.absorb(out)?;
            }
            Op::Advance { ms } => self.now += Duration::from_millis(ms as u64),
            Op::Expire => {
                let expired: Vec<PubId> = self
                    .pubs
                    .iter()
                    .filter(|(_, p)| p.live && p.expires <= now)
                    .map(|(id, _)| *id)
                    .collect();
                for id in expired {
                    self.model_retire(id, ReleaseReason::Expired);
                }
                let out = self.ledger.expire(now);
                for e in &out.ended {
                    prop_assert_eq!(e.reason, EndReason::Expired);
                }
                // Every staged lease past its expiry ended.
                let ended: HashSet<LeaseId> = out.ended.iter().map(|e| e.id).collect();
                for (id, l) in &self.leases {
                    if l.state == MState::Staged && self.ledger.lease_expiry(*id).is_some_and(|e| e <= now) {
                        prop_assert!(ended.contains(id), "a staged lease past its expiry stayed");
                    }
                }
                self.absorb(out)?;
            }
            Op::Orphan { conn } => {
                let conn = u64::from(conn);
                let n = self.ledger.orphan(conn, self.grace, now);
                let mut m = 0;
                for l in self.leases.values_mut() {
                    if l.eager == Some(conn) && l.state == MState::Staged {
                        l.eager = None;
                        let until = now + self.grace;
                        l.earliest_expiry = Some(l.earliest_expiry.map_or(until, |e| e.min(until)));
                        m += 1;
                    }
                }
                prop_assert_eq!(n, m);
            }
            Op::ReleasePeer { owner: o } => {
                let (n, out) = self.ledger.release_peer(&owner(o), now);
                prop_assert_eq!(n, self.leases.values().filter(|l| l.owner == o).count());
                self.absorb(out)?;
            }
            Op::ReleaseAll => {
                let live: Vec<PubId> = self.pubs.iter().filter(|(_, p)| p.live).map(|(id, _)| *id).collect();
                for id in live {
                    self.model_retire(id, ReleaseReason::Shutdown);
                }
                let out = self.ledger.release_all(now);
                self.absorb(out)?;
                prop_assert_eq!(self.ledger.published_now(), 0);
            }
            Op::Register { reg } => {
                let m = self.regs.entry(reg).or_default();
                let r = self.ledger.register(RegId(reg as u64));
                prop_assert_eq!(r.is_ok(), !m.registered);
                m.registered = true;
            }
            Op::Hold { reg } => {
                let m = self.regs.entry(reg).or_default();
                let r = self.ledger.hold(RegId(reg as u64));
                prop_assert_eq!(r.is_ok(), m.registered && !m.deregistering);
                if r.is_ok() {
                    m.explicit += 1;
                }
            }
            Op::Unhold { reg } => {
                let Some(m) = self.regs.get_mut(&reg).filter(|m| m.explicit > 0) else {
                    return Ok(());
                };
                m.explicit -= 1;
                let done = self.ledger.unhold(RegId(reg as u64));
                let mut out = Outcome::default();
                out.deregistered.extend(done);
                let expect_done = self.regs[&reg].deregistering && self.reg_holders(reg) == 0;
                prop_assert_eq!(out.deregistered.len(), usize::from(expect_done));
                self.absorb(out)?;
            }
            Op::Deregister { reg } => {
                let holders = self.reg_holders(reg);
                let m = self.regs.entry(reg).or_default();
                match self.ledger.deregister(RegId(reg as u64)) {
                    Ok(Deregistration::Done) => {
                        prop_assert!(m.registered && holders == 0);
                        m.registered = false;
                        m.deregistering = false;
                    }
                    Ok(Deregistration::Pending(n)) => {
                        prop_assert!(m.registered);
                        prop_assert_eq!(n, holders);
                        m.deregistering = true;
                    }
                    Err(_) => prop_assert!(!m.registered),
                }
            }
            Op::AbandonDeregister { reg } => {
                let m = self.regs.entry(reg).or_default();
                let r = self.ledger.abandon_deregister(RegId(reg as u64));
                prop_assert_eq!(r.is_some(), m.registered);
                m.deregistering = false;
            }
        }
        self.check()
    }

    /// Invariants after every step.
    fn check(&self) -> Result<(), TestCaseError> {
        for (id, m) in &self.leases {
            let want = match m.state {
                MState::Staging => "staging",
                MState::Staged => "staged",
                MState::Out => "out",
            };
            prop_assert_eq!(self.ledger.lease_state(*id), Some(want), "lease {} state", id);
            prop_assert_eq!(m.state == MState::Out, self.out.contains_key(id));
        }
        prop_assert_eq!(self.ledger.leases_now(), self.leases.len(), "no lease unaccounted for");
        // Quota: what the payloads are charged for is what the ledger says is held.
        prop_assert_eq!(self.quotas.charged(), self.ledger.pages_held());
        for o in 0..2u8 {
            let pages: usize = self.leases.values().filter(|l| l.owner == o).map(|l| l.pages).sum();
            prop_assert_eq!(self.ledger.pages_held_by(&owner(o)), pages);
            prop_assert_eq!(self.quotas.charged_to(&owner(o)), pages);
        }
        // Publications: live ones as the model says; held ones by the leases holding them.
        for (id, p) in &self.pubs {
            let holders = self.leases.values().filter(|l| l.pubs.contains(id)).count();
            match self.ledger.publication_state(*id) {
                Some((live, n)) => {
                    prop_assert_eq!(live, p.live, "publication liveness");
                    prop_assert_eq!(n, holders, "publication holders");
                    prop_assert!(
                        p.live || holders > 0,
                        "a retired publication no lease holds is not released"
                    );
                }
                None => prop_assert!(self.released.contains(id), "a publication vanished unreleased"),
            }
        }
        for (r, m) in &self.regs {
            let h = self.ledger.holders(RegId(*r as u64));
            if m.registered {
                prop_assert_eq!(h, Some(self.reg_holders(*r)), "registration holders");
            } else {
                prop_assert_eq!(h, None);
            }
        }
        Ok(())
    }

    /// Ends everything: every send checks in, shutdown, then time passes.
    fn finish(&mut self) -> Result<(), TestCaseError> {
        let ids: Vec<LeaseId> = self.out.keys().copied().collect();
        for id in ids {
            let i = self.order.iter().position(|x| *x == id).unwrap() as u8;
            self.step(&Op::CheckIn { lease: i })?;
        }
        let staging: Vec<LeaseId> = self
            .leases
            .iter()
            .filter(|(_, l)| l.state == MState::Staging)
            .map(|(id, _)| *id)
            .collect();
        for id in staging {
            let out = self.ledger.staging_failed(id, self.now);
            self.absorb(out)?;
        }
        self.step(&Op::ReleaseAll)?;
        prop_assert_eq!(self.ledger.leases_now(), 0);
        prop_assert_eq!(self.quotas.charged(), 0, "every quota charge returned");
        prop_assert_eq!(self.ledger.publications_held(), 0, "every publication released");
        prop_assert_eq!(self.released.len(), self.pubs.len());
        let _ = self.t0;
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn ledger_matches_its_model(ops in proptest::collection::vec(op(), 1..80)) {
        let mut h = Harness::new();
        for op in &ops {
            h.step(op)?;
        }
        h.finish()?;
    }
}

/// The decided semantics, step by step: a `Done` that arrives while its lease is being
/// sent is accepted at once (a `Release` of its keys answers released) and takes
/// effect — lease ended, publication reported, pages uncharged — only at check-in.
#[test]
fn done_mid_send_is_accepted_now_and_takes_effect_at_check_in() {
    for drop_send in [false, true] {
        let mut h = Harness::new();
        h.step(&Op::Publish {
            key: 0,
            once: true,
            ttl: 1000,
            reg: None,
        })
        .unwrap();
        h.step(&Op::Begin { owner: 0, keys: 1 }).unwrap();
        h.step(&Op::Grant {
            lease: 0,
            pages: 3,
            ttl: 1000,
        })
        .unwrap();
        h.step(&Op::CheckOut {
            lease: 0,
            as_owner: 0,
            eager: None,
        })
        .unwrap();
        let id = h.order[0];
        let now = h.now;
        let out = h.ledger.done(id, &Who::Local(owner(0)), now).unwrap();
        assert!(out.is_empty(), "nothing released while the send holds it: {out:?}");
        assert_eq!(h.ledger.counts().done, 1, "the Done is accepted (counted) now");
        h.leases.get_mut(&id).unwrap().done_pending = true;
        h.model_retire(*h.leases[&id].pubs.first().unwrap(), ReleaseReason::Done);
        // Accepted: the key left the table and a Release answers released.
        assert_eq!(h.ledger.published_now(), 0);
        let (answers, out) = h.ledger.release_keys(&[key(0)], now);
        assert_eq!(answers, [true]);
        assert!(out.is_empty());
        // Not yet in effect: still charged, still held.
        assert_eq!(h.quotas.charged(), 3);
        assert_eq!(h.ledger.publications_held(), 1);
        // A second Done changes nothing.
        assert!(h.ledger.done(id, &Who::Local(owner(0)), now).unwrap().is_empty());
        assert_eq!(h.ledger.counts().done, 1);
        // The send ends: now it takes effect.
        let p = h.out.remove(&id).unwrap();
        let out = if drop_send {
            drop(p);
            h.ledger.send_dropped(id, now)
        } else {
            h.ledger.check_in(id, p, now)
        };
        assert_eq!(out.ended.len(), 1);
        assert_eq!(out.ended[0].reason, EndReason::Done);
        assert_eq!(out.ended[0].payload.is_some(), !drop_send);
        assert_eq!(
            out.released.iter().map(|(r, _)| r.clone()).collect::<Vec<_>>(),
            [Released {
                key: key(0),
                reason: ReleaseReason::Done
            }]
        );
        drop(out);
        assert_eq!(h.quotas.charged(), 0);
        assert_eq!(h.ledger.publications_held(), 0);
        // Idempotent: releasing again still answers released.
        assert_eq!(h.ledger.release_keys(&[key(0)], now).0, [true]);
    }
}

/// A `Done` retires exactly the publications its lease served: a later publication
/// under the same key stays.
#[test]
fn done_retires_the_served_publication_not_a_republication() {
    let mut h = Harness::new();
    let publish = Op::Publish {
        key: 0,
        once: true,
        ttl: 1000,
        reg: None,
    };
    h.step(&publish).unwrap();
    h.step(&Op::Begin { owner: 0, keys: 1 }).unwrap();
    h.step(&Op::Grant {
        lease: 0,
        pages: 1,
        ttl: 1000,
    })
    .unwrap();
    h.step(&publish).unwrap(); // replaces the first (held by the lease)
    assert_eq!(h.ledger.publications_held(), 2);
    h.step(&Op::Done { lease: 0, as_owner: 0 }).unwrap();
    assert_eq!(h.ledger.published_now(), 1, "the re-publication stays");
    assert_eq!(h.released.len(), 1);
    let first = *h.pub_nos.get(&PubNo(0)).unwrap();
    assert_eq!(h.pubs[&first].reason, Some(ReleaseReason::Replaced));
    h.finish().unwrap();
}

/// An expired lease checked out is not ended by expiry; it ends at its check-in.
#[test]
fn expiry_waits_for_the_send() {
    let mut h = Harness::new();
    h.step(&Op::Begin { owner: 0, keys: 0 }).unwrap();
    h.step(&Op::Grant {
        lease: 0,
        pages: 2,
        ttl: 10,
    })
    .unwrap();
    h.step(&Op::CheckOut {
        lease: 0,
        as_owner: 0,
        eager: None,
    })
    .unwrap();
    h.step(&Op::Advance { ms: 100 }).unwrap();
    h.step(&Op::Expire).unwrap();
    assert_eq!(h.quotas.charged(), 2, "not expired while out");
    h.step(&Op::CheckIn { lease: 0 }).unwrap();
    assert_eq!(h.quotas.charged(), 0, "expired at check-in");
    assert_eq!(h.ledger.counts().expired, 1);
}

/// A deregistration completes when the last publication holding it is released.
#[test]
fn deregistration_completes_with_the_last_holder() {
    let mut h = Harness::new();
    h.step(&Op::Register { reg: 0 }).unwrap();
    h.step(&Op::Publish {
        key: 1,
        once: true,
        ttl: 1000,
        reg: Some(0),
    })
    .unwrap();
    h.step(&Op::Hold { reg: 0 }).unwrap();
    h.step(&Op::Deregister { reg: 0 }).unwrap();
    assert!(h.regs[&0].deregistering);
    // No new holder while it waits.
    assert_eq!(h.ledger.hold(RegId(0)), Err(RegError::Deregistering));
    h.step(&Op::Unpublish { key: 1 }).unwrap();
    assert!(h.regs[&0].registered, "one holder left");
    h.step(&Op::Unhold { reg: 0 }).unwrap();
    assert!(!h.regs[&0].registered, "the last unhold completed it");
}
