//! Partitions and restarts across real network hosts: a host cut off by an nftables
//! drop rule (silence, not resets) or by its switch port going down fails transfers to
//! it with a typed error within their deadline while the other hosts keep serving, and
//! serves again once healed, as the same incarnation; a restarted process is a new
//! incarnation and no request goes to a connection of the old one. Run as root;
//! elsewhere these skip with a message (a failure under `CI=true`).

mod common;
mod netns;

use std::time::{Duration, Instant};

use kvferry::peer::PeerError;
use kvferry::wire::ChunkKey;
use netns::client::{pattern, NsClient};
use netns::net::Network;
use netns::serve::Serve;

const T: Duration = Duration::from_secs(10);
/// The deadline of a transfer to a cut-off host, and the slack allowed past it.
const DEADLINE: Duration = Duration::from_secs(2);
const SLACK: Duration = Duration::from_secs(1);

/// Asserts that `f` fails with a typed network error within the deadline.
fn fails_in_time<T: std::fmt::Debug>(what: &str, f: impl FnOnce() -> Result<T, PeerError>) {
    let t = Instant::now();
    let r = f();
    let took = t.elapsed();
    match r {
        Err(PeerError::Timeout { .. } | PeerError::PeerLost { .. }) => {}
        other => panic!("{what}: expected Timeout or PeerLost, got {other:?}"),
    }
    assert!(
        took <= DEADLINE + SLACK,
        "{what}: failed after {took:?}, deadline {DEADLINE:?}"
    );
}

#[test]
fn a_partitioned_host_fails_in_time_the_others_serve_and_healed_it_returns_unchanged() {
    let Some(net) = Network::or_skip(4, "partition") else {
        return;
    };
    let servers: Vec<Serve> = (1..4).map(|i| Serve::start(net.host(i), &[])).collect();
    let c = NsClient::new(net.host(0), "partition-client");
    let len = 300_000;
    for s in &servers {
        let key = format!("part-{}", s.host.index);
        c.put(&s.addr, &key, &pattern(&key, len), T).unwrap();
        assert!(c.get(&s.addr, &key, T).unwrap().unwrap() == pattern(&key, len));
    }
    let (cut, other) = (&servers[0], &servers[1]);
    net.partition(&cut.host).unwrap();
    // On the pooled (established) connection: packets vanish, the deadline fires.
    fails_in_time("get over a pooled connection", || c.get(&cut.addr, "part-1", DEADLINE));
    fails_in_time("put over a pooled connection", || {
        c.put(&cut.addr, "part-1b", &pattern("x", 1000), DEADLINE)
    });
    // A client that never talked to it: its connection attempt goes unanswered.
    let fresh = NsClient::new(net.host(0), "partition-fresh");
    fails_in_time("get from a new client", || fresh.get(&cut.addr, "part-1", DEADLINE));
    // The command fails in time too, and says why.
    let t = Instant::now();
    let out = netns::serve::kvferry(
        net.host(0),
        &[
            "get",
            "--peer",
            &cut.addr,
            "--key",
            "part-1",
            "--model",
            "tiny",
            "--timeout",
            "2s",
        ],
        Duration::from_secs(10),
    );
    let took = t.elapsed();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "get from a cut-off host succeeded");
    // Twice the slack: the time includes starting the process.
    assert!(
        took <= DEADLINE + 2 * SLACK,
        "`kvferry get` to a cut-off host took {took:?}"
    );
    assert!(
        err.contains("timed out") || err.contains("lost"),
        "unclear error from `kvferry get`: {err}"
    );
    // The rest of the fleet is unaffected.
    for s in &servers[1..] {
        let key = format!("part-{}", s.host.index);
        assert!(c.get(&s.addr, &key, T).unwrap().unwrap() == pattern(&key, len));
    }
    // Healed: the same process (same incarnation, same store) serves again.
    net.heal(&cut.host).unwrap();
    let t = Instant::now();
    let got = loop {
        match c.get(&cut.addr, "part-1", Duration::from_secs(3)) {
            Ok(got) => break got,
            Err(e) => assert!(t.elapsed() < T, "healed host never served again: {e}"),
        }
    };
    assert!(got.unwrap() == pattern("part-1", len), "healed host's bytes differ");
    assert_eq!(c.restarts_seen(&cut.addr), 0, "a healed host is the same incarnation");
    assert!(fresh.get(&cut.addr, "part-1", T).unwrap().unwrap() == pattern("part-1", len));

    // A switch port going down is a partition too.
    net.set_link(&other.host, false).unwrap();
    fails_in_time("get behind a downed port", || c.get(&other.addr, "part-2", DEADLINE));
    net.set_link(&other.host, true).unwrap();
    let t = Instant::now();
    while c.get(&other.addr, "part-2", Duration::from_secs(3)).is_err() {
        assert!(t.elapsed() < T, "host behind a port brought up never served again");
    }
    assert!(c.get(&other.addr, "part-2", T).unwrap().unwrap() == pattern("part-2", len));
    assert_eq!(c.restarts_seen(&other.addr), 0);
    let stats = c.arena().stats();
    assert_eq!(stats.free_pages, stats.total_pages, "client staging pages all back");
}

#[test]
fn a_restarted_process_is_a_new_incarnation_and_gets_no_request_meant_for_the_old() {
    let Some(net) = Network::or_skip(3, "restart") else {
        return;
    };
    let mut servers: Vec<Serve> = (1..3).map(|i| Serve::start(net.host(i), &[])).collect();
    let c = NsClient::new(net.host(0), "restart-client");
    let len = 200_000;
    let addr = servers[0].addr.clone();
    c.put(&addr, "r-old", &pattern("r-old", len), T).unwrap();
    assert!(c.get(&addr, "r-old", T).unwrap().unwrap() == pattern("r-old", len));
    // A staged lease of the old incarnation, to be resolved after the restart.
    let key = ChunkKey::from_name("r-old");
    let (cc, a) = (c.consumer().clone(), addr.clone());
    let handle = c
        .block_on(async move { cc.stage(&a, &[key], tokio::time::Instant::now() + T).await })
        .unwrap();
    let old = servers[0].incarnation;
    servers[0].kill();
    servers[0] = Serve::start(net.host(1), &[]);
    let new = servers[0].incarnation;
    assert_ne!(new, old, "a restarted process must be a new incarnation");
    // The client's pooled connections went to the old process: the first request after
    // the restart must not be sent on one of them (it would fail as PeerLost). It goes
    // to the new process, which holds nothing.
    assert_eq!(
        c.get(&addr, "r-old", T).unwrap(),
        None,
        "the new process holds nothing yet"
    );
    assert_eq!(c.restarts_seen(&addr), 1, "the pool saw exactly one restart");
    let (cc, layout) = (c.consumer().clone(), kvferry::layout::Preset::Tiny);
    let e = c
        .block_on(async move {
            let l =
                kvferry::layout::KvLayout::preset(layout, 1024, kvferry::layout::Arrangement::FullyContiguous).unwrap();
            let region = std::sync::Arc::new(kvferry::mem::Region::host("r", l.region_bytes()).unwrap());
            let dst = kvferry::peer::Destination::from_layout(region, &l, vec![(0..1024).collect()])
                .expect("valid destination");
            cc.resolve(handle, dst, tokio::time::Instant::now() + T).await
        })
        .unwrap_err();
    assert!(
        matches!(e.error, PeerError::StaleIncarnation { handle, current } if handle == old && current == new),
        "{}",
        e.error
    );
    // The new process serves normally; the untouched host never noticed.
    c.put(&addr, "r-new", &pattern("r-new", len), T).unwrap();
    assert!(c.get(&addr, "r-new", T).unwrap().unwrap() == pattern("r-new", len));
    let other = &servers[1];
    c.put(&other.addr, "r-other", &pattern("r-other", len), T).unwrap();
    assert!(c.get(&other.addr, "r-other", T).unwrap().unwrap() == pattern("r-other", len));
    assert_eq!(c.restarts_seen(&other.addr), 0);
    // Every request after the restart reached the new process (get, resolve, put, get).
    let reqs = servers[0]
        .metric_total("kvferry_requests_total")
        .expect("requests metric");
    assert!(reqs >= 3.0, "the new process served {reqs} requests");
}
