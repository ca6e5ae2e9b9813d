//! The copy engine reading another process's memory (`process_vm_readv`, the CMA
//! mover's data path), with the same drain promises as a local copy, proved at the
//! same instant: while copy threads are parked inside a remote slice, a cancel,
//! repeated cancel, timeout or failing sibling slice has not resumed the caller and no
//! destination page is back on the free list; afterwards every page is. And against a
//! real second process: the bytes land with the checksums of what the process holds,
//! and a process killed mid-copy fails the copy as gone, never a hang.

mod common;

use std::io::Write;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::child::{line_after, spawn_self_test};
use common::drain::{
    cancel_given_up_three_times_drains_after_release, drain_arena as arena, holds_parked_and_undrained,
    parking_engine as engine, release_and_await_fence, WINDOW,
};
use common::{eventually, holds_for, ParkingBody};
use kvferry::copy::{CopyConfig, CopyEngine, CopyError, CopyPlan, RemoteSource};
use kvferry::mem::{Arena, ArenaConfig};

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// 1 MiB of `seed`'s pattern, a [`ParkingBody`], an engine running it and an arena.
fn parked_setup(seed: u8) -> (Vec<u8>, Arc<ParkingBody>, CopyEngine, Arena) {
    let body = ParkingBody::new();
    (pattern(1 << 20, seed), body.clone(), engine(body), arena())
}

/// A plan reading `src` (in this process, through the kernel as if it were another)
/// into 16 pages of `arena`, one checksum group per 256 KiB.
fn remote_plan(arena: &Arena, src: &[u8], pid: u32) -> CopyPlan {
    // Two runs, to cross a run boundary inside a slice.
    let half = src.len() / 2;
    let runs = [
        (src.as_ptr() as u64, half as u64),
        (src[half..].as_ptr() as u64, (src.len() - half) as u64),
    ];
    let source = RemoteSource::new(pid, runs).unwrap();
    let lease = arena.try_alloc(16).unwrap();
    let mut plan = CopyPlan::new(kvferry::copy::Endpoint::Remote(source), lease);
    for g in 0..4 {
        plan.push(g * (256 << 10), g * (256 << 10), 256 << 10);
    }
    plan.with_checksum_groups(vec![1, 2, 3, 4])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_copy_lands_bytes_and_group_checksums() {
    let src = pattern(1 << 20, 3);
    let arena = arena();
    let engine = CopyEngine::new(CopyConfig {
        threads: 2,
        slice_bytes: 256 << 10,
    })
    .unwrap();
    let plan = engine
        .copy(remote_plan(&arena, &src, std::process::id()))
        .await
        .unwrap();
    let expected: Vec<u32> = src.chunks(256 << 10).map(kvferry::checksum::checksum).collect();
    assert_eq!(plan.group_checksums().unwrap(), &expected[..]);
    let (_, dst) = plan.into_parts();
    let lease = dst.into_lease().unwrap();
    let mut out = vec![0u8; 1 << 20];
    lease.read_at(0, &mut out).unwrap();
    assert!(out == src, "remote copy landed wrong bytes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_copy_cancel_and_repeated_cancel_wait_for_started_reads() {
    let (src, body, engine, arena) = parked_setup(5);
    let _release = body.release_on_drop();
    let job = engine.copy(remote_plan(&arena, &src, std::process::id()));
    // Each gives up waiting, as a timeout around the cancel would.
    cancel_given_up_three_times_drains_after_release(job, &body, &arena).await;
    assert_eq!(arena.stats().free_pages, 32);
    assert_eq!(
        body.ran.load(Ordering::SeqCst),
        2,
        "unstarted remote slices must be skipped"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_copy_timeout_drains_before_the_fence() {
    let (src, body, engine, arena) = parked_setup(7);
    let _release = body.release_on_drop();
    let job = engine.copy(remote_plan(&arena, &src, std::process::id()));
    let fence = job.fence();
    let out = tokio::time::timeout(Duration::from_millis(100), job).await;
    assert!(out.is_err(), "the parked copy cannot finish in time");
    // The timed-out job was dropped: started reads still run, pages still lent.
    holds_parked_and_undrained(&body, &arena, &fence).await;
    release_and_await_fence(&body, &fence).await;
    assert_eq!(arena.stats().free_pages, 32);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_remote_slice_is_reported_after_its_siblings_stopped() {
    // The source's second half names memory that is not mapped: slices 2 and 3 fail
    // with EFAULT while slice 0 (and 1) are parked inside on the two threads.
    let src = pattern(512 << 10, 9);
    let runs = [(src.as_ptr() as u64, src.len() as u64), (8u64 << 40, 512 << 10)];
    let source = RemoteSource::new(std::process::id(), runs).unwrap();
    let arena = arena();
    let lease = arena.try_alloc(16).unwrap();
    let plan = CopyPlan::new(kvferry::copy::Endpoint::Remote(source), lease).with(0, 0, 1 << 20);
    let body = ParkingBody::new();
    let engine = engine(body.clone());
    let _release = body.release_on_drop();
    let job = engine.copy(plan);
    let fence = job.fence();
    body.wait_inside(2);
    let task = tokio::spawn(job);
    holds_for(WINDOW, || {
        let (inside, free, done) = (body.inside(), arena.stats().free_pages, task.is_finished());
        if inside == 2 && free == 16 && !done {
            Ok(())
        } else {
            Err(format!("inside={inside} free={free} finished={done}"))
        }
    })
    .await;
    body.release();
    let failure = task.await.unwrap().unwrap_err();
    match &failure.error {
        CopyError::RemoteRead { error, .. } => assert!(error.is_gone(), "{error}"),
        other => panic!("expected a remote read failure, got {other}"),
    }
    assert_eq!(failure.error.code(), kvferry::ErrorCode::PeerLost);
    drop(failure);
    assert!(fence.is_drained());
    assert_eq!(arena.stats().free_pages, 32);
}

/// Run as a child (`KVFERRY_TEST_HOLDER=1`): holds 8 MiB of a known pattern, prints
/// `pid address length`, and waits for stdin to close.
#[test]
fn holder_main() {
    if std::env::var_os("KVFERRY_TEST_HOLDER").is_none() {
        return; // an ordinary test run: nothing to do
    }
    let data = pattern(8 << 20, 11);
    println!("HOLDER {} {} {}", std::process::id(), data.as_ptr() as u64, data.len());
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    std::hint::black_box(&data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_process_is_read_and_its_death_is_an_error_not_a_hang() {
    let (mut child, mut lines) = spawn_self_test("holder_main", "KVFERRY_TEST_HOLDER");
    let held = line_after(&mut lines, "HOLDER ", "the address it holds");
    let v: Vec<u64> = held.split(' ').map(|x| x.parse().unwrap()).collect();
    let (pid, addr, len) = (v[0] as u32, v[1], v[2] as usize);
    let expected = pattern(len, 11);
    let arena = Arena::new(ArenaConfig::new(1 << 20, 8).unpinned()).unwrap();
    let engine = CopyEngine::new(CopyConfig::default()).unwrap();
    let read = |arena: &Arena| {
        let lease = arena.try_alloc(8).unwrap();
        let source = RemoteSource::new(pid, [(addr, len as u64)]).unwrap();
        CopyPlan::new(kvferry::copy::Endpoint::Remote(source), lease)
            .with(0, 0, len)
            .with_checksum_groups(vec![1])
    };
    let plan = engine.copy(read(&arena)).await.unwrap();
    assert_eq!(
        plan.group_checksums().unwrap(),
        &[kvferry::checksum::checksum(&expected)]
    );
    drop(plan);
    // Killed: the next read fails as gone, within a bound.
    child.kill().unwrap();
    child.wait().unwrap();
    let out = tokio::time::timeout(Duration::from_secs(5), engine.copy(read(&arena)))
        .await
        .expect("a read from a dead process returns");
    let failure = out.unwrap_err();
    match &failure.error {
        CopyError::RemoteRead { error, .. } => assert!(error.is_gone(), "{error}"),
        other => panic!("expected a remote read failure, got {other}"),
    }
    drop(failure);
    eventually("pages back", || arena.stats().free_pages == 8).await;
}
