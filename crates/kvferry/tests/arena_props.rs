//! Property test of the arena: random sequences of alloc, drop, cancelled waits,
//! truncate, quarantine and release keep `free + leased + quarantined == total`, match
//! a model of the expected counts, and never hand a page to two leases (each lease
//! stamps its pages; a page handed out twice would overwrite another lease's stamp).

use std::time::Duration;

use futures::FutureExt;
use kvferry::mem::{Arena, ArenaConfig, Lease, Quarantined};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Alloc(usize),
    Drop(usize),
    CancelledWait(usize),
    Truncate(usize, usize),
    Quarantine(usize),
    Release(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1usize..6).prop_map(Op::Alloc),
        3 => any::<usize>().prop_map(Op::Drop),
        1 => (1usize..20).prop_map(Op::CancelledWait),
        1 => (any::<usize>(), 1usize..4).prop_map(|(i, k)| Op::Truncate(i, k)),
        1 => any::<usize>().prop_map(Op::Quarantine),
        1 => any::<usize>().prop_map(Op::Release),
    ]
}

fn stamp(lease: &mut Lease, tag: u64) {
    for p in 0..lease.page_count() {
        lease.write_at(p * lease.page_size(), &tag.to_le_bytes()).unwrap();
    }
}

fn stamps_intact(lease: &Lease, tag: u64) -> bool {
    (0..lease.page_count()).all(|p| lease.to_vec(p * lease.page_size(), 8).unwrap() == tag.to_le_bytes())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]
    #[test]
    fn arena_accounting_holds(ops in proptest::collection::vec(op(), 1..80)) {
        const TOTAL: usize = 16;
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let arena = Arena::new(ArenaConfig::new(4096, TOTAL).unpinned()).unwrap();
        let mut leases: Vec<(Lease, u64)> = Vec::new();
        let mut quarantined: Vec<Quarantined> = Vec::new();
        let (mut leased, mut quar) = (0usize, 0usize);
        let mut next_tag = 1u64;
        for op in ops {
            match op {
                Op::Alloc(n) => match arena.try_alloc(n) {
                    Ok(mut l) => {
                        prop_assert!(TOTAL - leased - quar >= n);
                        stamp(&mut l, next_tag);
                        leases.push((l, next_tag));
                        next_tag += 1;
                        leased += n;
                    }
                    Err(_) => prop_assert!(TOTAL - leased - quar < n),
                },
                Op::Drop(i) if !leases.is_empty() => {
                    let (l, _) = leases.swap_remove(i % leases.len());
                    leased -= l.page_count();
                }
                Op::CancelledWait(n) => {
                    // Poll an allocation once and drop it: a cancelled waiter.
                    let a = arena.clone();
                    let got = rt.block_on(async move {
                        a.alloc(n.min(TOTAL), tokio::time::Instant::now() + Duration::from_secs(60)).now_or_never()
                    });
                    if let Some(Ok(l)) = got {
                        drop(l); // granted at once: return it
                    }
                    prop_assert_eq!(arena.stats().waiters, 0);
                }
                Op::Truncate(i, k) if !leases.is_empty() => {
                    let idx = i % leases.len();
                    let before = leases[idx].0.page_count();
                    leases[idx].0.truncate(k);
                    leased -= before - leases[idx].0.page_count();
                }
                Op::Quarantine(i) if !leases.is_empty() => {
                    let (l, _) = leases.swap_remove(i % leases.len());
                    leased -= l.page_count();
                    quar += l.page_count();
                    quarantined.push(l.quarantine());
                }
                Op::Release(i) if !quarantined.is_empty() => {
                    let q = quarantined.swap_remove(i % quarantined.len());
                    quar -= q.page_count();
                    q.release();
                }
                _ => {}
            }
            let s = arena.stats();
            prop_assert_eq!(s.free_pages + s.leased_pages + s.quarantined_pages, s.total_pages);
            prop_assert_eq!(s.leased_pages, leased);
            prop_assert_eq!(s.quarantined_pages, quar);
            prop_assert_eq!(s.outstanding_leases, leases.len());
            for (l, tag) in &leases {
                prop_assert!(stamps_intact(l, *tag), "a page of lease {} was handed out twice", tag);
            }
        }
        drop(leases);
        let s = arena.stats();
        prop_assert_eq!(s.free_pages, TOTAL - quar);
    }
}
