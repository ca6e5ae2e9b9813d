//! The copy-engine fixture of the drain suites (`copy_drain`, `copy_remote`): an engine
//! whose slices park in a [`ParkingBody`], an arena of 32 pages of 64 KiB whose 1 MiB
//! plans take 16 of them, and the invariants that hold while two slices are parked.
#![allow(dead_code)]

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvferry::copy::{CopyConfig, CopyEngine, CopyJob, DrainFence};
use kvferry::mem::{Arena, ArenaConfig};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{holds_for, ParkingBody};

/// The arena's page size.
pub const PAGE: usize = 64 << 10;
/// How long an invariant is sampled.
pub const WINDOW: Duration = Duration::from_millis(500);

/// 2 threads, 256 KiB slices, running `body`: a 1 MiB plan has 4 slices, 2 run at once.
pub fn parking_engine(body: Arc<ParkingBody>) -> CopyEngine {
    CopyEngine::with_body(
        CopyConfig {
            threads: 2,
            slice_bytes: 256 << 10,
        },
        body,
    )
    .unwrap()
}

/// 32 unpinned pages of [`PAGE`] bytes.
pub fn drain_arena() -> Arena {
    Arena::new(ArenaConfig::new(PAGE, 32).unpinned()).unwrap()
}

/// Once two of `job`'s slices are parked, cancels it and gives up on the cancel three
/// times, each after 50 ms (as a timeout or a loop teardown around it would): each
/// time, and then for [`WINDOW`], the two slices stay inside, the plan's 16 pages
/// stay lent and the job's fence has not drained. Then releases the slices and waits
/// (at most 10 s) for the fence.
pub async fn cancel_given_up_three_times_drains_after_release(job: CopyJob, body: &ParkingBody, arena: &Arena) {
    let fence = job.fence();
    body.wait_inside(2);
    let mut cancel = Box::pin(job.cancel());
    for _ in 0..3 {
        assert!(tokio::time::timeout(Duration::from_millis(50), &mut cancel)
            .await
            .is_err());
        assert_eq!((body.inside(), arena.stats().free_pages), (2, 16));
    }
    drop(cancel);
    holds_parked_and_undrained(body, arena, &fence).await;
    release_and_await_fence(body, &fence).await;
}

/// Releases the parked slices and waits (at most 10 s) for `fence`.
pub async fn release_and_await_fence(body: &ParkingBody, fence: &DrainFence) {
    body.release();
    assert!(fence.wait_until(Instant::now() + Duration::from_secs(10)).await);
}

/// Holds for [`WINDOW`]: two slices parked inside, 16 pages free, `fence` not drained.
pub async fn holds_parked_and_undrained(body: &ParkingBody, arena: &Arena, fence: &DrainFence) {
    holds_for(WINDOW, || {
        let (inside, free, drained) = (body.inside(), arena.stats().free_pages, fence.is_drained());
        if inside == 2 && free == 16 && !drained {
            Ok(())
        } else {
            Err(format!("inside={inside} free={free} drained={drained}"))
        }
    })
    .await;
}

/// Spawns `fut` and a flag set once it resolved (the caller resumed).
pub fn spawn_noting_resume<F>(fut: F) -> (JoinHandle<F::Output>, Arc<AtomicBool>)
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    let resumed = Arc::new(AtomicBool::new(false));
    let r = resumed.clone();
    let task = tokio::spawn(async move {
        let out = fut.await;
        r.store(true, Ordering::SeqCst);
        out
    });
    (task, resumed)
}

/// Holds for [`WINDOW`]: `inside` slices parked inside, the caller not resumed, 16
/// pages free.
pub async fn holds_parked_and_unresumed(body: &ParkingBody, arena: &Arena, resumed: &AtomicBool, inside: usize) {
    let want = inside;
    holds_for(WINDOW, || {
        let (inside, resumed, free) = (body.inside(), resumed.load(Ordering::SeqCst), arena.stats().free_pages);
        if inside == want && !resumed && free == 16 {
            Ok(())
        } else {
            Err(format!("inside={inside} resumed={resumed} free={free}"))
        }
    })
    .await;
}
