//! One device test suite, run against every backend: `device_host.rs`, `device_sim.rs`
//! and `device_cuda.rs` each include this file and instantiate [`device_suite!`] with
//! their own `open()`, `other()` and `arena()`; what only one backend has (host copy
//! engine failures, sim faults on a paused clock, CUDA pinned backing) stays in that
//! backend's file.
//!
//! Every case checks the promises of the device layer through the [`Device`] trait
//! alone: bytes survive round trips and gathers; every wait is bounded and a timed-out
//! copy's pages are quarantined until the device completes, then released; every
//! operation gets a fresh event; invalid submissions are typed errors that return their
//! lease; every page ends in exactly one state.
//!
//! # Cancellation
//!
//! Gated copies are released (their gate triggered) before a case ends, so no device
//! work outlives it.
#![allow(dead_code)]

use std::time::Duration;

use kvferry::device::{Device, DeviceBuffer, DeviceError, Event, GatherSegment};
use kvferry::mem::{Arena, Lease};
use tokio::time::Instant;

/// Makes an arena of `pages` pages of `page` bytes suitable for the backend.
pub type ArenaFn<'a> = &'a dyn Fn(usize, usize) -> Arena;

/// Every page is in exactly one state.
pub fn check(a: &Arena) {
    let s = a.stats();
    assert_eq!(
        s.free_pages + s.leased_pages + s.quarantined_pages,
        s.total_pages,
        "{s:?}"
    );
}

/// Deterministic bytes differing per `seed`.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| ((i * 31 + i / 4096) as u8) ^ seed).collect()
}

fn far() -> Instant {
    Instant::now() + Duration::from_secs(60)
}

/// Waits (bounded, in real time) until every page of `a` is free again: a backend may
/// release quarantined pages from its own thread shortly after the device completes.
pub async fn all_free(a: &Arena) {
    let until = std::time::Instant::now() + Duration::from_secs(30);
    while a.stats().free_pages < a.stats().total_pages && std::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(a.stats().free_pages, a.stats().total_pages, "{:?}", a.stats());
    check(a);
}

/// D2H then H2D through a lease whose pages are not adjacent keeps every byte.
pub async fn round_trip_preserves_bytes(dev: &dyn Device, arena: ArenaFn<'_>) {
    let page = 64 << 10;
    let len = (2 << 20) + 4321;
    let a = arena(page, len / page + 3);
    // Scatter the lease: page 0 goes to the back of the free list, page 1 stays held.
    let first = a.try_alloc(1).unwrap();
    let keep = a.try_alloc(1).unwrap();
    drop(first);
    let src = dev.alloc(len).unwrap();
    let data = pattern(len, 0x3C);
    src.write(0, &data).unwrap();
    let s = dev.create_stream("copy").unwrap();
    let lease = s
        .copy_d2h(&src, 0, a.try_alloc(len.div_ceil(page)).unwrap(), 0, len, "d2h")
        .unwrap()
        .wait(far())
        .await
        .unwrap();
    assert_eq!(lease.to_vec(0, len).unwrap(), data);
    let dst = dev.alloc(len).unwrap();
    let lease = s
        .copy_h2d(lease, 0, &dst, 0, len, "h2d")
        .unwrap()
        .wait(far())
        .await
        .unwrap();
    assert_eq!(dst.to_vec(0, len).unwrap(), data);
    drop((lease, keep));
    all_free(&a).await;
}

/// Gathers, on a fresh stream of `dev`, into 3 pages of `a`: `b1[100..3100]` at 0,
/// `b2[0..5000]` at 3000 and `b1[9000..10000]` at 8000 (`b1` of 10 000 bytes, `b2` of
/// 5000). Returns the lease the bytes landed in.
pub async fn gather_three_segments(dev: &dyn Device, a: &Arena, b1: &DeviceBuffer, b2: &DeviceBuffer) -> Lease {
    let segs = [
        GatherSegment {
            src: b1.slice(100, 3000),
            dst_offset: 0,
        },
        GatherSegment {
            src: b2.slice(0, 5000),
            dst_offset: 3000,
        },
        GatherSegment {
            src: b1.slice(9000, 1000),
            dst_offset: 8000,
        },
    ];
    let s = dev.create_stream("copy").unwrap();
    s.copy_d2h_gather(&segs, a.try_alloc(3).unwrap(), "gather")
        .unwrap()
        .wait(far())
        .await
        .unwrap()
}

/// A gather from slices of several buffers lands each at its offset.
pub async fn gather_from_several_buffers(dev: &dyn Device, arena: ArenaFn<'_>) {
    let a = arena(4096, 8);
    let b1 = dev.alloc(10_000).unwrap();
    b1.write(0, &pattern(10_000, 1)).unwrap();
    let b2 = dev.alloc(5000).unwrap();
    b2.write(0, &pattern(5000, 2)).unwrap();
    let lease = gather_three_segments(dev, &a, &b1, &b2).await;
    assert_eq!(lease.to_vec(0, 3000).unwrap(), &pattern(10_000, 1)[100..3100]);
    assert_eq!(lease.to_vec(3000, 5000).unwrap(), pattern(5000, 2));
    assert_eq!(lease.to_vec(8000, 1000).unwrap(), &pattern(10_000, 1)[9000..]);
    drop(lease);
    all_free(&a).await;
}

/// A copy held behind a host gate: the bounded wait times out naming the operation and
/// rank, its pages are quarantined; once the gate opens the copy completes and the
/// pages come back.
pub async fn gated_copy_times_out_quarantined_then_released(dev: &dyn Device, arena: ArenaFn<'_>) {
    let a = arena(4096, 4);
    let buf = dev.alloc(8192).unwrap();
    buf.write(0, &[0xAB; 8192]).unwrap();
    let s = dev.create_stream("copy").unwrap();
    let (gate, trigger) = Event::manual("host gate", dev.rank());
    s.wait_event(&gate).unwrap();
    let p = s.copy_d2h(&buf, 0, a.try_alloc(2).unwrap(), 0, 8192, "gated").unwrap();
    let ev = p.event().clone();
    let err = p.wait(Instant::now() + Duration::from_millis(50)).await.unwrap_err();
    let rank = dev.rank();
    assert!(
        matches!(&err, DeviceError::Timeout { op, rank: r, .. } if op == "gated" && *r == rank),
        "{err}"
    );
    assert_eq!(a.stats().quarantined_pages, 2);
    check(&a);
    trigger.complete();
    ev.wait(far()).await.unwrap();
    all_free(&a).await;
}

/// Every copy and record gets its own event id.
pub async fn every_operation_gets_a_fresh_event(dev: &dyn Device, arena: ArenaFn<'_>) {
    let a = arena(4096, 4);
    let buf = dev.alloc(4096).unwrap();
    let s = dev.create_stream("copy").unwrap();
    let mut ids = Vec::new();
    let mut lease = a.try_alloc(1).unwrap();
    for i in 0..4 {
        let p = s.copy_d2h(&buf, 0, lease, 0, 4096, &format!("op {i}")).unwrap();
        ids.push(p.event().id());
        ids.push(s.record(&format!("rec {i}")).unwrap().id());
        lease = p.wait(far()).await.unwrap();
    }
    let mut unique = ids.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), ids.len(), "{ids:?}");
    drop(lease);
    all_free(&a).await;
}

/// A zero timeout is refused; a deadline already past times out at once and leaves the
/// handle usable; once complete, even a past deadline reports the completion.
pub async fn zero_timeout_is_invalid_and_past_deadline_times_out_at_once(dev: &dyn Device, arena: ArenaFn<'_>) {
    let a = arena(4096, 2);
    let buf = dev.alloc(4096).unwrap();
    let s = dev.create_stream("copy").unwrap();
    let (gate, trigger) = Event::manual("gate", dev.rank());
    s.wait_event(&gate).unwrap();
    let p = s.copy_d2h(&buf, 0, a.try_alloc(1).unwrap(), 0, 4096, "zero").unwrap();
    let ev = p.event().clone();
    assert!(matches!(
        ev.wait_for(Duration::ZERO).await,
        Err(DeviceError::InvalidArgument(_))
    ));
    let t0 = Instant::now();
    assert!(matches!(ev.wait(t0).await, Err(DeviceError::Timeout { .. })));
    assert!(t0.elapsed() < Duration::from_secs(1), "a past deadline returns at once");
    trigger.complete();
    let lease = p.wait(far()).await.unwrap();
    ev.wait(t0).await.unwrap();
    drop(lease);
    all_free(&a).await;
}

/// Blocking waits from a non-async thread, bounded both ways.
pub async fn blocking_waits_from_a_sync_thread(dev: &dyn Device, arena: ArenaFn<'_>) {
    let a = arena(4096, 2);
    let buf = dev.alloc(4096).unwrap();
    buf.write(0, &[9; 4096]).unwrap();
    let s = dev.create_stream("copy").unwrap();
    let p = s.copy_d2h(&buf, 0, a.try_alloc(1).unwrap(), 0, 4096, "sync").unwrap();
    let lease =
        tokio::task::spawn_blocking(move || p.wait_blocking(std::time::Instant::now() + Duration::from_secs(60)))
            .await
            .unwrap()
            .unwrap();
    assert_eq!(lease.to_vec(0, 4096).unwrap(), vec![9; 4096]);
    let (gate, trigger) = Event::manual("gate", dev.rank());
    s.wait_event(&gate).unwrap();
    let ev = s.record("after gate").unwrap();
    let waiter = {
        let ev = ev.clone();
        tokio::task::spawn_blocking(move || ev.wait_blocking(std::time::Instant::now() + Duration::from_secs(60)))
    };
    let timed = ev.clone();
    let timed_out =
        tokio::task::spawn_blocking(move || timed.wait_blocking(std::time::Instant::now() + Duration::from_millis(20)));
    assert!(matches!(timed_out.await.unwrap(), Err(DeviceError::Timeout { .. })));
    trigger.complete();
    waiter.await.unwrap().unwrap();
    drop(lease);
    all_free(&a).await;
}

/// Eight streams copying at once, each verifying its own bytes.
pub async fn concurrent_copies_on_many_streams(dev: &dyn Device, arena: ArenaFn<'_>) {
    let a = arena(4096, 64);
    let work = (0..8u8).map(|i| {
        let a = a.clone();
        let s = dev.create_stream(&format!("s{i}")).unwrap();
        let buf = dev.alloc(16384).unwrap();
        async move {
            for round in 0..10u8 {
                let data = pattern(16384, i ^ round);
                buf.write(0, &data).unwrap();
                let lease = a.alloc(4, far()).await.unwrap();
                let lease = s
                    .copy_d2h(&buf, 0, lease, 0, 16384, "c")
                    .unwrap()
                    .wait(far())
                    .await
                    .unwrap();
                assert_eq!(lease.to_vec(0, 16384).unwrap(), data);
            }
        }
    });
    futures::future::join_all(work).await;
    all_free(&a).await;
}

/// Out-of-bounds ranges, another device's buffer, overflowing offsets and overlapping
/// gather targets are typed `InvalidArgument`s, and each returns its lease at once.
pub async fn invalid_submissions_are_typed_and_return_the_lease(
    dev: &dyn Device,
    other: &dyn Device,
    arena: ArenaFn<'_>,
) {
    let a = arena(4096, 2);
    let buf = dev.alloc(4096).unwrap();
    let foreign = other.alloc(4096).unwrap();
    let s = dev.create_stream("copy").unwrap();
    let cases = [
        s.copy_d2h(&buf, 1, a.try_alloc(1).unwrap(), 0, 4096, "src oob")
            .map(drop),
        s.copy_d2h(&buf, 0, a.try_alloc(1).unwrap(), 1, 4096, "dst oob")
            .map(drop),
        s.copy_d2h(&foreign, 0, a.try_alloc(1).unwrap(), 0, 4096, "foreign")
            .map(drop),
        s.copy_h2d(a.try_alloc(1).unwrap(), 0, &buf, usize::MAX, 2, "overflow")
            .map(drop),
        s.copy_d2h_gather(
            &[
                GatherSegment {
                    src: buf.slice(0, 100),
                    dst_offset: 0,
                },
                GatherSegment {
                    src: buf.slice(0, 100),
                    dst_offset: 50,
                },
            ],
            a.try_alloc(1).unwrap(),
            "overlap",
        )
        .map(drop),
    ];
    for c in cases {
        assert!(matches!(c, Err(DeviceError::InvalidArgument(_))), "{c:?}");
    }
    assert_eq!(a.stats().free_pages, 2, "rejected submissions return their leases");
}

/// Instantiates the suite in a backend's test file, which defines
/// `open() -> Option<Arc<D>>` (`None`: skip, after saying why), `other() -> Option<Arc<D>>`
/// (a second device of the backend) and `arena(&Arc<D>, page, pages) -> Arena`.
macro_rules! device_suite {
    () => {
        $crate::device_suite::device_suite!(@case round_trip_preserves_bytes);
        $crate::device_suite::device_suite!(@case gather_from_several_buffers);
        $crate::device_suite::device_suite!(@case gated_copy_times_out_quarantined_then_released);
        $crate::device_suite::device_suite!(@case every_operation_gets_a_fresh_event);
        $crate::device_suite::device_suite!(@case zero_timeout_is_invalid_and_past_deadline_times_out_at_once);
        $crate::device_suite::device_suite!(@case blocking_waits_from_a_sync_thread);
        $crate::device_suite::device_suite!(@case concurrent_copies_on_many_streams);

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn suite_invalid_submissions_are_typed_and_return_the_lease() {
            let (Some(dev), Some(other)) = (open(), other()) else { return };
            let mk = |page, pages| arena(&dev, page, pages);
            $crate::device_suite::invalid_submissions_are_typed_and_return_the_lease(&*dev, &*other, &mk).await;
        }
    };
    (@case $name:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let Some(dev) = open() else { return };
            let mk = |page, pages| arena(&dev, page, pages);
            $crate::device_suite::$name(&*dev, &mk).await;
        }
    };
}
pub(crate) use device_suite;
