//! The copy engine's cancel/failure semantics, proved at the same instant: while copy
//! threads are parked inside a slice, the caller has not resumed and no page is back on
//! the free list — for drop-cancel, repeated cancel, error in one slice, explicit
//! cancel and cancelled staging — and afterwards every page does come back.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::drain::{
    cancel_given_up_three_times_drains_after_release, drain_arena, holds_parked_and_unresumed, parking_engine,
    spawn_noting_resume, PAGE, WINDOW,
};
use common::{eventually, holds_for, ParkingBody};
use kvferry::copy::{stage, CopyConfig, CopyEngine, CopyError, CopyPlan, StageError};
use kvferry::mem::{Arena, ArenaConfig, Region};
use tokio::time::Instant;

fn setup(body: Arc<ParkingBody>) -> (CopyEngine, Arena, Arc<Region>) {
    let engine = parking_engine(body);
    let arena = drain_arena();
    let src = Arc::new(Region::host("src", 1 << 20).unwrap());
    for i in 0..16 {
        src.fill(i * PAGE, PAGE, i as u8 + 1).unwrap();
    }
    (engine, arena, src)
}

fn plan(arena: &Arena, src: &Arc<Region>) -> CopyPlan {
    let lease = arena.try_alloc(16).unwrap();
    CopyPlan::new(src.clone(), lease).with(0, 0, 1 << 20)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_copy_releases_nothing_until_threads_leave() {
    let body = ParkingBody::new();
    let (engine, arena, src) = setup(body.clone());
    let _release = body.release_on_drop();
    let job = engine.copy(plan(&arena, &src));
    body.wait_inside(2);
    drop(job); // cancel by drop
    holds_for(WINDOW, || {
        let inside = body.inside();
        let free = arena.stats().free_pages;
        if inside == 2 && free == 16 {
            Ok(())
        } else {
            Err(format!(
                "{inside} threads inside while {free} pages free (want 2 inside, 16 free)"
            ))
        }
    })
    .await;
    body.release();
    eventually("pages back after drain", || arena.stats().free_pages == 32).await;
    assert_eq!(body.ran.load(Ordering::SeqCst), 2, "unstarted slices must be skipped");
    assert_eq!(body.inside(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_cancel_still_drains() {
    let body = ParkingBody::new();
    let (engine, arena, src) = setup(body.clone());
    let _release = body.release_on_drop();
    let job = engine.copy(plan(&arena, &src));
    // Three cancels in a row: each gives up waiting (as a timeout or loop teardown would).
    cancel_given_up_three_times_drains_after_release(job, &body, &arena).await;
    // The fence of a dropped job fires after its memory was released.
    assert_eq!(arena.stats().free_pages, 32);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explicit_cancel_resolves_only_after_drain_and_hands_memory_back() {
    let body = ParkingBody::new();
    let (engine, arena, src) = setup(body.clone());
    let _release = body.release_on_drop();
    let job = engine.copy(plan(&arena, &src));
    body.wait_inside(2);
    let (task, resumed) = spawn_noting_resume(job.cancel());
    holds_parked_and_unresumed(&body, &arena, &resumed, 2).await;
    body.release();
    let failure = task.await.unwrap().unwrap_err();
    assert_eq!(failure.error, CopyError::Cancelled);
    assert_eq!(body.inside(), 0);
    // The plan — and its lease — came back to the caller.
    assert_eq!(arena.stats().free_pages, 16);
    let (_, dst) = failure.plan.into_parts();
    let lease = dst.into_lease().unwrap();
    assert_eq!(lease.page_count(), 16);
    drop(lease);
    assert_eq!(arena.stats().free_pages, 32);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_in_one_slice_waits_for_siblings() {
    // Slice 1 fails at once; slice 0 is parked inside on the other thread.
    let body = ParkingBody::failing(&[1]);
    let (engine, arena, src) = setup(body.clone());
    let _release = body.release_on_drop();
    let job = engine.copy(plan(&arena, &src));
    let (task, resumed) = spawn_noting_resume(job);
    body.wait_inside(1);
    holds_parked_and_unresumed(&body, &arena, &resumed, 1).await;
    body.release();
    let failure = task.await.unwrap().unwrap_err();
    assert!(
        matches!(failure.error, CopyError::SliceFailed { slice: 1, .. }),
        "{}",
        failure.error
    );
    assert_eq!(body.inside(), 0);
    drop(failure);
    assert_eq!(arena.stats().free_pages, 32);
    // Slices after the failure never started.
    assert!(body.ran.load(Ordering::SeqCst) <= 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_staging_returns_pages_only_after_drain() {
    let body = ParkingBody::new();
    let (engine, arena, src) = setup(body.clone());
    let _release = body.release_on_drop();
    let (e2, a2, s2) = (engine.clone(), arena.clone(), src.clone());
    let staging = tokio::spawn(async move {
        stage(
            &e2,
            &a2,
            s2,
            &[(0, 512 << 10), (PAGE * 8, 512 << 10)],
            Instant::now() + Duration::from_secs(5),
        )
        .await
    });
    body.wait_inside(2);
    staging.abort(); // the caller gives up: the staging future is dropped
    assert!(staging.await.unwrap_err().is_cancelled());
    holds_for(WINDOW, || {
        let (inside, s) = (body.inside(), arena.stats());
        if inside == 2 && s.leased_pages == 16 && s.free_pages == 16 {
            Ok(())
        } else {
            Err(format!("inside={inside} stats={s:?}"))
        }
    })
    .await;
    body.release();
    eventually("staged pages return", || arena.stats().free_pages == 32).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_staging_returns_pages_after_drain() {
    let body = ParkingBody::failing(&[0]);
    let (engine, arena, src) = setup(body.clone());
    let _release = body.release_on_drop();
    body.release();
    let err = stage(
        &engine,
        &arena,
        src,
        &[(0, 1 << 20)],
        Instant::now() + Duration::from_secs(5),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, StageError::Copy(CopyError::SliceFailed { slice: 0, .. })),
        "{err}"
    );
    assert_eq!(arena.stats().free_pages, 32);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staging_gathers_ranges_in_order() {
    let engine = CopyEngine::new(CopyConfig {
        threads: 2,
        slice_bytes: 64 << 10,
    })
    .unwrap();
    let arena = Arena::new(ArenaConfig::new(PAGE, 8).unpinned()).unwrap();
    let src = Arc::new(Region::host("src", 1 << 20).unwrap());
    let data: Vec<u8> = (0..1 << 20)
        .map(|i: usize| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    src.write(0, &data).unwrap();
    let ranges = [(700_000, 1000), (5, 70_000), (300_000, 100_000)];
    let staged = stage(&engine, &arena, src, &ranges, Instant::now() + Duration::from_secs(5))
        .await
        .unwrap();
    let mut at = 0;
    for (off, len) in ranges {
        assert_eq!(staged.lease.to_vec(at, len).unwrap(), data[off..off + len]);
        at += len;
    }
    assert_eq!(staged.bytes, at);
}

#[test]
fn shutdown_joins_threads_and_fails_queued_copies_with_memory_handed_back() {
    let body = ParkingBody::new();
    let (engine, arena, src) = setup(body.clone());
    let _release = body.release_on_drop();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let running = engine.copy(plan(&arena, &src));
    body.wait_inside(2);
    let b2 = body.clone();
    let releaser = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        b2.release();
    });
    let t = std::time::Instant::now();
    engine.shutdown(); // blocks until the parked slices finish and threads are joined
    assert!(
        t.elapsed() >= Duration::from_millis(150),
        "shutdown must wait for running slices"
    );
    assert_eq!(body.inside(), 0);
    releaser.join().unwrap();
    let failure = rt.block_on(running).unwrap_err();
    assert_eq!(failure.error, CopyError::ShutDown);
    drop(failure);
    // After shutdown: new copies fail at once and hand the plan back.
    let failure = rt.block_on(engine.copy(plan(&arena, &src))).unwrap_err();
    assert_eq!(failure.error, CopyError::ShutDown);
    drop(failure);
    assert_eq!(arena.stats().free_pages, 32);
}
