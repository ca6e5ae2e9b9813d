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

mod netns;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry::peer::PeerError;
use netns::client::{pattern, NsClient};
use netns::net::Network;
use netns::serve::Serve;
use rand::{Rng, SeedableRng};

const DEADLINE: Duration = Duration::from_secs(2);
const SLACK: Duration = Duration::from_millis(1500);
const SERVE_FLAGS: &[&str] = &["--ttl", "2s"];

#[derive(Default)]
struct Tally {
    attempts: AtomicU64,
    landed: AtomicU64,
    misses: AtomicU64,
    errors: AtomicU64,
    corrupted: AtomicU64,
    late: AtomicU64,
}

/// One client's loop: put a chunk to a random server, get it back (from the same
/// server), verify, until `stop`.
fn client_loop(c: &NsClient, name: &str, servers: &[String], seed: u64, stop: &AtomicBool, tally: &Tally) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let addr = &servers[rng.gen_range(0..servers.len())];
        let len = rng.gen_range(1_000..400_000usize);
        let key = format!("{name}-{n}-{len}");
        let data = pattern(&key, len);
        tally.attempts.fetch_add(1, Ordering::Relaxed);
        let t = Instant::now();
        let put = c.put(addr, &key, &data, DEADLINE);
        note_time(tally, t, &key, "put");
        if let Err(e) = put {
            check_typed(&e, &key);
            tally.errors.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let t = Instant::now();
        let got = c.get(addr, &key, DEADLINE);
        note_time(tally, t, &key, "get");
        match got {
            Ok(Some(bytes)) if bytes == data => {
                tally.landed.fetch_add(1, Ordering::Relaxed);
            }
            Ok(Some(bytes)) => {
                eprintln!("CORRUPTED {key}: {} bytes landed, {} expected", bytes.len(), data.len());
                tally.corrupted.fetch_add(1, Ordering::Relaxed);
            }
            // The server was restarted between the put and the get.
            Ok(None) => {
                tally.misses.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                check_typed(&e, &key);
                tally.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

fn note_time(tally: &Tally, t: Instant, key: &str, op: &str) {
    let took = t.elapsed();
    if took > DEADLINE + SLACK {
        eprintln!("LATE {op} {key}: returned after {took:?}, deadline {DEADLINE:?}");
        tally.late.fetch_add(1, Ordering::Relaxed);
    }
}

fn check_typed(e: &PeerError, key: &str) {
    assert!(
        !matches!(e, PeerError::InvalidArgument(_)),
        "{key}: a fault surfaced as an invalid argument: {e}"
    );
}

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

    let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
    eprintln!(
        "netns chaos seed {seed}: {} transfers, {} landed and verified, {} misses after restarts, \
         {} typed errors, {} corrupted, {} late; {partitions} partitions, {port_downs} ports down, {kills} kills",
        get(&tally.attempts),
        get(&tally.landed),
        get(&tally.misses),
        get(&tally.errors),
        get(&tally.corrupted),
        get(&tally.late)
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
        loop {
            let text = s.try_metrics().unwrap_or_default();
            let m = |name: &str| netns::serve::metric_in(&text, name);
            let leased = m(r#"kvferry_arena_pages{role="producer",state="leased"}"#);
            let quarantined = m(r#"kvferry_arena_pages{role="producer",state="quarantined"}"#);
            let staged = m(r#"kvferry_staged_leases{role="producer"}"#);
            if leased == Some(0.0) && staged == Some(0.0) && quarantined == Some(0.0) {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(8),
                "seed {seed}: {} leaks: leased pages {leased:?}, staged leases {staged:?}, quarantined {quarantined:?}",
                s.addr
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    for c in &clients {
        let st = c.arena().stats();
        assert_eq!(
            st.free_pages, st.total_pages,
            "seed {seed}: client staging pages leaked: {st:?}"
        );
    }
}
