//! Test support for tests across real network hosts: a private network of Linux network
//! namespaces (one per host, joined by veth pairs to a bridge that lives in a namespace
//! of its own, [`net`]), `kvferry serve` processes inside them ([`serve`]), a client
//! that runs the `kvferry` library inside a host ([`client`]), a fault-injecting TCP
//! forwarder ([`forwarder`]), a real etcd in a host of its own ([`etcd`]), the
//! `kvferry peers` listing ([`peers`]) and the chaos runs' transfer load ([`load`]).
//!
//! Nothing here touches the machine's own network: the bridge and every host live in
//! namespaces created for one test (names carry the test process's pid and a counter),
//! so subnets and ports may repeat across tests running in parallel. Everything is
//! removed when the [`net::Network`] is dropped, also while a test panics; namespaces
//! left behind by a test process that was killed are swept by the next run.
//!
//! Where namespaces cannot be created (not root, no `ip` or `nft`), [`net::Network::or_skip`]
//! prints why and the test returns early; with `CI=true` that is a failure instead.
//!
//! # Cancellation
//! Nothing here is async from the caller's side: every helper blocks with a bound
//! (process start-up, HTTP reads, client calls all take timeouts). The forwarder's
//! tasks run on a runtime the [`forwarder::Forwarder`] owns and stop when it is dropped.

#![allow(dead_code)]

pub mod client;
pub mod etcd;
pub mod forwarder;
pub mod load;
pub mod net;
pub mod peers;
pub mod serve;

/// Reports a skipped test on the process's stderr directly (not through `eprintln!`,
/// which the test harness captures and hides for a passing test), so a skip is seen.
pub fn skip(test: &str, why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
}
