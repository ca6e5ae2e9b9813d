//! Transfers across real network hosts (network namespaces joined by a bridge): over a
//! `tbf`-shaped link with the `kvferry put`/`get` commands, over a delayed link and
//! over a lossy, stalling link (the tests' own forwarder) with the library client.
//! Every landed byte is compared with what was put. Run as root; elsewhere these skip
//! with a message (a failure under `CI=true`).

mod common;
mod netns;

use std::time::{Duration, Instant};

use kvferry::peer::PeerError;
use netns::client::{pattern, NsClient};
use netns::forwarder::{Faults, Forwarder};
use netns::net::Network;
use netns::serve::{kvferry, Serve, MODEL};

const T: Duration = Duration::from_secs(10);

#[test]
fn put_and_get_commands_over_shaped_links_are_byte_exact_and_rate_bound() {
    let Some(net) = Network::or_skip(3, "shaped links") else {
        return;
    };
    let (client, slow, fast) = (net.host(0), net.host(1), net.host(2));
    net.shape(slow, "40mbit").unwrap();
    net.shape(fast, "1gbit").unwrap();
    let servers = [Serve::start(slow, &[]), Serve::start(fast, &[])];
    let dir = std::env::temp_dir().join(format!("kvferry-netns-shaped-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let len = 1 << 20;
    for s in &servers {
        let key = format!("doc-{}", s.host.index);
        let data = pattern(&key, len);
        let input = dir.join(format!("{key}.in"));
        let output = dir.join(format!("{key}.out"));
        std::fs::write(&input, &data).unwrap();
        let t = Instant::now();
        let put = [
            "put",
            "--peer",
            &s.addr,
            "--key",
            &key,
            "--file",
            input.to_str().unwrap(),
        ];
        let out = kvferry(client, &put, T);
        assert!(out.status.success(), "put: {}", String::from_utf8_lossy(&out.stderr));
        let get = [
            "get",
            "--peer",
            &s.addr,
            "--key",
            &key,
            "--model",
            MODEL,
            "--max-blocks",
            "1024",
            "--out",
            output.to_str().unwrap(),
        ];
        let out = kvferry(client, &get, T);
        let took = t.elapsed();
        assert!(out.status.success(), "get: {}", String::from_utf8_lossy(&out.stderr));
        assert!(
            std::fs::read(&output).unwrap() == data,
            "bytes differ after {}",
            s.host.ns
        );
        if s.host.index == slow.index {
            // One MiB crossed the 40 Mbit/s link each way; the bucket lets its 256 KiB burst
            // through at once, so at least 2 x 768 KiB x 8 / 40 Mbit/s = 0.31 s.
            assert!(
                took >= Duration::from_millis(300),
                "the tbf shaping is not in effect: {took:?}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_delayed_link_moves_every_byte_and_costs_its_round_trips() {
    let Some(net) = Network::or_skip(3, "delayed link") else {
        return;
    };
    let (h_client, h_router, h_server) = (net.host(0), net.host(1), net.host(2));
    let server = Serve::start(h_server, &[]);
    // 25 ms each way between the client and the server: a 50 ms round trip.
    let fwd = Forwarder::start(h_router, 7100, &server.addr, Faults::delay(Duration::from_millis(25)));
    let c = NsClient::new(h_client, "delayed-client");
    for i in 0..4 {
        let key = format!("delayed-{i}");
        let data = pattern(&key, 64 << 10 << i);
        c.put(&fwd.addr, &key, &data, T).unwrap();
        let t = Instant::now();
        let got = c.get(&fwd.addr, &key, T).unwrap().expect("a hit");
        let took = t.elapsed();
        assert!(got == data, "bytes differ for {key}");
        assert!(
            took >= Duration::from_millis(50),
            "a get took {took:?}: less than one round trip"
        );
    }
    assert!(fwd.connections() >= 1);
}

#[test]
fn a_lossy_stalling_link_fails_typed_and_never_lands_a_wrong_byte() {
    let Some(net) = Network::or_skip(3, "lossy link") else {
        return;
    };
    let (h_client, h_router, h_server) = (net.host(0), net.host(1), net.host(2));
    let server = Serve::start(h_server, &["--ttl", "2s"]);
    let seed = std::env::var("KVFERRY_NETNS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(7);
    let faults = Faults {
        delay: Duration::from_millis(2),
        rate: Some(200 << 20),
        cut_ppm: 400_000,
        stall_ppm: 300_000,
        stall: Duration::from_millis(300),
        within: 512 << 10,
        seed,
    };
    let fwd = Forwarder::start(h_router, 7100, &server.addr, faults);
    let c = NsClient::new(h_client, "lossy-client");
    let (mut landed, mut failed) = (0, 0);
    for i in 0..10 {
        let key = format!("lossy-{i}");
        let data = pattern(&key, (256 << 10) + i * 12_345);
        let mut verified = false;
        for _attempt in 0..8 {
            let t = Instant::now();
            let r = c
                .put(&fwd.addr, &key, &data, Duration::from_secs(3))
                .map(|_| None::<Vec<u8>>)
                .and_then(|_| c.get(&fwd.addr, &key, Duration::from_secs(3)));
            assert!(
                t.elapsed() < Duration::from_secs(8),
                "put+get returned late: {:?}",
                t.elapsed()
            );
            match r {
                Ok(Some(got)) => {
                    assert!(got == data, "seed {seed}: wrong bytes landed for {key}");
                    landed += 1;
                    verified = true;
                    break;
                }
                Ok(None) => panic!("seed {seed}: {key} missed right after its put"),
                Err(e) => {
                    assert!(
                        matches!(e, PeerError::PeerLost { .. } | PeerError::Timeout { .. }),
                        "seed {seed}: untyped or unexpected failure: {e}"
                    );
                    failed += 1;
                }
            }
        }
        assert!(verified, "seed {seed}: {key} never got through in 8 attempts");
    }
    let cuts = fwd.stats.cuts.load(std::sync::atomic::Ordering::Relaxed);
    let stalls = fwd.stats.stalls.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!("lossy link, seed {seed}: {landed} landed, {failed} failed attempts, {cuts} cuts, {stalls} stalls");
    assert!(cuts + stalls > 0, "seed {seed}: the forwarder injected no fault");
    assert_eq!(
        c.arena().stats().free_pages,
        c.arena().stats().total_pages,
        "client pages back"
    );
    // The server's staged leases end by Done or by their 2 s TTL: nothing leaks.
    let t = Instant::now();
    loop {
        let leased = server.metric(r#"kvferry_arena_pages{role="producer",state="leased"}"#);
        let staged = server.metric(r#"kvferry_staged_leases{role="producer"}"#);
        if leased == Some(0.0) && staged == Some(0.0) {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(6),
            "server pages still leased: {leased:?} pages, {staged:?} leases\n{}",
            server.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}
