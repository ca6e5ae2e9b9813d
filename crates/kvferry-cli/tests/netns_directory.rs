//! The etcd-backed directory across real network hosts: etcd runs in a host of its
//! own, three `kvferry serve --directory etcd://...` hosts register in it, and a client
//! host reads `kvferry peers` and resolves `kvferry get --key K` (no `--peer`) through
//! it. A partitioned host leaves the listing after its TTL and comes back when healed
//! (with the same incarnation: the process never restarted); a
//! restarted process comes back with a new one; etcd killed and restarted hangs
//! nothing, known peers keep transferring, and the view recovers; a chaos run with etcd
//! restarts corrupts and leaks nothing. A rogue `serve` on another host that claims a
//! live peer's id with `--advertise` at that peer's address is refused (with the
//! secret, or without it), and the real peer stays listed and serving.
//!
//! These need the directory (`serve --directory`); where this `kvferry` lacks it they
//! print why and return. They need root and the `etcd` binary too (a skip elsewhere, a
//! failure under `CI=true`).

mod common;
mod netns;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use netns::client::{pattern, NsClient};
use netns::etcd::{etcd_available, Etcd};
use netns::load::{client_loop, Tally, DEADLINE, SLACK};
use netns::net::{Host, Network};
use netns::peers::{kvferry_supports_directory, parse_peers, wait_peers, PeerRecord};
use netns::serve::{kvferry, Serve, MODEL, PORT};
use rand::{Rng, SeedableRng};

const T: Duration = Duration::from_secs(10);
/// The directory TTL the servers run with.
const TTL: Duration = Duration::from_secs(2);

/// Three directory-registered servers (hosts 1..=3), etcd (host 0), a client host (4).
/// Fields drop in order: servers, then etcd, then the network.
struct Fleet {
    servers: Vec<Serve>,
    etcd: Etcd,
    namespace: String,
    client: Host,
    net: Network,
}

fn requires_etcd(test: &str) -> bool {
    if let Err(why) = etcd_available() {
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            panic!("{test}: no etcd in CI: {why}");
        }
        netns::skip(test, &format!("no etcd binary here ({why})"));
        return false;
    }
    true
}

fn serve_flags(etcd: &Etcd, namespace: &str, host: &Host) -> Vec<String> {
    [
        "--directory",
        &etcd.url,
        "--namespace",
        namespace,
        "--advertise",
        &host.addr(PORT),
        "--directory-ttl",
        "2s",
        "--ttl",
        "2s",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

impl Fleet {
    fn start(test: &str) -> Option<Fleet> {
        if !kvferry_supports_directory() {
            netns::skip(
                test,
                "this kvferry has no `serve --directory` (the directory is not built in yet)",
            );
            return None;
        }
        if !requires_etcd(test) {
            return None;
        }
        let net = Network::or_skip(5, test)?;
        let etcd = Etcd::start(net.host(0));
        let namespace = format!("netns-{}-{test}", std::process::id()).replace(' ', "-");
        let mut f = Fleet {
            servers: Vec::new(),
            client: net.host(4).clone(),
            etcd,
            namespace,
            net,
        };
        for i in 1..=3 {
            let s = f.serve(i);
            f.servers.push(s);
        }
        f.wait_all_listed("all three hosts listed after start-up");
        Some(f)
    }

    /// Starts (or restarts) the server of host `i` and waits until the directory lists
    /// it with its incarnation. A process that exits first (its id may still be held by
    /// the lease of a killed predecessor, for up to the TTL) is started again.
    fn serve(&self, i: usize) -> Serve {
        let host = self.net.host(i).clone();
        let flags = serve_flags(&self.etcd, &self.namespace, &host);
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let id = format!("h{i}");
        let t = Instant::now();
        loop {
            let mut s = Serve::start(&host, &flags);
            let registered_by = Instant::now() + TTL + Duration::from_secs(5);
            while s.alive() {
                let list = netns::peers::peers(&self.client, &self.etcd.url, &self.namespace).unwrap_or_default();
                if listed(&list, &id).is_some_and(|p| p.incarnation == s.incarnation) {
                    return s;
                }
                assert!(
                    Instant::now() < registered_by,
                    "{id} ({:#x}) never listed; last listing {list:?}\n{}",
                    s.incarnation,
                    s.log()
                );
                std::thread::sleep(Duration::from_millis(200));
            }
            assert!(
                t.elapsed() < TTL + Duration::from_secs(15),
                "{id} keeps exiting at start-up:\n{}",
                s.log()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn peers_until(&self, limit: Duration, what: &str, ok: impl Fn(&[PeerRecord]) -> bool) -> Vec<PeerRecord> {
        wait_peers(&self.client, &self.etcd.url, &self.namespace, limit, what, ok)
    }

    /// Waits until every server is listed, fresh, at its address, with the incarnation
    /// its process presents to a new connection now (the directory and the connection
    /// agree).
    fn wait_all_listed(&self, what: &str) -> Vec<PeerRecord> {
        let t = Instant::now();
        loop {
            let probe = NsClient::new(&self.client, "incarnation-probe");
            let want: Vec<(String, String, Option<u64>)> = self
                .servers
                .iter()
                .map(|s| {
                    let inc = probe.peer_incarnation(&s.addr, Duration::from_secs(3)).ok();
                    (format!("h{}", s.host.index), s.addr.clone(), inc)
                })
                .collect();
            let list = netns::peers::peers(&self.client, &self.etcd.url, &self.namespace);
            if let Ok(l) = &list {
                let agree = want.iter().all(|(id, addr, inc)| {
                    l.iter()
                        .any(|p| &p.id == id && &p.address == addr && Some(p.incarnation) == *inc && !p.stale)
                });
                if agree {
                    return l.clone();
                }
            }
            assert!(
                t.elapsed() < Duration::from_secs(15),
                "{what}: directory and connections disagree after 15 s\n  listed: {list:?}\n  \
                 presented (id, address, handshake incarnation): {want:?}"
            );
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    /// `kvferry get --directory ... --key K` from the client host: the bytes, or stderr.
    fn get_via_directory(&self, key: &str, timeout: &str) -> Result<Vec<u8>, String> {
        let out_file = std::env::temp_dir().join(format!(
            "kvferry-netns-dir-{}-{}-{key}.out",
            std::process::id(),
            self.namespace
        ));
        let out = kvferry(
            &self.client,
            &[
                "get",
                "--directory",
                &self.etcd.url,
                "--namespace",
                &self.namespace,
                "--key",
                key,
                "--model",
                MODEL,
                "--max-blocks",
                "1024",
                "--timeout",
                timeout,
                "--out",
                out_file.to_str().unwrap(),
            ],
            Duration::from_secs(20),
        );
        let r = if out.status.success() {
            std::fs::read(&out_file).map_err(|e| e.to_string())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        };
        let _ = std::fs::remove_file(&out_file);
        r
    }
}

fn listed<'a>(list: &'a [PeerRecord], id: &str) -> Option<&'a PeerRecord> {
    list.iter().find(|p| p.id == id)
}

#[test]
fn peers_json_is_read_in_every_shape() {
    let arr = r#"[{"id":"h1","address":"10.77.0.2:7070","incarnation":"0x1f","role":"both","age":"1s","stale":false}]"#;
    let lines = "{\"peer_id\":\"h1\",\"address\":\"10.77.0.2:7070\",\"incarnation\":31}\n";
    let obj = r#"{"peers":[{"id":"h1","address":"10.77.0.2:7070","incarnation":"31","stale":true}]}"#;
    for t in [arr, lines, obj] {
        let p = parse_peers(t).unwrap();
        assert_eq!((p[0].id.as_str(), p[0].incarnation), ("h1", 31), "{t}");
    }
    assert!(parse_peers(obj).unwrap()[0].stale);
    let fresh = r#"[{"id":"a","incarnation":1,"fresh":true},{"id":"b","incarnation":2,"state":"stale"}]"#;
    let p = parse_peers(fresh).unwrap();
    assert!(!p[0].stale && p[1].stale, "{p:?}");
    assert_eq!(parse_peers(arr).unwrap()[0].role.as_deref(), Some("both"));
    assert!(parse_peers("[]").unwrap().is_empty());
    assert!(parse_peers("").unwrap().is_empty());
    assert!(parse_peers("not json").is_err());
    assert!(
        parse_peers(r#"[{"address":"x"}]"#).is_err(),
        "a record without id is refused"
    );
}

#[test]
fn etcd_runs_in_a_host_of_its_own_and_restarts_on_its_data() {
    let test = "etcd host";
    if !requires_etcd(test) {
        return;
    }
    let Some(net) = Network::or_skip(2, test) else { return };
    let mut etcd = Etcd::start(net.host(0));
    assert!(etcd.healthy_from(net.host(1)), "etcd not reachable from another host");
    etcd.kill();
    assert!(!etcd.healthy_from(net.host(1)), "a killed etcd still answers");
    etcd.restart();
    assert!(etcd.healthy_from(net.host(1)));
    net.partition(net.host(0)).unwrap();
    let t = Instant::now();
    assert!(!etcd.healthy_from(net.host(1)), "a partitioned etcd still answers");
    assert!(t.elapsed() < Duration::from_secs(5));
    net.heal(net.host(0)).unwrap();
    assert!(etcd.healthy_from(net.host(1)));
}

#[test]
fn every_host_is_listed_and_get_resolves_through_the_directory() {
    let Some(f) = Fleet::start("directory listing") else {
        return;
    };
    let list = f.wait_all_listed("listing");
    assert_eq!(list.len(), 3, "exactly the three servers: {list:?}");
    let c = NsClient::new(&f.client, "dir-client");
    for s in &f.servers {
        let key = format!("dir-{}", s.host.index);
        c.put(&s.addr, &key, &pattern(&key, 100_000 + s.host.index), T).unwrap();
    }
    for s in &f.servers {
        let key = format!("dir-{}", s.host.index);
        let got = f
            .get_via_directory(&key, "5s")
            .unwrap_or_else(|e| panic!("get {key} via the directory: {e}"));
        assert!(got == pattern(&key, 100_000 + s.host.index), "bytes differ for {key}");
    }
    let e = f.get_via_directory("held-by-nobody", "3s").unwrap_err();
    assert!(
        e.contains("miss") || e.contains("holds"),
        "a key no peer holds is a clear miss: {e}"
    );
}

#[test]
fn a_partitioned_host_leaves_peers_after_its_ttl_and_returns_when_healed() {
    let Some(f) = Fleet::start("directory partition") else {
        return;
    };
    let c = NsClient::new(&f.client, "dir-part-client");
    let cut = &f.servers[0];
    let id = format!("h{}", cut.host.index);
    c.put(&cut.addr, "dp", &pattern("dp", 80_000), T).unwrap();
    f.net.partition(&cut.host).unwrap();
    let t = Instant::now();
    f.peers_until(
        TTL + Duration::from_secs(5),
        "partitioned host dropped after its TTL",
        |l| listed(l, &id).is_none() && l.len() == 2,
    );
    eprintln!(
        "partitioned host left the listing after {:?} (TTL {TTL:?})",
        t.elapsed()
    );
    let t = Instant::now();
    assert!(c.get(&cut.addr, "dp", DEADLINE).is_err(), "a partitioned host answered");
    assert!(
        t.elapsed() <= DEADLINE + SLACK,
        "a transfer to the cut host returned late"
    );
    f.net.heal(&cut.host).unwrap();
    let back = f.peers_until(Duration::from_secs(15), "healed host listed again", |l| {
        listed(l, &id).is_some_and(|p| !p.stale)
    });
    let now = listed(&back, &id).unwrap().incarnation;
    // The process did not restart: re-registered after its lease was lost while cut
    // off, it keeps its incarnation, so the directory and its connections agree and
    // what it held is still there.
    assert_eq!(
        now, cut.incarnation,
        "a healed host is listed with the incarnation it had (the process never restarted)"
    );
    let got = c.get(&cut.addr, "dp", T).unwrap();
    assert_eq!(
        c.restarts_seen(&cut.addr),
        0,
        "listed with the same incarnation, but the connection saw a restart"
    );
    assert!(
        got.unwrap() == pattern("dp", 80_000),
        "same incarnation, chunk lost or changed"
    );
    assert!(f.get_via_directory("dp", "5s").unwrap() == pattern("dp", 80_000));
    c.put(&cut.addr, "dp2", &pattern("dp2", 30_000), T).unwrap();
    assert!(f.get_via_directory("dp2", "5s").unwrap() == pattern("dp2", 30_000));
}

#[test]
fn a_restarted_process_is_listed_with_a_new_incarnation() {
    let Some(mut f) = Fleet::start("directory restart") else {
        return;
    };
    let old = f.servers[1].incarnation;
    let id = format!("h{}", f.servers[1].host.index);
    f.servers[1].kill();
    // Its record stays until its lease's TTL ends (a SIGKILL revokes nothing); the new
    // process registers the same id once it is free.
    f.servers[1] = f.serve(2);
    let new = f.servers[1].incarnation;
    assert_ne!(new, old);
    let list = f.peers_until(TTL + Duration::from_secs(10), "restarted host listed anew", |l| {
        listed(l, &id).is_some_and(|p| p.incarnation == new)
    });
    assert!(
        list.iter().all(|p| p.incarnation != old),
        "the old incarnation is gone: {list:?}"
    );
    let c = NsClient::new(&f.client, "dir-restart-client");
    let addr = f.servers[1].addr.clone();
    c.put(&addr, "dr", &pattern("dr", 70_000), T).unwrap();
    assert!(f.get_via_directory("dr", "5s").unwrap() == pattern("dr", 70_000));
}

#[test]
fn etcd_down_hangs_nothing_known_peers_keep_transferring_and_the_view_recovers() {
    let Some(mut f) = Fleet::start("etcd down") else { return };
    let c = NsClient::new(&f.client, "dir-etcd-client");
    for s in &f.servers {
        let key = format!("e-{}", s.host.index);
        c.put(&s.addr, &key, &pattern(&key, 60_000), T).unwrap();
    }
    f.etcd.kill();
    // `peers` returns (an error, or the listing flagged stale) instead of hanging:
    // `peers()` asserts it returned within its bound.
    let _ = netns::peers::peers(&f.client, &f.etcd.url, &f.namespace);
    let t = Instant::now();
    let r = f.get_via_directory("e-1", "3s");
    // Its 3 s timeout, plus one etcd call deadline (3 s) and the process start-up.
    assert!(
        t.elapsed() < Duration::from_secs(8),
        "get via a dead etcd took {:?}",
        t.elapsed()
    );
    if let Ok(bytes) = r {
        assert!(bytes == pattern("e-1", 60_000));
    }
    // Peers known by address keep transferring for longer than the directory TTL.
    let until = Instant::now() + TTL * 2;
    let mut rounds = 0;
    while Instant::now() < until || rounds == 0 {
        for s in &f.servers {
            let key = format!("e-{}", s.host.index);
            let got = c
                .get(&s.addr, &key, T)
                .unwrap_or_else(|e| panic!("{key} with etcd down: {e}"));
            assert!(got.unwrap() == pattern(&key, 60_000));
        }
        rounds += 1;
    }
    f.etcd.restart();
    f.peers_until(Duration::from_secs(20), "view recovered after etcd restart", |l| {
        l.len() == 3 && l.iter().all(|p| !p.stale)
    });
    assert!(f.get_via_directory("e-2", "5s").unwrap() == pattern("e-2", 60_000));
}

#[test]
fn chaos_with_the_directory_and_etcd_restarts_corrupts_and_leaks_nothing() {
    let Some(mut f) = Fleet::start("directory chaos") else {
        return;
    };
    let seed: u64 = std::env::var("KVFERRY_NETNS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("directory chaos: seed {seed} (reproduce: KVFERRY_NETNS_SEED={seed})");
    let addrs: Vec<String> = f.servers.iter().map(|s| s.addr.clone()).collect();
    let c = Arc::new(NsClient::new(&f.client, "dir-chaos-client"));
    let (stop, tally) = (Arc::new(AtomicBool::new(false)), Arc::new(Tally::default()));
    let worker = {
        let (c, addrs, stop, tally) = (c.clone(), addrs.clone(), stop.clone(), tally.clone());
        std::thread::spawn(move || client_loop(&c, "d", &addrs, seed, &stop, &tally))
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (mut partitions, mut kills, mut etcd_restarts, mut dir_gets) = (0, 0, 0, 0);
    c.put(&addrs[0], "chaos-dir", &pattern("chaos-dir", 40_000), T).unwrap();
    let end = Instant::now() + Duration::from_secs(15);
    while Instant::now() < end {
        std::thread::sleep(Duration::from_millis(rng.gen_range(200..600)));
        let s = rng.gen_range(0..f.servers.len());
        match rng.gen_range(0..4) {
            0 => {
                let h = f.servers[s].host.clone();
                f.net.partition(&h).unwrap();
                std::thread::sleep(Duration::from_millis(rng.gen_range(300..3000)));
                f.net.heal(&h).unwrap();
                partitions += 1;
            }
            1 => {
                let i = f.servers[s].host.index;
                f.servers[s].kill();
                f.servers[s] = f.serve(i);
                kills += 1;
            }
            2 => {
                f.etcd.kill();
                std::thread::sleep(Duration::from_millis(rng.gen_range(200..1500)));
                f.etcd.restart();
                etcd_restarts += 1;
            }
            _ => {
                // Resolved through the directory: the exact bytes, or a clean failure
                // (the holder may have restarted or be cut off) — never a hang.
                let t = Instant::now();
                if let Ok(bytes) = f.get_via_directory("chaos-dir", "2s") {
                    assert!(
                        bytes == pattern("chaos-dir", 40_000),
                        "seed {seed}: wrong bytes via the directory"
                    );
                }
                assert!(
                    t.elapsed() < Duration::from_secs(8),
                    "seed {seed}: get via the directory hung"
                );
                dir_gets += 1;
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    worker.join().expect("client loop panicked");
    eprintln!(
        "directory chaos seed {seed}: {}; {partitions} partitions, {kills} kills, {etcd_restarts} etcd restarts, \
         {dir_gets} gets via the directory",
        tally.summary()
    );
    assert_eq!(Tally::get(&tally.corrupted), 0, "seed {seed}: corrupted transfers");
    assert_eq!(Tally::get(&tally.late), 0, "seed {seed}: late returns");
    assert!(
        Tally::get(&tally.landed) >= 10,
        "seed {seed}: too few transfers got through"
    );
    f.wait_all_listed("every host listed, fresh, after the chaos");
    let t = Instant::now();
    for s in &f.servers {
        let left = Duration::from_secs(8).saturating_sub(t.elapsed());
        s.wait_no_leaks(left).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    }
    let st = c.arena().stats();
    assert_eq!(
        st.free_pages, st.total_pages,
        "seed {seed}: client staging pages leaked"
    );
}

#[test]
fn a_rogue_advertising_a_live_peers_address_from_another_host_is_refused() {
    let Some(f) = Fleet::start("directory takeover") else {
        return;
    };
    let victim = &f.servers[0];
    let id = format!("h{}", victim.host.index);
    let c = NsClient::new(&f.client, "takeover-client");
    c.put(&victim.addr, "mine", &pattern("mine", 40_000), T).unwrap();
    // From the client host: same id, the victim's address advertised; once with the
    // fleet's secret (its probe reaches the victim, which answers alive), once with a
    // wrong one (nothing proven: it waits for the victim's lease, which stays alive).
    for secret in [None, Some("not-the-fleet-secret-but-as-long-as-one")] {
        let mut args = vec![
            "serve",
            "--listen",
            "0.0.0.0:7400",
            "--model",
            MODEL,
            "--blocks",
            "64",
            "--arena",
            "4MiB",
            "--page-size",
            "64KiB",
            "--peer-id",
            &id,
            "--directory",
            &f.etcd.url,
            "--namespace",
            &f.namespace,
            "--directory-ttl",
            "2s",
            "--advertise",
            &victim.addr,
        ];
        if let Some(s) = secret {
            args.extend(["--secret", s]);
        }
        let t = Instant::now();
        let out = kvferry(&f.client, &args, Duration::from_secs(20));
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        );
        assert!(
            !stdout.contains("registered as"),
            "the rogue (secret {secret:?}) registered:\n{stdout}\n{stderr}"
        );
        assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
        assert!(
            stderr.contains(&format!(
                "peer id {id} is already registered by a live process at {}",
                victim.addr
            )),
            "secret {secret:?}: {stderr}"
        );
        // With the secret the victim proves itself at once; without, the lease wait is
        // bounded by the victim's TTL plus a call deadline.
        let limit = if secret.is_none() {
            Duration::from_secs(5)
        } else {
            TTL + Duration::from_secs(8)
        };
        assert!(t.elapsed() < limit, "refused after {:?}", t.elapsed());
    }
    // The victim was never displaced: listed with its incarnation, registered, serving.
    let list = f.wait_all_listed("the victim stays listed after the takeover attempts");
    assert_eq!(listed(&list, &id).map(|p| p.incarnation), Some(victim.incarnation));
    assert_eq!(victim.metric("kvferry_directory_registered"), Some(1.0));
    assert!(f.get_via_directory("mine", "5s").unwrap() == pattern("mine", 40_000));
}
