//! The etcd directory through the command: `serve --directory etcd://...` processes,
//! `peers`, `get --key` without `--peer`, duplicate ids, SIGKILL → `Lost` within the
//! lease TTL + 1 s, a restart → `Restarted`, `peers` against an etcd that is down, and
//! records forged behind a live peer's back (taken back at once when their holder
//! cannot prove the fleet's secret).

mod common;
#[path = "../../kvferry/tests/common/etcd.rs"]
mod etcd;

use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{text, Serve};
use etcd::next_event;
use kvferry::directory::etcd::{EtcdConfig, EtcdDirectory};
use kvferry::directory::{Directory, PeerEvent};

/// A child process killed when dropped (also when the test fails).
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// How long a `serve` may take to print where it listens.
const START: Duration = Duration::from_secs(60);

fn spawn_serve(e: &etcd::Etcd, listen: &str, id: &str) -> Result<Serve, String> {
    Serve::spawn(
        Serve::command_on(listen)
            .args(["--blocks", "256"])
            .args(["--arena", "4MiB", "--page-size", "64KiB", "--copy-threads", "1"])
            .args(["--directory", &e.url(), "--namespace", "cli", "--directory-ttl", "2s"])
            .args(["--peer-id", id, "--role", "prefill"])
            .stderr(Stdio::piped()),
        START,
        false,
    )
}

fn serve(e: &etcd::Etcd, id: &str) -> Serve {
    spawn_serve(e, "127.0.0.1:0", id).unwrap_or_else(|err| panic!("serve {id} did not start: {err}"))
}

fn kvferry(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run kvferry")
}

fn peers(e: &etcd::Etcd) -> Vec<String> {
    let out = kvferry(&["peers", "--directory", &e.url(), "--namespace", "cli"]);
    assert!(out.status.success(), "peers failed: {}", text(&out.stderr));
    text(&out.stdout).lines().map(str::to_string).collect()
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

async fn watcher(e: &etcd::Etcd) -> Arc<EtcdDirectory> {
    let mut c = EtcdConfig::new(vec![e.endpoint()], "cli");
    c.call_timeout = Duration::from_secs(1);
    c.stale_after = Duration::from_secs(1);
    let d = EtcdDirectory::connect(c).await.unwrap();
    d.wait_listed(Duration::from_secs(5)).await.unwrap();
    Arc::new(d)
}

#[test]
fn peers_lists_three_serves_and_get_finds_the_key_without_a_peer() {
    let Some(e) = etcd::Etcd::start() else { return };
    let nodes: Vec<Serve> = ["n0", "n1", "n2"].iter().map(|id| serve(&e, id)).collect();
    assert!(nodes[0].line.contains("; registered as n0 at "), "{}", nodes[0].line);

    let lines = peers(&e);
    assert_eq!(lines.len(), 3, "{lines:?}");
    for (n, id) in nodes.iter().zip(["n0", "n1", "n2"]) {
        let l = lines.iter().find(|l| l.starts_with(&format!("{id} "))).expect(id);
        assert!(
            l.contains(&n.addr) && l.contains("role=prefill") && l.contains("incarnation=0x"),
            "{l}"
        );
        assert!(l.ends_with(" fresh"), "{l}");
    }
    let json = kvferry(&["peers", "--directory", &e.url(), "--namespace", "cli", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 3);
    assert_eq!(v[0]["stale"], false);

    // A chunk put on n1 only is found without --peer.
    let dir = std::env::temp_dir().join(format!("kvferry-dircli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (src, got) = (dir.join("src"), dir.join("got"));
    let bytes: Vec<u8> = (0..5000u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(&src, &bytes).unwrap();
    let put = kvferry(&[
        "put",
        "--peer",
        &nodes[1].addr,
        "--key",
        "where",
        "--file",
        src.to_str().unwrap(),
    ]);
    assert!(put.status.success(), "{}", text(&put.stderr));
    let get = kvferry(&[
        "get",
        "--directory",
        &e.url(),
        "--namespace",
        "cli",
        "--key",
        "where",
        "--model",
        "tiny",
        "--out",
        got.to_str().unwrap(),
    ]);
    assert!(get.status.success(), "{}", text(&get.stderr));
    assert_eq!(std::fs::read(&got).unwrap(), bytes);
    // By peer id, through the directory.
    let get = kvferry(&[
        "get",
        "--directory",
        &e.url(),
        "--namespace",
        "cli",
        "--key",
        "where",
        "--model",
        "tiny",
        "--peer",
        "n1",
    ]);
    assert!(get.status.success(), "{}", text(&get.stderr));
    // Nowhere: a clear error.
    let miss = kvferry(&[
        "get",
        "--directory",
        &e.url(),
        "--namespace",
        "cli",
        "--key",
        "nowhere",
        "--model",
        "tiny",
    ]);
    assert_eq!(miss.status.code(), Some(1));
    let err = text(&miss.stderr);
    assert!(
        err.contains("no live peer in namespace cli holds nowhere (asked 3 peer(s))"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_duplicate_peer_id_is_refused_naming_the_holder() {
    let Some(e) = etcd::Etcd::start() else { return };
    let first = serve(&e, "dup");
    let err = match spawn_serve(&e, "127.0.0.1:0", "dup") {
        Ok(s) => panic!("a second dup started: {}", s.line),
        Err(err) => err,
    };
    assert!(
        err.contains("peer id dup is already registered by a live process at"),
        "{err}"
    );
    assert!(err.contains(&first.addr), "{err}");
}

#[test]
fn sigkill_is_lost_within_the_ttl_and_a_restart_is_announced() {
    let Some(e) = etcd::Etcd::start() else { return };
    let rt = rt();
    let w = rt.block_on(watcher(&e));
    let mut rx = w.subscribe();
    let mut s = serve(&e, "victim");
    let addr = s.addr.clone();
    let first = rt.block_on(next_event(&mut rx, "victim", Duration::from_secs(5)));
    let PeerEvent::Joined(r1) = first else {
        panic!("{first:?}")
    };

    // SIGKILL: nobody revokes the lease; it expires after its TTL (2 s).
    let killed = Instant::now();
    s.child.kill().unwrap();
    s.child.wait().unwrap();
    let lost = rt.block_on(next_event(&mut rx, "victim", Duration::from_secs(6)));
    let after = killed.elapsed();
    assert!(matches!(lost, PeerEvent::Lost(_)), "{lost:?}");
    assert!(
        after <= Duration::from_secs(3),
        "Lost after {after:?}: more than TTL + 1 s"
    );
    drop(s);

    // Restarted on the same address while the old record is still there (kill, then
    // start at once): the new incarnation replaces it, announced as a restart.
    let s2 = spawn_serve(&e, &addr, "victim").expect("restart");
    let joined = rt.block_on(next_event(&mut rx, "victim", Duration::from_secs(5)));
    let PeerEvent::Joined(r2) = joined else {
        panic!("{joined:?}")
    };
    assert_ne!(r2.incarnation, r1.incarnation);
    let mut s2 = s2;
    s2.child.kill().unwrap();
    s2.child.wait().unwrap();
    let s3 = {
        // Retry briefly: the port may be held for a moment after a kill.
        let t = Instant::now();
        loop {
            match spawn_serve(&e, &addr, "victim") {
                Ok(s) => break s,
                Err(err) if t.elapsed() < Duration::from_secs(5) && err.contains("address in use") => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                Err(err) => panic!("{err}"),
            }
        }
    };
    match rt.block_on(next_event(&mut rx, "victim", Duration::from_secs(5))) {
        PeerEvent::Restarted { old, new } => {
            assert_eq!(old.incarnation, r2.incarnation);
            assert_ne!(new.incarnation, old.incarnation);
        }
        other => panic!("expected Restarted, got {other:?}"),
    }
    // A clean stop (SIGTERM) deregisters at once.
    let stopped = Instant::now();
    unsafe { libc::kill(s3.child.id() as i32, libc::SIGTERM) };
    let lost = rt.block_on(next_event(&mut rx, "victim", Duration::from_secs(5)));
    assert!(matches!(lost, PeerEvent::Lost(_)), "{lost:?}");
    assert!(stopped.elapsed() < Duration::from_secs(2), "{:?}", stopped.elapsed());
    drop(s3);
}

#[test]
fn peers_fails_clearly_when_etcd_is_unreachable() {
    let unreachable = format!("etcd://{}", free_addr());
    let t = Instant::now();
    let out = kvferry(&[
        "peers",
        "--directory",
        &unreachable,
        "--namespace",
        "cli",
        "--timeout",
        "1s",
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stdout));
    let err = text(&out.stderr);
    assert!(err.contains("cannot reach etcd at etcd://127.0.0.1:"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
    // Bad URLs are usage errors.
    let out = kvferry(&["peers", "--directory", "http://x:1"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    let out = kvferry(&["peers"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
}

/// Scrapes `http://ADDR/metrics` (None while it does not answer).
fn scrape(addr: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect_timeout(&addr.parse().ok()?, Duration::from_secs(1)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

fn gauge(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Probes every 50 ms until `done` holds for what `probe` saw; panics after `limit`
/// with `what` and the last probe.
fn poll_until(what: &str, limit: Duration, mut probe: impl FnMut() -> String, done: impl Fn(&str) -> bool) {
    let t = Instant::now();
    loop {
        let seen = probe();
        if done(&seen) {
            return;
        }
        assert!(t.elapsed() < limit, "{what} within {limit:?}; last seen:\n{seen}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits (at most `limit`) until the scrape shows `name` at `want`.
fn wait_gauge(addr: &str, name: &str, want: f64, limit: Duration) {
    poll_until(
        &format!("{name} never became {want}"),
        limit,
        || scrape(addr).unwrap_or_default(),
        |text| gauge(text, name) == Some(want),
    );
}

#[test]
fn serve_exports_the_directory_view_and_flags_it_stale_while_etcd_is_down() {
    let Some(mut e) = etcd::Etcd::start() else { return };
    let metrics = free_addr();
    let _serve = KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_kvferry"))
            .args(["serve", "--listen", "127.0.0.1:0", "--model", "tiny", "--blocks", "64"])
            .args(["--arena", "4MiB", "--page-size", "64KiB", "--copy-threads", "1"])
            .args([
                "--directory",
                &e.url(),
                "--namespace",
                "cli-metrics",
                "--directory-ttl",
                "2s",
            ])
            .args(["--peer-id", "m0", "--metrics", &metrics])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn kvferry serve"),
    );
    wait_gauge(&metrics, "kvferry_directory_peers", 1.0, Duration::from_secs(10));
    wait_gauge(&metrics, "kvferry_directory_registered", 1.0, Duration::from_secs(5));
    wait_gauge(&metrics, "kvferry_directory_stale", 0.0, Duration::from_secs(5));
    // etcd down: the view is kept (1 peer) but flagged stale within the call deadline.
    e.kill();
    wait_gauge(&metrics, "kvferry_directory_stale", 1.0, Duration::from_secs(10));
    wait_gauge(&metrics, "kvferry_directory_peers", 1.0, Duration::from_secs(1));
    // etcd back: fresh again.
    e.restart();
    wait_gauge(&metrics, "kvferry_directory_stale", 0.0, Duration::from_secs(15));
}

/// A `serve` in namespace `ns` with `extra` flags (e.g. `--metrics`, `--advertise`).
fn spawn_serve_in(e: &etcd::Etcd, ns: &str, id: &str, extra: &[&str]) -> Result<Serve, String> {
    Serve::spawn(
        Serve::command()
            .args(["--blocks", "64"])
            .args(["--arena", "4MiB", "--page-size", "64KiB", "--copy-threads", "1"])
            .args(["--directory", &e.url(), "--namespace", ns, "--directory-ttl", "2s"])
            .args(["--peer-id", id])
            .args(extra)
            .stderr(Stdio::piped()),
        START,
        false,
    )
}

fn free_addr() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    format!("127.0.0.1:{port}")
}

/// The incarnation printed on a serve's first line.
fn incarnation_of(line: &str) -> u64 {
    let hex = line
        .split("incarnation 0x")
        .nth(1)
        .and_then(|r| r.split(|c: char| !c.is_ascii_hexdigit()).next())
        .unwrap_or_else(|| panic!("no incarnation in {line}"));
    u64::from_str_radix(hex, 16).unwrap()
}

fn record_json(id: &str, addr: &str, incarnation: u64) -> Vec<u8> {
    serde_json::to_vec(&kvferry::directory::PeerRecord::new(id, addr, incarnation)).unwrap()
}

async fn raw(e: &etcd::Etcd) -> etcd_client::Client {
    etcd_client::Client::connect([e.endpoint()], None).await.unwrap()
}

/// `kvferry peers` in `ns`: (id, address, incarnation) of each line.
fn peers_in(e: &etcd::Etcd, ns: &str) -> Vec<(String, String, u64)> {
    let out = kvferry(&["peers", "--directory", &e.url(), "--namespace", ns, "--json"]);
    assert!(out.status.success(), "peers failed: {}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let inc = p["incarnation"].as_str().unwrap().trim_start_matches("0x");
            (
                p["peer_id"].as_str().unwrap().to_string(),
                p["address"].as_str().unwrap().to_string(),
                u64::from_str_radix(inc, 16).unwrap(),
            )
        })
        .collect()
}

/// Waits until `kvferry peers` in `ns` lists `id` at `addr` with `inc`.
fn wait_listed(e: &etcd::Etcd, ns: &str, id: &str, addr: &str, inc: u64, limit: Duration) {
    let t = Instant::now();
    loop {
        let list = peers_in(e, ns);
        if list.iter().any(|(i, a, n)| i == id && a == addr && *n == inc) {
            return;
        }
        assert!(
            t.elapsed() < limit,
            "{id} at {addr} ({inc:#x}) not listed within {limit:?}: {list:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The HTTP status line of `GET path` at `addr`.
fn http_status(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_secs(1)) else {
        return String::new();
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes());
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.lines().next().unwrap_or_default().to_string()
}

/// Waits (at most `limit`) until `path` answers a status line containing `want`.
fn wait_status(addr: &str, path: &str, want: &str, limit: Duration) {
    poll_until(
        &format!("{path} never answered {want}"),
        limit,
        || http_status(addr, path),
        |st| st.contains(want),
    );
}

#[test]
fn every_change_of_one_etcd_revision_reaches_a_running_serve() {
    let Some(e) = etcd::Etcd::start() else { return };
    let metrics = free_addr();
    let m0 = spawn_serve_in(&e, "cli-rev", "m0", &["--metrics", &metrics]).expect("serve m0");
    wait_gauge(&metrics, "kvferry_directory_peers", 1.0, Duration::from_secs(10));
    wait_gauge(&metrics, "kvferry_directory_registered", 1.0, Duration::from_secs(5));
    let rt = rt();
    rt.block_on(async {
        let mut c = raw(&e).await;
        // Five puts in one transaction: one revision.
        let puts: Vec<etcd_client::TxnOp> = (0..5)
            .map(|i| {
                etcd_client::TxnOp::put(
                    format!("cli-rev/peers/ghost-{i:02}"),
                    record_json(&format!("ghost-{i:02}"), "127.0.0.1:9", 100 + i),
                    None,
                )
            })
            .collect();
        let r = c.txn(etcd_client::Txn::new().and_then(puts)).await.unwrap();
        assert!(r.succeeded());
    });
    wait_gauge(&metrics, "kvferry_directory_peers", 6.0, Duration::from_secs(5));
    rt.block_on(async {
        let mut c = raw(&e).await;
        for i in 5..20u64 {
            let id = format!("ghost-{i:02}");
            c.put(
                format!("cli-rev/peers/{id}"),
                record_json(&id, "127.0.0.1:9", 100 + i),
                None,
            )
            .await
            .unwrap();
        }
    });
    wait_gauge(&metrics, "kvferry_directory_peers", 21.0, Duration::from_secs(5));
    // Twenty deletes in one revision (what `etcdctl del --prefix` does).
    rt.block_on(async {
        let mut c = raw(&e).await;
        let r = c
            .delete(
                "cli-rev/peers/ghost-",
                Some(etcd_client::DeleteOptions::new().with_prefix()),
            )
            .await
            .unwrap();
        assert_eq!(r.deleted(), 20);
    });
    wait_gauge(&metrics, "kvferry_directory_peers", 1.0, Duration::from_secs(5));
    // The whole namespace deleted behind m0's back: its record comes back.
    let inc = incarnation_of(&m0.line);
    rt.block_on(async {
        let mut c = raw(&e).await;
        let r = c
            .delete("cli-rev/peers/", Some(etcd_client::DeleteOptions::new().with_prefix()))
            .await
            .unwrap();
        assert_eq!(r.deleted(), 1);
    });
    wait_listed(&e, "cli-rev", "m0", &m0.addr, inc, Duration::from_secs(5));
    wait_gauge(&metrics, "kvferry_directory_peers", 1.0, Duration::from_secs(5));
    wait_gauge(&metrics, "kvferry_directory_registered", 1.0, Duration::from_secs(5));
}

#[test]
fn a_rogue_advertising_a_live_peers_address_cannot_take_its_id() {
    let Some(e) = etcd::Etcd::start() else { return };
    let metrics = free_addr();
    let real = spawn_serve_in(&e, "cli-own", "prefill-a", &["--metrics", &metrics]).expect("serve prefill-a");
    let inc = incarnation_of(&real.line);
    wait_gauge(&metrics, "kvferry_directory_registered", 1.0, Duration::from_secs(5));
    // Another process claims the id at the live peer's address.
    let t = Instant::now();
    let err = match spawn_serve_in(&e, "cli-own", "prefill-a", &["--advertise", &real.addr]) {
        Ok(s) => panic!("the rogue registered: {}", s.line),
        Err(err) => err,
    };
    assert!(
        err.contains(&format!(
            "peer id prefill-a is already registered by a live process at {}",
            real.addr
        )),
        "{err}"
    );
    assert!(t.elapsed() < Duration::from_secs(5), "refused after {:?}", t.elapsed());
    // The real peer is untouched and still serves by id.
    wait_listed(&e, "cli-own", "prefill-a", &real.addr, inc, Duration::from_secs(2));
    std::thread::sleep(Duration::from_secs(1));
    wait_listed(&e, "cli-own", "prefill-a", &real.addr, inc, Duration::from_secs(1));
    wait_gauge(&metrics, "kvferry_directory_registered", 1.0, Duration::from_secs(1));
    wait_status(&metrics, "/readyz", "200", Duration::from_secs(1));
    let get = kvferry(&[
        "get",
        "--directory",
        &e.url(),
        "--namespace",
        "cli-own",
        "--peer",
        "prefill-a",
        "--key",
        "nothing",
        "--model",
        "tiny",
    ]);
    let err = text(&get.stderr);
    assert!(err.contains("miss: prefill-a does not hold nothing"), "{err}");
}

/// A plain `kvferry serve` (no directory) under peer id `id`, with `extra` arguments.
fn plain_serve(id: &str, extra: &[&str]) -> Serve {
    Serve::start(
        Serve::command()
            .args(["--blocks", "64"])
            .args(["--arena", "4MiB", "--page-size", "64KiB", "--copy-threads", "1"])
            .args(["--peer-id", id])
            .args(extra)
            .stderr(Stdio::null()),
        START,
        false,
    )
}

#[test]
fn a_record_forged_by_a_writer_that_cannot_prove_itself_is_taken_back_at_once() {
    let Some(e) = etcd::Etcd::start() else { return };
    let secret = std::env::temp_dir().join(format!("kvferry-forge-secret-{}", std::process::id()));
    std::fs::write(&secret, b"0123456789abcdef0123456789abcdef-forged-records").unwrap();
    let secret_arg = secret.to_str().unwrap().to_string();
    let metrics = free_addr();
    let real = spawn_serve_in(
        &e,
        "cli-forge",
        "prefill-a",
        &["--metrics", &metrics, "--secret-file", &secret_arg],
    )
    .expect("serve prefill-a");
    let inc = incarnation_of(&real.line);
    wait_gauge(&metrics, "kvferry_directory_registered", 1.0, Duration::from_secs(5));
    // An impostor without the fleet's secret, answering as prefill-a.
    let impostor = plain_serve("prefill-a", &[]);
    let rt = rt();
    // Each forged record on an etcd lease its writer keeps alive (60 s, longer than the
    // test): the real peer's record must be back within a few seconds, not a minute.
    let forgeries = [
        (
            "the impostor's address, another incarnation",
            impostor.addr.clone(),
            inc ^ 0xbad,
        ),
        (
            "the impostor's address, the impostor's incarnation",
            impostor.addr.clone(),
            incarnation_of(&impostor.line),
        ),
        (
            "the impostor's address, the peer's own incarnation",
            impostor.addr.clone(),
            inc,
        ),
        (
            "an address nobody answers at, another incarnation",
            free_addr(),
            inc ^ 0xbad,
        ),
    ];
    for (n, (what, addr, forged_inc)) in forgeries.iter().enumerate() {
        rt.block_on(async {
            let mut c = raw(&e).await;
            let lease = c.lease_grant(60, None).await.unwrap().id();
            c.put(
                "cli-forge/peers/prefill-a",
                record_json("prefill-a", addr, *forged_inc),
                Some(etcd_client::PutOptions::new().with_lease(lease)),
            )
            .await
            .unwrap();
        });
        let t = Instant::now();
        wait_listed(&e, "cli-forge", "prefill-a", &real.addr, inc, Duration::from_secs(8));
        wait_gauge(&metrics, "kvferry_directory_registered", 1.0, Duration::from_secs(2));
        eprintln!("forgery {n} ({what}): record back in {:?}", t.elapsed());
    }
    let taken_back = gauge(&scrape(&metrics).unwrap(), "kvferry_directory_records_taken_back_total").unwrap();
    assert!(taken_back >= 3.0, "{taken_back} records counted as taken back");
    // And the peer serves by directory, with the secret: the impostor is never used.
    let get = kvferry(&[
        "get",
        "--directory",
        &e.url(),
        "--namespace",
        "cli-forge",
        "--peer",
        "prefill-a",
        "--key",
        "nothing",
        "--model",
        "tiny",
        "--secret-file",
        &secret_arg,
    ]);
    let err = text(&get.stderr);
    assert!(err.contains("miss: prefill-a does not hold nothing"), "{err}");
    let _ = std::fs::remove_file(secret);
}

#[test]
fn a_record_taken_behind_a_live_peers_back_is_taken_back_or_reported() {
    let Some(e) = etcd::Etcd::start() else { return };
    let metrics = free_addr();
    let real = spawn_serve_in(&e, "cli-take", "prefill-a", &["--metrics", &metrics]).expect("serve prefill-a");
    let inc = incarnation_of(&real.line);
    wait_gauge(&metrics, "kvferry_directory_registered", 1.0, Duration::from_secs(5));
    // An impostor: a plain serve (no directory) that says it is prefill-a.
    let impostor = plain_serve("prefill-a", &[]);
    let rt = rt();
    // 1. A forged record on no lease, naming a holder that does not answer: the real
    //    peer takes its record back.
    rt.block_on(async {
        let mut c = raw(&e).await;
        c.put(
            "cli-take/peers/prefill-a",
            record_json("prefill-a", &free_addr(), 0xbad),
            None,
        )
        .await
        .unwrap();
    });
    wait_listed(&e, "cli-take", "prefill-a", &real.addr, inc, Duration::from_secs(5));
    // 2. A record naming the impostor's incarnation at its address, on a live lease:
    //    a live holder, which the real peer does not fight; it reports itself
    //    unregistered (metric, /readyz) until the record is free, then comes back.
    let lease = rt.block_on(async {
        let mut c = raw(&e).await;
        let lease = c.lease_grant(60, None).await.unwrap().id();
        let imp_inc = incarnation_of(&impostor.line);
        c.put(
            "cli-take/peers/prefill-a",
            record_json("prefill-a", &impostor.addr, imp_inc),
            Some(etcd_client::PutOptions::new().with_lease(lease)),
        )
        .await
        .unwrap();
        lease
    });
    wait_gauge(&metrics, "kvferry_directory_registered", 0.0, Duration::from_secs(5));
    wait_status(&metrics, "/readyz", "503", Duration::from_secs(2));
    rt.block_on(async {
        raw(&e).await.lease_revoke(lease).await.unwrap();
    });
    wait_listed(&e, "cli-take", "prefill-a", &real.addr, inc, Duration::from_secs(5));
    wait_gauge(&metrics, "kvferry_directory_registered", 1.0, Duration::from_secs(5));
    wait_status(&metrics, "/readyz", "200", Duration::from_secs(2));
}

#[test]
fn get_by_directory_refuses_a_peer_that_is_not_the_one_its_record_names() {
    let Some(e) = etcd::Etcd::start() else { return };
    // An attacker's serve (no directory) holding attacker bytes under key "k".
    let evil = plain_serve("evil", &[]);
    let dir = std::env::temp_dir().join(format!("kvferry-dircli-forge-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("evil");
    std::fs::write(&src, vec![0xee; 3000]).unwrap();
    let put = kvferry(&[
        "put",
        "--peer",
        &evil.addr,
        "--key",
        "k",
        "--file",
        src.to_str().unwrap(),
    ]);
    assert!(put.status.success(), "{}", text(&put.stderr));
    // A forged record: peer `decode-b` (incarnation 0x1234) is at evil's address.
    let rt = rt();
    rt.block_on(async {
        raw(&e)
            .await
            .put(
                "cli-forge/peers/decode-b",
                record_json("decode-b", &evil.addr, 0x1234),
                None,
            )
            .await
            .unwrap();
    });
    let get = |peer: Option<&str>| {
        let mut args = vec![
            "get",
            "--directory",
            e.url().leak(),
            "--namespace",
            "cli-forge",
            "--key",
            "k",
            "--model",
            "tiny",
            "--timeout",
            "3s",
        ];
        if let Some(p) = peer {
            args.extend(["--peer", p]);
        }
        kvferry(&args)
    };
    let by_id = get(Some("decode-b"));
    assert!(
        !by_id.status.success(),
        "got the attacker's bytes: {}",
        text(&by_id.stdout)
    );
    let err = text(&by_id.stderr);
    assert!(
        err.contains(&format!("{} answered as evil", evil.addr))
            && err.contains("not as decode-b (incarnation 0x1234)"),
        "{err}"
    );
    let located = get(None);
    assert!(
        !located.status.success(),
        "got the attacker's bytes: {}",
        text(&located.stdout)
    );
    let err = text(&located.stderr);
    assert!(err.contains("no live peer in namespace cli-forge holds k"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_peer_that_accepts_and_never_answers_does_not_hold_up_get_by_key() {
    let Some(e) = etcd::Etcd::start() else { return };
    let n1 = spawn_serve_in(&e, "cli-hole", "n1", &[]).expect("serve n1");
    // A black hole: accepts connections and never writes a byte.
    let hole = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let hole_addr = hole.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in hole.incoming().flatten() {
            held.push(c);
        }
    });
    let rt = rt();
    rt.block_on(async {
        let mut c = raw(&e).await;
        for i in 0..3 {
            let id = format!("hole-{i}");
            c.put(
                format!("cli-hole/peers/{id}"),
                record_json(&id, &hole_addr, 7 + i),
                None,
            )
            .await
            .unwrap();
        }
    });
    let dir = std::env::temp_dir().join(format!("kvferry-dircli-hole-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("src");
    std::fs::write(&src, vec![0x5a; 2000]).unwrap();
    let put = kvferry(&["put", "--peer", &n1.addr, "--key", "k", "--file", src.to_str().unwrap()]);
    assert!(put.status.success(), "{}", text(&put.stderr));
    // The get's whole budget is shorter than a handshake timeout (3 s): it must not be
    // spent waiting for the black holes.
    let t = Instant::now();
    let get = kvferry(&[
        "get",
        "--directory",
        &e.url(),
        "--namespace",
        "cli-hole",
        "--key",
        "k",
        "--model",
        "tiny",
        "--timeout",
        "2s",
    ]);
    assert!(get.status.success(), "after {:?}: {}", t.elapsed(), text(&get.stderr));
    assert!(text(&get.stdout).contains("got 2000 bytes"), "{}", text(&get.stdout));
    let _ = std::fs::remove_dir_all(&dir);
}
