//! The async-output primitive: device outputs copied to a lease on a copy stream after
//! the main stream's work, fetched within a deadline or failed typed.

use std::time::Duration;

use kvferry::copy::{CopyConfig, CopyEngine};
use kvferry::device::{AsyncOutput, Device, DeviceError, Fault, FaultRule, HostDevice, SimConfig, SimDevice, Trigger};
use kvferry::mem::{Arena, ArenaConfig};
use tokio::time::Instant;

fn check(a: &Arena) {
    let s = a.stats();
    assert_eq!(
        s.free_pages + s.leased_pages + s.quarantined_pages,
        s.total_pages,
        "{s:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn get_returns_every_output_in_order() {
    let dev = SimDevice::new(SimConfig::new(0).with_latency(Duration::from_micros(50))).unwrap();
    let a = Arena::new(ArenaConfig::new(4096, 4).unpinned()).unwrap();
    let tokens = dev.alloc(64).unwrap();
    tokens.write(0, &(0..64u8).collect::<Vec<_>>()).unwrap();
    let logprobs = dev.alloc(5000).unwrap();
    logprobs.write(0, &[0xCD; 5000]).unwrap();
    let main = dev.create_stream("main").unwrap();
    let copy = dev.create_stream("output").unwrap();
    let out = AsyncOutput::start(
        &main,
        &copy,
        &[tokens.whole(), logprobs.slice(1000, 3000), tokens.slice(8, 8)],
        a.try_alloc(2).unwrap(),
        "sampled tokens step 1",
    )
    .unwrap();
    let bytes = out.get_for(Duration::from_secs(1)).await.unwrap();
    assert_eq!(bytes.parts(), &[0..64, 64..3064, 3064..3072]);
    assert_eq!(bytes.part(0).unwrap(), (0..64u8).collect::<Vec<_>>());
    assert_eq!(bytes.part(1).unwrap(), vec![0xCD; 3000]);
    assert_eq!(bytes.part(2).unwrap(), (8..16u8).collect::<Vec<_>>());
    assert!(matches!(bytes.part(3), Err(DeviceError::InvalidArgument(_))));
    drop(bytes);
    assert_eq!(a.stats().free_pages, 4);
}

#[tokio::test(start_paused = true)]
async fn stuck_copy_event_times_out_typed_and_quarantines() {
    let dev = SimDevice::new(SimConfig::new(6)).unwrap();
    let a = Arena::new(ArenaConfig::new(4096, 2).unpinned()).unwrap();
    let out_buf = dev.alloc(128).unwrap();
    let main = dev.create_stream("main").unwrap();
    let copy = dev.create_stream("output").unwrap();
    // The copy (the second operation: the first is the main stream's record) never
    // completes — the accelerator-event hang this primitive must bound.
    dev.inject(FaultRule {
        fault: Fault::NeverComplete,
        trigger: Trigger::Nth(2),
    })
    .unwrap();
    let out = AsyncOutput::start(
        &main,
        &copy,
        &[out_buf.whole()],
        a.try_alloc(1).unwrap(),
        "async output step 17",
    )
    .unwrap();
    let ev = out.event().clone();
    let main_ev = out.main_event().clone();
    let t0 = Instant::now();
    let err = out.get_for(Duration::from_millis(300)).await.unwrap_err();
    match &err {
        DeviceError::Timeout { op, rank, waited } => {
            assert_eq!(op, "async output step 17");
            assert_eq!(*rank, 6);
            assert_eq!(*waited, Duration::from_millis(300));
        }
        other => panic!("expected a timeout, got {other}"),
    }
    assert_eq!(t0.elapsed(), Duration::from_millis(300));
    assert!(
        main_ev.is_complete(),
        "the main stream finished; the copy is what hangs"
    );
    assert_eq!(a.stats().quarantined_pages, 1);
    check(&a);
    dev.release_stuck();
    ev.wait(Instant::now() + Duration::from_secs(1)).await.unwrap();
    assert_eq!(a.stats().free_pages, 2);
    check(&a);
}

#[tokio::test(start_paused = true)]
async fn output_waits_for_the_main_stream() {
    let dev = SimDevice::new(SimConfig::new(2)).unwrap();
    let a = Arena::new(ArenaConfig::new(4096, 1).unpinned()).unwrap();
    let buf = dev.alloc(16).unwrap();
    let main = dev.create_stream("main").unwrap();
    let copy = dev.create_stream("output").unwrap();
    // The main stream's next operation (the record the output waits for) stalls.
    dev.inject(FaultRule {
        fault: Fault::Stall,
        trigger: Trigger::Next,
    })
    .unwrap();
    let out = AsyncOutput::start(&main, &copy, &[buf.whole()], a.try_alloc(1).unwrap(), "out").unwrap();
    let main_ev = out.main_event().clone();
    // Written after submission but before the main stream finishes: the output sees it.
    buf.write(0, b"late main result").unwrap();
    assert!(matches!(
        main_ev.wait(Instant::now() + Duration::from_millis(10)).await,
        Err(DeviceError::Timeout { .. })
    ));
    assert!(!out.event().is_complete());
    dev.release_stuck();
    let bytes = out.get(Instant::now() + Duration::from_secs(1)).await.unwrap();
    assert_eq!(bytes.part(0).unwrap(), b"late main result");
}

#[tokio::test(start_paused = true)]
async fn bad_arguments_are_invalid() {
    let dev = SimDevice::new(SimConfig::new(0)).unwrap();
    let a = Arena::new(ArenaConfig::new(4096, 1).unpinned()).unwrap();
    let big = dev.alloc(5000).unwrap();
    let main = dev.create_stream("main").unwrap();
    let copy = dev.create_stream("output").unwrap();
    let err = AsyncOutput::start(&main, &copy, &[big.whole()], a.try_alloc(1).unwrap(), "too big").unwrap_err();
    assert!(matches!(err, DeviceError::InvalidArgument(_)), "{err}");
    assert_eq!(a.stats().free_pages, 1);
    let out = AsyncOutput::start(&main, &copy, &[big.slice(0, 10)], a.try_alloc(1).unwrap(), "zero").unwrap();
    assert!(matches!(
        out.get_for(Duration::ZERO).await,
        Err(DeviceError::InvalidArgument(_))
    ));
    // The dropped output's lease returns once its copy completed.
    copy.record("flush")
        .unwrap()
        .wait(Instant::now() + Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(a.stats().free_pages, 1);
}

#[test]
fn host_output_thread_gets_bytes_blocking() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let engine = CopyEngine::new(CopyConfig {
        threads: 1,
        ..CopyConfig::default()
    })
    .unwrap();
    let dev = HostDevice::with_runtime(engine, 9, rt.handle().clone());
    let a = Arena::new(ArenaConfig::new(4096, 2).unpinned()).unwrap();
    let buf = dev.alloc(6000).unwrap();
    buf.write(0, &[0x42; 6000]).unwrap();
    let main = dev.create_stream("main").unwrap();
    let copy = dev.create_stream("output").unwrap();
    let out = AsyncOutput::start(&main, &copy, &[buf.whole()], a.try_alloc(2).unwrap(), "host output").unwrap();
    // An output thread without a runtime of its own.
    let bytes = std::thread::spawn(move || out.get_blocking(std::time::Instant::now() + Duration::from_secs(60)))
        .join()
        .unwrap()
        .unwrap();
    assert_eq!(bytes.part(0).unwrap(), vec![0x42; 6000]);
    let lease = bytes.into_lease();
    assert_eq!(lease.page_count(), 2);
}
