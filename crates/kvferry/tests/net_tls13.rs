//! TLS 1.3 only: a client offering at most TLS 1.2 (with a valid certificate from the
//! fleet's CA) fails the TLS handshake against a kvferry server, while one offering
//! 1.2 and 1.3 negotiates 1.3. Raw rustls clients against a real engine over
//! loopback; CA and certificates generated per test (rcgen).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::tls::Ca;
use kvferry::engine::Engine;
use kvferry::net::TlsConfig;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore};

async fn engine(tls: TlsConfig) -> Engine {
    let mut cfg = common::engines::small_config("server").arena(1 << 20, 64 << 10);
    cfg.net.tls = Some(tls);
    Engine::start(cfg).await.unwrap()
}

/// A raw rustls client offering `versions`, with a certificate from `ca`.
fn client(ca: &Ca, versions: &[&'static rustls::SupportedProtocolVersion]) -> ClientConfig {
    let mut roots = RootCertStore::empty();
    roots.add(ca.cert.der().clone()).unwrap();
    let (cert, key) = ca.issue("raw.client");
    let chain = vec![CertificateDer::from_pem_slice(cert.as_bytes()).unwrap()];
    let key = PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap();
    ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_protocol_versions(versions)
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .unwrap()
}

async fn tls_connect(
    addr: std::net::SocketAddr,
    cfg: ClientConfig,
) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let name = ServerName::IpAddress(addr.ip().into());
    let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    tokio::time::timeout(Duration::from_secs(10), connector.connect(name, tcp))
        .await
        .expect("the TLS handshake ends within 10 s")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_offering_at_most_tls_1_2_is_refused() {
    let ca = Ca::new("fleet CA");
    let (cert, key) = ca.issue("server.node");
    let tls = TlsConfig::from_pem(cert.as_bytes(), key.as_bytes(), ca.cert.pem().as_bytes()).unwrap();
    let server = engine(tls).await;
    let addr = server.address().unwrap();

    let e = tls_connect(addr, client(&ca, &[&rustls::version::TLS12])).await;
    assert!(e.is_err(), "a TLS 1.2-only client completed its handshake");

    // Offering both, a client gets 1.3.
    let s = tls_connect(addr, client(&ca, &[&rustls::version::TLS13, &rustls::version::TLS12]))
        .await
        .unwrap();
    assert_eq!(s.get_ref().1.protocol_version(), Some(rustls::ProtocolVersion::TLSv1_3));
}
