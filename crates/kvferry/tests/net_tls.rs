//! Mutual TLS between peers, over real loopback sockets against real engines, with a
//! CA and certificates generated per test (rcgen):
//!
//! - a round trip (push, then an eager get on both receive paths, and a delayed pull)
//!   is byte-exact, and the producer knows the client by its certificate's identity;
//! - a client whose certificate comes from another CA, and a client without a
//!   certificate, are refused and counted as authentication failures;
//! - a plaintext client is told the server requires TLS, and the server keeps serving;
//!   a TLS client reaching a plaintext server fails with a clear error;
//! - unreadable, malformed or mismatched PEM files are typed errors naming the file.
//!
//! Every test builds its own engines and certificates (ephemeral ports, temp dirs).

mod common;

use std::sync::Arc;
use std::time::Duration;

use kvferry::engine::Engine;
use kvferry::layout::KvCache;
use kvferry::mem::Region;
use kvferry::net::{NetConfig, NetError, Pool, TlsConfig, TlsError};
use kvferry::peer::{Destination, TransferPath};
use kvferry::wire::{ChunkKey, Message};
use rcgen::{CertificateParams, DnType, KeyPair};
use tokio::time::Instant;

use common::engines::pattern;
use common::tls::Ca;

/// A small engine: 2 MiB staging arena of 64 KiB pages, a 1 MiB store of 16 KiB
/// blocks, loopback, with `tls`.
async fn engine(peer_id: &str, tls: Option<TlsConfig>) -> Engine {
    let mut cfg = common::engines::small_config(peer_id);
    cfg.net.tls = tls;
    Engine::start(cfg).await.unwrap()
}

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(5)
}

fn client_net(tls: Option<TlsConfig>) -> NetConfig {
    let mut net = NetConfig::new("raw-client");
    net.tls = tls;
    net
}

/// One request on a fresh pooled connection.
async fn request(pool: &Pool, msg: &Message) -> Result<Message, NetError> {
    let mut conn = pool.checkout(deadline()).await?;
    let r = conn.request(msg).await;
    if r.is_ok() {
        conn.finish();
    }
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_round_trip_is_byte_exact_and_peers_are_known_by_certificate() {
    let ca = Ca::new("test CA");
    let prefill = engine("prefill", Some(ca.tls("prefill.node"))).await;
    let decode = engine("decode", Some(ca.tls("decode.node"))).await;
    let addr = prefill.address().unwrap().to_string();
    // Push a chunk of 3 blocks over TLS.
    const BLOCK: usize = 16 << 10;
    let k = ChunkKey::from_name("tls/chunk");
    let data = pattern(7, 3 * BLOCK);
    decode.push(&addr, k, &data, deadline()).await.unwrap();
    // Eager get back, on both receive paths, into a registered cache.
    for path in [TransferPath::Direct, TransferPath::Staged] {
        let region = Arc::new(Region::host(format!("dst-{path:?}"), 8 * BLOCK).unwrap());
        let reg = decode
            .register(KvCache::contiguous(region.clone(), BLOCK).unwrap())
            .unwrap();
        let d = Destination::new(reg.cache.clone(), vec![vec![5, 1, 6]]).with_path(path);
        decode.get(&addr, &[k], d, deadline()).await.unwrap();
        let got: Vec<u8> = [5usize, 1, 6]
            .iter()
            .flat_map(|&b| region.to_vec(b * BLOCK, BLOCK).unwrap())
            .collect();
        assert!(got == data, "{path:?}: landed bytes differ");
        decode.deregister(&reg, Duration::from_secs(2)).await.unwrap();
    }
    // A delayed pull over TLS too.
    let h = decode.stage(&addr, &[k], deadline()).await.unwrap();
    decode.release_staged(&h, deadline()).await.unwrap();
    let s = prefill.server_stats();
    assert_eq!(s.auth_failures, 0);
    // A client knows the server by its certificate too.
    let raw = Pool::new(addr.clone(), client_net(Some(ca.tls("raw.node")))).unwrap();
    let conn = raw.checkout(deadline()).await.unwrap();
    assert_eq!(conn.peer().tls_identity.as_deref(), Some("prefill.node"));
    assert!(conn.is_tls());
    conn.finish();
    assert!(s.accepted >= 1);
    // The producer bound the leases to the certificate's identity: a raw client with
    // another certificate (same CA) cannot release them.
    let raw = Pool::new(addr.clone(), client_net(Some(ca.tls("intruder.node")))).unwrap();
    let h = decode.stage(&addr, &[k], deadline()).await.unwrap();
    let r = request(&raw, &Message::Done { lease_id: h.lease_id }).await;
    assert!(matches!(r, Err(NetError::Remote { .. })), "{r:?}");
    assert_eq!(prefill.producer().stats().foreign_lease_refused, 1);
    decode.release_staged(&h, deadline()).await.unwrap();
    assert_eq!(prefill.arena().stats().leased_pages, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_from_another_ca_is_refused_and_counted() {
    let ca = Ca::new("fleet CA");
    let rogue = Ca::new("rogue CA");
    let server = engine("server", Some(ca.tls("server.node"))).await;
    let addr = server.address().unwrap().to_string();
    // Trusts the server (our CA), presents a certificate from another CA.
    let (cert, key) = rogue.issue("rogue.node");
    let tls = TlsConfig::from_pem(cert.as_bytes(), key.as_bytes(), ca.pem().as_bytes()).unwrap();
    let pool = Pool::new(addr.clone(), client_net(Some(tls))).unwrap();
    let e = request(&pool, &Message::Ping).await.unwrap_err();
    // The server's alert reaches the client on its first read (TLS 1.3): an Auth error.
    assert!(matches!(e, NetError::Auth(_)), "{e}");
    assert_eq!(e.code(), kvferry::ErrorCode::AuthFailed);
    wait_for(|| server.server_stats().auth_failures == 1).await;
    // A good client is still served.
    let good = Pool::new(addr, client_net(Some(ca.tls("good.node")))).unwrap();
    assert_eq!(request(&good, &Message::Ping).await.unwrap(), Message::Pong);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_without_a_certificate_is_refused_when_mutual_tls_is_on() {
    let ca = Ca::new("fleet CA");
    let server = engine("server", Some(ca.tls("server.node"))).await;
    let addr = server.address().unwrap().to_string();
    let tls = TlsConfig::client_without_certificate(ca.pem().as_bytes()).unwrap();
    assert!(!tls.can_serve());
    let pool = Pool::new(addr, client_net(Some(tls))).unwrap();
    let e = request(&pool, &Message::Ping).await.unwrap_err();
    // The server's alert reaches the client on its first read (TLS 1.3): an Auth error.
    assert!(matches!(e, NetError::Auth(_)), "{e}");
    assert_eq!(e.code(), kvferry::ErrorCode::AuthFailed);
    wait_for(|| server.server_stats().auth_failures == 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plaintext_client_is_told_tls_is_required_and_the_server_keeps_serving() {
    let ca = Ca::new("fleet CA");
    let server = engine("server", Some(ca.tls("server.node"))).await;
    let addr = server.address().unwrap().to_string();
    let plain = Pool::new(addr.clone(), client_net(None)).unwrap();
    match request(&plain, &Message::Ping).await {
        Err(NetError::Auth(m)) => assert!(m.contains("requires TLS"), "{m}"),
        other => panic!("a plaintext client was not refused clearly: {other:?}"),
    }
    wait_for(|| server.server_stats().auth_failures == 1).await;
    let good = Pool::new(addr, client_net(Some(ca.tls("good.node")))).unwrap();
    assert_eq!(request(&good, &Message::Ping).await.unwrap(), Message::Pong);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_client_reaching_a_plaintext_server_fails_clearly() {
    let ca = Ca::new("fleet CA");
    let server = engine("server", None).await;
    let pool = Pool::new(
        server.address().unwrap().to_string(),
        client_net(Some(ca.tls("c.node"))),
    )
    .unwrap();
    match request(&pool, &Message::Ping).await {
        Err(NetError::Auth(m)) => assert!(m.contains("TLS handshake") && m.contains("server run with TLS"), "{m}"),
        other => panic!("expected a TLS handshake failure, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_certificate_for_another_host_is_refused_by_the_client() {
    let ca = Ca::new("fleet CA");
    // Valid for some other host only.
    let mut p = CertificateParams::new(vec!["elsewhere.example".to_string()]).unwrap();
    p.distinguished_name.push(DnType::CommonName, "server.node");
    let key = KeyPair::generate().unwrap();
    let cert = p.signed_by(&key, &ca.cert, &ca.key).unwrap();
    let tls = TlsConfig::from_pem(
        cert.pem().as_bytes(),
        key.serialize_pem().as_bytes(),
        ca.pem().as_bytes(),
    )
    .unwrap();
    let server = engine("server", Some(tls)).await;
    let pool = Pool::new(
        server.address().unwrap().to_string(),
        client_net(Some(ca.tls("c.node"))),
    )
    .unwrap();
    match request(&pool, &Message::Ping).await {
        Err(NetError::Auth(m)) => assert!(m.contains("TLS handshake"), "{m}"),
        other => panic!("expected a certificate name failure, got {other:?}"),
    }
}

#[test]
fn bad_tls_files_are_typed_errors_naming_the_file() {
    let dir = std::env::temp_dir().join(format!("kvferry-tls-{}-{}", std::process::id(), rand_suffix()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca = Ca::new("fleet CA");
    let (cert, key) = ca.issue("node");
    let (_, other_key) = ca.issue("other");
    let write = |name: &str, body: &str| {
        let p = dir.join(name);
        std::fs::write(&p, body).unwrap();
        p
    };
    let (c, k, a) = (write("c.pem", &cert), write("k.pem", &key), write("ca.pem", &ca.pem()));
    TlsConfig::from_files(&c, &k, &a).unwrap();
    // Missing file: names it.
    let missing = dir.join("nope.pem");
    let e = TlsConfig::from_files(&missing, &k, &a).unwrap_err();
    assert!(matches!(e, TlsError::Read { .. }), "{e}");
    assert!(
        e.to_string().contains("nope.pem") && e.to_string().contains("certificate"),
        "{e}"
    );
    // Not PEM.
    let junk = write("junk.pem", "hello");
    let e = TlsConfig::from_files(&c, &k, &junk).unwrap_err();
    assert!(matches!(e, TlsError::Pem { what: "CA", .. }), "{e}");
    assert!(e.to_string().contains("junk.pem"), "{e}");
    let e = TlsConfig::from_files(&c, &junk, &a).unwrap_err();
    assert!(
        matches!(
            e,
            TlsError::Pem {
                what: "private key",
                ..
            }
        ),
        "{e}"
    );
    // A key that is not the certificate's.
    let wrong = write("wrong-key.pem", &other_key);
    let e = TlsConfig::from_files(&c, &wrong, &a).unwrap_err();
    assert!(matches!(e, TlsError::Mismatch { .. }), "{e}");
    assert!(
        e.to_string().contains("c.pem") && e.to_string().contains("wrong-key.pem"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0);
    h.finish()
}

/// Waits (bounded) for a condition the server reaches asynchronously.
async fn wait_for(cond: impl Fn() -> bool) {
    let t = Instant::now();
    while !cond() {
        assert!(t.elapsed() < Duration::from_secs(5), "condition not reached in 5 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Under TLS a lease belongs to the certificate's identity, while the peer directory
/// names peers by the id they claim. A decode that leaves the directory has its staged
/// leases released at once (not at their TTL), and only its own: another decode
/// presenting a certificate with the same identity keeps its lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_peer_that_left_the_directory_has_only_its_leases_released_at_once() {
    use kvferry::engine::StaticDirectory;

    let ca = Ca::new("fleet CA");
    let dir = Arc::new(StaticDirectory::default());
    let mut cfg = common::engines::small_config("prefill");
    cfg.net.tls = Some(ca.tls("prefill.node"));
    cfg.directory = Some(dir.clone());
    let prefill = Engine::start(cfg).await.unwrap();
    let addr = prefill.address().unwrap().to_string();
    // One certificate identity for the whole decode fleet.
    let d1 = engine("decode-1", Some(ca.tls("decode.fleet"))).await;
    let d2 = engine("decode-2", Some(ca.tls("decode.fleet"))).await;
    dir.insert("decode-1", d1.address().unwrap().to_string());
    dir.insert("decode-2", d2.address().unwrap().to_string());
    let k = ChunkKey::from_name("tls/leaving");
    d1.push(&addr, k, &pattern(3, 2 * (16 << 10)), deadline())
        .await
        .unwrap();
    let h1 = d1.stage(&addr, &[k], deadline()).await.unwrap();
    let h2 = d2.stage(&addr, &[k], deadline()).await.unwrap();
    let held = prefill.producer().lease_pages_held_by("decode.fleet");
    assert!(held >= 2, "{held}");
    dir.remove("decode-1");
    wait_for(|| prefill.producer().lease_pages_held_by("decode.fleet") == held / 2).await;
    // decode-2's lease is intact: its pull lands the bytes; decode-1's is gone.
    let region = Arc::new(Region::host("dst-leaving", 4 * (16 << 10)).unwrap());
    let reg = d2
        .register(KvCache::contiguous(region.clone(), 16 << 10).unwrap())
        .unwrap();
    let d = Destination::new(reg.cache.clone(), vec![vec![0, 1]]);
    d2.resolve(h2, d, deadline()).await.unwrap();
    assert_eq!(region.to_vec(0, 2 * (16 << 10)).unwrap(), pattern(3, 2 * (16 << 10)));
    let d = Destination::new(reg.cache.clone(), vec![vec![2, 3]]);
    assert!(d1.resolve(h1, d, deadline()).await.is_err());
    wait_for(|| prefill.producer().lease_pages_held_by("decode.fleet") == 0).await;
}
