//! Raw bytes against a running `kvferry serve` process: garbage, truncated frames,
//! lengths of 2^63, a slow-loris client that never finishes a frame, and a thousand
//! idle connections — while a well-behaved client keeps getting correct bytes and the
//! server's memory stays bounded.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::Serve;
use kvferry::copy::{CopyConfig, CopyEngine};
use kvferry::layout::{Arrangement, KvLayout, Preset};
use kvferry::mem::{Arena, ArenaConfig, Region};
use kvferry::net::NetConfig;
use kvferry::peer::{Consumer, ConsumerConfig, Destination};
use kvferry::wire::{ChunkKey, FrameHeader, FrameKind};

fn rss_kib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = s.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Sends `bytes` on a fresh connection and reports whether the server closed it
/// (read returns EOF or an error) within `within`.
fn closed_after(addr: &str, bytes: &[u8], within: Duration) -> bool {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(within)).unwrap();
    let _ = s.write_all(bytes);
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue, // an Error frame before the close
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut => {
                return false
            }
            Err(_) => return true,
        }
    }
}

#[test]
fn running_server_survives_garbage_oversize_slow_loris_and_idle_floods() {
    let serve = Serve::start(
        Serve::command()
            .args(["--blocks", "256", "--arena", "8MiB"])
            .args(["--page-size", "64KiB", "--io-timeout", "500ms"])
            .stderr(Stdio::null()),
        Duration::from_secs(30),
        false,
    );
    let addr = serve.addr.clone();
    let pid = serve.child.id();

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let layout = KvLayout::preset(Preset::Tiny, 16, Arrangement::FullyContiguous).unwrap();
    let region = Arc::new(Region::host("dst", layout.region_bytes()).unwrap());
    let consumer = rt.block_on(async {
        let arena = Arena::new(ArenaConfig::new(64 << 10, 16).unpinned()).unwrap();
        let engine = CopyEngine::new(CopyConfig {
            threads: 1,
            ..CopyConfig::default()
        })
        .unwrap();
        Consumer::new(arena, engine, ConsumerConfig::new(NetConfig::new("good"))).unwrap()
    });
    let key = ChunkKey::from_name("good");
    let data: Vec<u8> = (0..layout.chunk_bytes(2)).map(|i| (i % 253) as u8).collect();
    let good_get = |round: u8| {
        rt.block_on(async {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            region.fill(0, layout.region_bytes(), round).unwrap();
            let dst = Destination::from_layout(region.clone(), &layout, vec![vec![0, 1]]).expect("valid destination");
            let landed = consumer.get(&addr, &[key], dst, deadline).await.unwrap();
            assert_eq!(landed.chunks, 1);
            assert_eq!(region.to_vec(0, data.len()).unwrap(), data, "round {round}");
        })
    };
    rt.block_on(consumer.put(&addr, key, &data, tokio::time::Instant::now() + Duration::from_secs(5)))
        .unwrap();
    good_get(1);
    let rss_before = rss_kib(pid);

    // Garbage instead of a handshake.
    assert!(closed_after(
        &addr,
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        Duration::from_secs(3)
    ));
    assert!(closed_after(&addr, &[0xFF; 4096], Duration::from_secs(3)));
    // A well-formed header announcing 2^63 bytes: refused from the header alone.
    let huge = FrameHeader {
        kind: FrameKind::Control,
        request_id: 1,
        len: 1 << 63,
        checksum: 0,
    }
    .encode();
    assert!(closed_after(&addr, &huge, Duration::from_secs(3)));
    let huge = FrameHeader {
        kind: FrameKind::Bulk,
        request_id: 1,
        len: u64::MAX,
        checksum: 0,
    }
    .encode();
    assert!(closed_after(&addr, &huge, Duration::from_secs(3)));
    // Truncated: half a header, then nothing (the handshake timeout closes it).
    assert!(closed_after(&addr, &huge[..10], Duration::from_secs(6)));
    good_get(2);

    // Slow loris: one header byte every 100 ms, never a whole frame.
    let mut loris = TcpStream::connect(&addr).unwrap();
    let t = Instant::now();
    let mut closed = false;
    let frame = FrameHeader {
        kind: FrameKind::Control,
        request_id: 1,
        len: 10,
        checksum: 0,
    }
    .encode();
    for b in frame.iter().cycle().take(200) {
        if loris.write_all(&[*b]).is_err() {
            closed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
        if t.elapsed() > Duration::from_secs(8) {
            break;
        }
    }
    assert!(
        closed,
        "a slow-loris client must be cut off (handshake/io timeout), not served forever"
    );
    good_get(3);

    // A thousand idle connections, and the good client still works.
    let mut idle = Vec::new();
    for _ in 0..1000 {
        match TcpStream::connect(&addr) {
            Ok(s) => idle.push(s),
            Err(e) => panic!("connect {} failed: {e}", idle.len()),
        }
    }
    good_get(4);
    let rss_after = rss_kib(pid);
    assert!(
        rss_after < rss_before + 64 * 1024,
        "server memory grew from {rss_before} KiB to {rss_after} KiB under bad input"
    );
    drop(idle);
    good_get(5);
}
