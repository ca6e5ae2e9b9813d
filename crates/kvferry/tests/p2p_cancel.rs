//! Cancellation, timeouts and peer loss on the P2P path — the failure that motivated
//! kvferry: a sync get that times out during the post-receive landing copy must
//! return on time, must not release staging pages (or report the destination quiet)
//! while copy threads still write, and must leak nothing once they stop.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::p2p::*;
use common::{eventually, holds_for, ParkingBody};
use kvferry::peer::PeerError;
use kvferry::ErrorCode;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;

#[test]
fn sync_get_timing_out_during_landing_copy_returns_on_time_and_drains_before_release() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let body = ParkingBody::new();
    let (node, c, keys) = rt.block_on(async {
        let node = producer_node(NodeOpts::default()).await;
        let c = consumer_with_body(body.clone(), 64, 64);
        let keys = fill(&node.producer, 1, 2, 4);
        (node, c, keys)
    });
    let _release = body.release_on_drop();
    let timeout = Duration::from_millis(300);
    let t = std::time::Instant::now();
    let err = c
        .consumer
        .get_blocking(&node.addr, &keys, c.dst(0, 2, 4), timeout)
        .unwrap_err();
    let took = t.elapsed();
    assert!(matches!(err.error, PeerError::Timeout { .. }), "{}", err.error);
    assert!(
        took >= timeout && took <= timeout + Duration::from_millis(20),
        "returned after {took:?}"
    );
    // The landing copy is parked inside: staging pages must stay leased and the
    // destination must not be reported quiet, at the same instant, for a window.
    body.wait_inside(2);
    rt.block_on(holds_for(Duration::from_millis(500), || {
        let (inside, leased, drained) = (
            body.inside(),
            c.consumer.arena().stats().leased_pages,
            err.fence.is_drained(),
        );
        if inside == 2 && leased == 8 && !drained {
            Ok(())
        } else {
            Err(format!(
                "inside={inside} staging leased={leased} fence drained={drained}"
            ))
        }
    }));
    body.release();
    rt.block_on(async {
        assert!(err.fence.wait_until(Instant::now() + Duration::from_secs(5)).await);
        assert_eq!(
            c.consumer.arena().stats().free_pages,
            64,
            "staging pages come back after the drain"
        );
        assert_eq!(c.consumer.stats().cancelled, 1);
        // Done reaches the producer: its staging is released without waiting for TTL.
        eventually("producer pages back", || {
            node.producer.arena().stats().free_pages == 256 && node.producer.stats().quota_pages_charged == 0
        })
        .await;
    });
}

#[test]
fn zero_timeout_is_rejected_and_async_context_is_refused() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let c = rt.block_on(async { consumer_node(16, 16) });
    let k = [key(1, 0)];
    let e = c
        .consumer
        .get_blocking("127.0.0.1:1", &k, c.dst(0, 1, 1), Duration::ZERO)
        .unwrap_err();
    assert_eq!(e.error.code(), ErrorCode::InvalidArgument, "{}", e.error);
    assert!(
        e.error.to_string().contains("timeout"),
        "the message names the argument: {}",
        e.error
    );
    let c2 = c.consumer.clone();
    let dst = c.dst(0, 1, 1);
    let e = rt
        .block_on(async move { c2.get_blocking("127.0.0.1:1", &k, dst, Duration::from_secs(1)) })
        .unwrap_err();
    assert_eq!(e.error.code(), ErrorCode::InvalidArgument, "{}", e.error);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout_during_receive_drops_the_connection_and_releases_both_sides() {
    let node = producer_node(NodeOpts::default()).await;
    let c = consumer_node(64, 64);
    let keys = fill(&node.producer, 2, 3, 2);
    node.producer.faults().send_delay_us.store(300_000, Ordering::SeqCst);
    let t = std::time::Instant::now();
    let err = c
        .consumer
        .get(
            &node.addr,
            &keys,
            c.dst(0, 3, 2),
            Instant::now() + Duration::from_millis(150),
        )
        .await
        .unwrap_err();
    assert!(matches!(err.error, PeerError::Timeout { .. }), "{}", err.error);
    assert!(t.elapsed() < Duration::from_millis(150 + 50), "{:?}", t.elapsed());
    assert!(err.fence.wait_until(Instant::now() + Duration::from_secs(3)).await);
    assert_eq!(c.consumer.arena().stats().free_pages, 64);
    node.producer.faults().send_delay_us.store(0, Ordering::SeqCst);
    eventually("producer pages back", || {
        node.producer.arena().stats().free_pages == 256 && node.producer.stats().quota_pages_charged == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_storm_leaks_nothing_and_corrupts_nothing() {
    let node = producer_node(NodeOpts {
        arena_pages: 128,
        ..NodeOpts::default()
    })
    .await;
    let c = consumer_node(256, 96);
    let reqs = 16u64;
    let keys: Vec<_> = (0..reqs).map(|r| fill(&node.producer, r, 2, 2)).collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(42);
    let mut tasks = Vec::new();
    for i in 0..160u64 {
        let r = i % reqs;
        let consumer = c.consumer.clone();
        let slot = (i % 16) as u32 * 4 + 64 * (i % 4) as u32 % 192;
        let dst = c.dst(slot, 2, 2);
        let (addr, k) = (node.addr.clone(), keys[r as usize].clone());
        let deadline_ms = rng.gen_range(1..40);
        let drop_after = rng.gen_range(0..30);
        let mode = rng.gen_range(0..3);
        tasks.push(tokio::spawn(async move {
            let fut = consumer.get(&addr, &k, dst, Instant::now() + Duration::from_millis(deadline_ms));
            match mode {
                // Dropped by its caller mid-flight.
                0 => match tokio::time::timeout(Duration::from_millis(drop_after), fut).await {
                    Ok(r) => r.err().map(|f| f.fence),
                    Err(_) => None,
                },
                _ => fut.await.err().map(|f| f.fence),
            }
        }));
    }
    let mut fences = Vec::new();
    for t in tasks {
        if let Some(f) = t.await.unwrap() {
            fences.push(f);
        }
    }
    for f in &fences {
        assert!(
            f.wait_until(Instant::now() + Duration::from_secs(5)).await,
            "a drain did not finish"
        );
    }
    eventually("consumer staging all back", || {
        c.consumer.arena().stats().free_pages == 96
    })
    .await;
    eventually("no transfer still draining", || c.consumer.stats().draining == 0).await;
    eventually("producer staging all back", || {
        node.producer.arena().stats().free_pages == 128 && node.producer.stats().quota_pages_charged == 0
    })
    .await;
    // After the storm, transfers are intact.
    for r in 0..reqs {
        let l = c
            .consumer
            .get(
                &node.addr,
                &keys[r as usize],
                c.dst(200, 2, 2),
                Instant::now() + Duration::from_secs(5),
            )
            .await
            .unwrap();
        assert_eq!(l.chunks, 2);
        assert_eq!(c.corrupted_bytes(r, 0, &[200, 201]), 0);
        assert_eq!(c.corrupted_bytes(r, 1, &[202, 203]), 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producer_gone_mid_transfer_is_peer_lost_promptly() {
    let node = producer_node(NodeOpts::default()).await;
    let c = consumer_node(64, 64);
    let keys = fill(&node.producer, 3, 3, 2);
    node.producer.faults().send_delay_us.store(200_000, Ordering::SeqCst);
    let consumer = c.consumer.clone();
    let (addr, dst) = (node.addr.clone(), c.dst(0, 3, 2));
    let get = tokio::spawn(async move {
        consumer
            .get(&addr, &keys, dst, Instant::now() + Duration::from_secs(30))
            .await
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let t = std::time::Instant::now();
    node.server.shutdown().await; // every connection is torn down
    let err = get.await.unwrap().unwrap_err();
    assert!(matches!(err.error, PeerError::PeerLost { .. }), "{}", err.error);
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert!(err.fence.wait_until(Instant::now() + Duration::from_secs(2)).await);
    assert_eq!(c.consumer.arena().stats().free_pages, 64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_transfer_keeps_its_fence_until_the_landing_copy_drained() {
    let body = ParkingBody::new();
    let node = producer_node(NodeOpts::default()).await;
    let c = consumer_with_body(body.clone(), 64, 64);
    let _release = body.release_on_drop();
    let keys = fill(&node.producer, 4, 2, 4);
    let transfer = c.consumer.start_get(
        &node.addr,
        &keys,
        c.dst(0, 2, 4),
        Instant::now() + Duration::from_secs(10),
    );
    let fence = transfer.fence();
    let task = tokio::spawn(transfer);
    eventually("landing copy parked", || body.inside() == 2).await;
    task.abort(); // the caller drops the transfer mid-landing
    holds_for(Duration::from_millis(500), || {
        let (inside, drained, leased) = (
            body.inside(),
            fence.is_drained(),
            c.consumer.arena().stats().leased_pages,
        );
        if inside == 2 && !drained && leased == 8 {
            Ok(())
        } else {
            Err(format!("inside={inside} drained={drained} staging leased={leased}"))
        }
    })
    .await;
    body.release();
    assert!(fence.wait_until(Instant::now() + Duration::from_secs(5)).await);
    assert_eq!(c.consumer.arena().stats().free_pages, 64);
    // Invalid arguments fail at once with a fired fence.
    let t = c
        .consumer
        .start_get(&node.addr, &[], c.dst(0, 1, 1), Instant::now() + Duration::from_secs(1));
    assert!(t.fence().is_drained());
    assert!(matches!(t.await.unwrap_err().error, PeerError::InvalidArgument(_)));
}
