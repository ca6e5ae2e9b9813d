//! A chaos run across real network hosts: two client hosts move chunks to and from
//! three `kvferry serve` hosts while a seeded chaos loop partitions hosts (nftables
//! drop), takes switch ports down and SIGKILLs and restarts server processes. Every
//! landed byte is verified (0 corrupted), every call returns within its deadline plus
//! a small bound (0 late), and once everything is healed and the servers' 2 s lease TTL
//! has passed, every server's metrics show no leased page, no staged lease and no
//! quarantined page, and every client's staging arena is whole (0 leaked).
//!
//! Seed: `KVFERRY_NETNS_SEED` (printed); length: `KVFERRY_NETNS_CHAOS_SECS` (default 15).
//! Run as root; elsewhere it skips with a message (a failure under `CI=true`).

mod common;
mod netns;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use netns::client::{pattern, NsClient};
use netns::load::{client_loop, Tally};
use netns::net::Network;
use netns::serve::Serve;
use rand::{Rng, SeedableRng};

const SERVE_FLAGS: &[&str] = &["--ttl", "2s"];

#[test]
fn chaos_across_hosts_corrupts_nothing_leaks_nothing_and_is_never_late() {
    let Some(net) = Network::or_skip(5, "chaos across hosts") else {
        return;
    };
    let seed: u64 = std::env::var("KVFERRY_NETNS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    let secs: u64 = std::env::var("KVFERRY_NETNS_CHAOS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(15)
        .min(45);
    eprintln!("netns chaos: seed {seed}, {secs} s (reproduce: KVFERRY_NETNS_SEED={seed})");
    let server_hosts = [1, 2, 3];
    let mut servers: Vec<Serve> = server_hosts
        .iter()
        .map(|&i| Serve::start(net.host(i), SERVE_FLAGS))
        .collect();
    let addrs: Vec<String> = servers.iter().map(|s| s.addr.clone()).collect();
    let clients = [
        Arc::new(NsClient::new(net.host(0), "chaos-a")),
        Arc::new(NsClient::new(net.host(4), "chaos-b")),
    ];
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let workers: Vec<_> = clients
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let (c, addrs, stop, tally) = (c.clone(), addrs.clone(), stop.clone(), tally.clone());
            std::thread::spawn(move || client_loop(&c, &format!("c{i}"), &addrs, seed ^ (i as u64 + 1), &stop, &tally))
        })
        .collect();

    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (mut partitions, mut port_downs, mut kills) = (0, 0, 0);
    let end = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < end {
        std::thread::sleep(Duration::from_millis(rng.gen_range(200..700)));
        let s = rng.gen_range(0..servers.len());
        let host = servers[s].host.clone();
        match rng.gen_range(0..3) {
            0 => {
                net.partition(&host).unwrap();
                std::thread::sleep(Duration::from_millis(rng.gen_range(300..1500)));
                net.heal(&host).unwrap();
                partitions += 1;
            }
            1 => {
                net.set_link(&host, false).unwrap();
                std::thread::sleep(Duration::from_millis(rng.gen_range(300..1500)));
                net.set_link(&host, true).unwrap();
                port_downs += 1;
            }
            _ => {
                let old = servers[s].incarnation;
                servers[s].kill();
                servers[s] = Serve::start(&host, SERVE_FLAGS);
                assert_ne!(servers[s].incarnation, old, "restart kept the incarnation");
                kills += 1;
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().expect("client loop panicked");
    }

    let get = Tally::get;
    eprintln!(
        "netns chaos seed {seed}: {}; {partitions} partitions, {port_downs} ports down, {kills} kills",
        tally.summary()
    );
    assert_eq!(get(&tally.corrupted), 0, "seed {seed}: corrupted transfers");
    assert_eq!(get(&tally.late), 0, "seed {seed}: calls returned past their deadline");
    assert!(
        get(&tally.landed) >= 20,
        "seed {seed}: too few transfers got through to mean anything"
    );

    // Everything healed: each server serves, and once the 2 s TTL has passed nothing
    // is leased anywhere.
    for (s, c) in servers.iter().zip(clients.iter().cycle()) {
        let key = format!("after-{}", s.host.index);
        c.put(&s.addr, &key, &pattern(&key, 50_000), Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("seed {seed}: {} after the run: {e}", s.addr));
        let got = c.get(&s.addr, &key, Duration::from_secs(10)).unwrap();
        assert!(
            got.unwrap() == pattern(&key, 50_000),
            "seed {seed}: bytes differ after the run"
        );
    }
    let t = Instant::now();
    for s in &servers {
        let left = Duration::from_secs(8).saturating_sub(t.elapsed());
        s.wait_no_leaks(left).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    }
    for c in &clients {
        let st = c.arena().stats();
        assert_eq!(
            st.free_pages, st.total_pages,
            "seed {seed}: client staging pages leaked: {st:?}"
        );
    }
}
