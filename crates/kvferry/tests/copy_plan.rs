//! Scatter/gather correctness of the copy engine: random plans between scattered
//! leases and regions produce exactly the expected bytes, with many jobs in flight.

use std::sync::Arc;

use kvferry::copy::{CopyConfig, CopyEngine, CopyError, CopyPlan};
use kvferry::mem::{Arena, ArenaConfig, Region};
use rand::{Rng, SeedableRng};

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..len).map(|_| rng.gen()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_scatter_gather_round_trips() {
    let engine = CopyEngine::new(CopyConfig {
        threads: 2,
        slice_bytes: 64 << 10,
    })
    .unwrap();
    let arena = Arena::new(ArenaConfig::new(16 << 10, 1024).unpinned()).unwrap();
    // Fragment the free list so leases are scattered.
    let holes: Vec<_> = (0..64).map(|_| arena.try_alloc(1).unwrap()).collect();
    let keep: Vec<_> = holes.into_iter().step_by(2).collect();
    let mut jobs = Vec::new();
    for seed in 0..8u64 {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let len = 1 << 20;
        let src = Arc::new(Region::host("src", len).unwrap());
        let data = pattern(len, seed);
        src.write(0, &data).unwrap();
        // Random non-overlapping pieces of the source, gathered back to back.
        let mut segs = Vec::new();
        let mut at = 0;
        let mut off = 0;
        while off + 70_000 < len {
            let n = rng.gen_range(1..60_000);
            segs.push((off, at, n));
            at += n;
            off += n + rng.gen_range(0..10_000);
        }
        let lease = arena.try_alloc(arena.pages_for(at)).unwrap();
        let mut plan = CopyPlan::new(src.clone(), lease);
        for &(s, d, n) in &segs {
            plan.push(s, d, n);
        }
        jobs.push((engine.copy(plan), data, segs));
    }
    let mut landed = Vec::new();
    for (job, data, segs) in jobs {
        let plan = job.await.unwrap();
        let (_, dst) = plan.into_parts();
        let lease = dst.into_lease().unwrap();
        for &(s, d, n) in &segs {
            assert_eq!(lease.to_vec(d, n).unwrap(), data[s..s + n]);
        }
        // Scatter back into a fresh region at the original offsets.
        let back = Arc::new(Region::host("back", data.len()).unwrap());
        let mut plan = CopyPlan::new(lease, back.clone());
        for &(s, d, n) in &segs {
            plan.push(d, s, n);
        }
        landed.push((engine.copy(plan), back, data, segs));
    }
    for (job, back, data, segs) in landed {
        drop(job.await.unwrap());
        for &(s, _, n) in &segs {
            assert_eq!(back.to_vec(s, n).unwrap(), data[s..s + n]);
        }
    }
    drop(keep);
    assert_eq!(arena.stats().free_pages, 1024);
}

#[tokio::test]
async fn invalid_plan_fails_at_once_and_hands_the_lease_back() {
    let engine = CopyEngine::new(CopyConfig {
        threads: 1,
        slice_bytes: 64 << 10,
    })
    .unwrap();
    let arena = Arena::new(ArenaConfig::new(4096, 4).unpinned()).unwrap();
    let src = Arc::new(Region::host("src", 4096).unwrap());
    let lease = arena.try_alloc(1).unwrap();
    let failure = engine
        .copy(CopyPlan::new(src, lease).with(0, 0, 8192))
        .await
        .unwrap_err();
    assert!(matches!(failure.error, CopyError::InvalidPlan(_)));
    assert_eq!(arena.stats().leased_pages, 1, "the lease is handed back, not dropped");
    drop(failure);
    assert_eq!(arena.stats().free_pages, 4);
}

#[test]
fn bad_engine_config_is_rejected() {
    assert!(matches!(
        CopyEngine::new(CopyConfig {
            threads: 0,
            slice_bytes: 1 << 20
        }),
        Err(CopyError::InvalidConfig(_))
    ));
    assert!(matches!(
        CopyEngine::new(CopyConfig {
            threads: 1,
            slice_bytes: 10
        }),
        Err(CopyError::InvalidConfig(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checksum_groups_match_the_copied_bytes() {
    let engine = CopyEngine::new(CopyConfig {
        threads: 2,
        slice_bytes: 64 << 10,
    })
    .unwrap();
    let arena = Arena::new(ArenaConfig::new(16 << 10, 256).unpinned()).unwrap();
    let len = 1 << 20;
    let src = Arc::new(Region::host("src", len).unwrap());
    let data = pattern(len, 99);
    src.write(0, &data).unwrap();
    // Many small scattered segments in three groups of uneven size.
    let mut segs = Vec::new();
    let mut at = 0;
    for i in 0..300usize {
        let n = 1000 + (i * 37) % 3000;
        let off = (i * 7919) % (len - n);
        segs.push((off, at, n));
        at += n;
    }
    let ends = vec![10, 11, 300];
    let mut plan = CopyPlan::new(src, arena.try_alloc(arena.pages_for(at)).unwrap()).with_checksum_groups(ends.clone());
    for &(s, d, n) in &segs {
        plan.push(s, d, n);
    }
    let plan = engine.copy(plan).await.unwrap();
    let got = plan.group_checksums().unwrap().to_vec();
    let mut start = 0;
    for (g, &end) in ends.iter().enumerate() {
        let mut want = 0u32;
        for &(s, _, n) in &segs[start..end] {
            want = crc32c::crc32c_append(want, &data[s..s + n]);
        }
        assert_eq!(got[g], want, "group {g}");
        start = end;
    }
    // Bad group boundaries are an invalid plan.
    let lease = arena.try_alloc(1).unwrap();
    let src = Arc::new(Region::host("src", 4096).unwrap());
    let bad = CopyPlan::new(src, lease)
        .with(0, 0, 100)
        .with(100, 100, 100)
        .with_checksum_groups(vec![1]);
    assert!(matches!(
        engine.copy(bad).await.unwrap_err().error,
        CopyError::InvalidPlan(_)
    ));
}
