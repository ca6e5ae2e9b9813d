//! Optional TLS between peers (rustls, ring provider): encryption on the wire and
//! **mutual** certificate authentication.
//!
//! A [`TlsConfig`] is built once, from PEM files or bytes: this node's certificate
//! chain and private key, and the CA that signs every peer's certificate. Both sides
//! present a certificate and both verify the other's against the CA:
//!
//! - a server requires a client certificate signed by the CA (a client without one, or
//!   with one from another CA, fails the TLS handshake; the server counts it as an
//!   authentication failure);
//! - a client verifies that the server's certificate is signed by the CA **and** names
//!   the host it dialed (a DNS or IP subject alternative name), as HTTPS does.
//!
//! The peer's certificate **identity** — its subject common name, else its first DNS,
//! URI or IP subject alternative name — becomes the connection's authenticated
//! identity ([`PeerInfo::tls_identity`](super::PeerInfo::tls_identity)): it is logged,
//! and leases are bound to it rather than to the peer id the client claims. TLS runs
//! before the kvferry handshake, which is unchanged (a shared secret may be used as
//! well).
//!
//! A plaintext kvferry client that reaches a TLS server is told so in a plaintext
//! `Error` frame (its first byte is the frame magic's, never a TLS record's) and
//! closed; a TLS client reaching a plaintext server fails its TLS handshake with an
//! error that says what to check. Bad files are [`TlsError`]s naming the file.
//!
//! Only TLS 1.3 is spoken, by servers and clients: a peer offering at most TLS 1.2
//! fails the handshake (on a server, an authentication failure).
//!
//! TLS 1.3 session tickets are disabled on servers: nothing is ever sent unasked on an
//! idle connection, so pools can still tell a closed connection from a live one.
//!
//! # Cancellation
//!
//! The TLS handshakes run inside the connection handshake and under its timeout;
//! dropping them closes the socket and leaves nothing behind.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::TcpStream;
use tokio_rustls::rustls;
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{ClientConfig, RootCertStore, ServerConfig};

use super::stream::TlsTcp;

/// Why TLS material could not be loaded or used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("cannot read TLS {what} file {}: {source}", path.display())]
    Read {
        /// What the file should hold ("certificate", "private key", "CA").
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A file is not valid PEM or holds nothing of the expected kind.
    #[error("TLS {what} file {name}: {reason}")]
    Pem {
        /// What the file should hold.
        what: &'static str,
        /// The file (or "(in memory)").
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The certificate and the private key do not belong together, or rustls refused
    /// them (unsupported key type, malformed certificate).
    #[error("TLS certificate {cert} and key {key} cannot be used together: {reason}")]
    Mismatch {
        /// The certificate file.
        cert: String,
        /// The key file.
        key: String,
        /// rustls' reason.
        reason: String,
    },
    /// The CA file holds no usable certificate, or the verifier could not be built.
    #[error("TLS CA {name}: {reason}")]
    Ca {
        /// The CA file.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// The certificate names no identity (no common name, no subject alternative name).
    #[error("TLS certificate {name} names no identity (no CN, no DNS/URI/IP SAN)")]
    NoIdentity {
        /// The certificate file.
        name: String,
    },
}

impl TlsError {
    /// The stable code of this error (every variant is one).
    pub fn code(&self) -> crate::ErrorCode {
        crate::ErrorCode::InvalidConfig
    }
}

/// TLS settings of a node, validated when built; cheap to clone.
#[derive(Clone)]
pub struct TlsConfig {
    client: Arc<ClientConfig>,
    /// `None` for a client without a certificate (it can serve nothing).
    server: Option<Arc<ServerConfig>>,
    identity: Option<String>,
}

impl std::fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsConfig")
            .field("identity", &self.identity)
            .field("can_serve", &self.server.is_some())
            .finish()
    }
}

/// PEM bytes and the name errors use for them.
struct Pem<'a> {
    bytes: &'a [u8],
    name: String,
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })
}

fn certs(what: &'static str, pem: &Pem<'_>) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bad = |reason: String| TlsError::Pem {
        what,
        name: pem.name.clone(),
        reason,
    };
    let certs = CertificateDer::pem_slice_iter(pem.bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(e.to_string()))?;
    if certs.is_empty() {
        return Err(bad("no CERTIFICATE section".into()));
    }
    Ok(certs)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl TlsConfig {
    /// Loads this node's certificate chain, private key and the peers' CA from PEM
    /// files (`--tls-cert`, `--tls-key`, `--tls-ca`).
    pub fn from_files(cert: &Path, key: &Path, ca: &Path) -> Result<TlsConfig, TlsError> {
        let (c, k, a) = (read("certificate", cert)?, read("private key", key)?, read("CA", ca)?);
        TlsConfig::build(
            Some((
                Pem {
                    bytes: &c,
                    name: cert.display().to_string(),
                },
                Pem {
                    bytes: &k,
                    name: key.display().to_string(),
                },
            )),
            Pem {
                bytes: &a,
                name: ca.display().to_string(),
            },
        )
    }

    /// As [`from_files`](Self::from_files), from PEM bytes in memory.
    pub fn from_pem(cert: &[u8], key: &[u8], ca: &[u8]) -> Result<TlsConfig, TlsError> {
        let name = |n: &str| format!("({n}, in memory)");
        TlsConfig::build(
            Some((
                Pem {
                    bytes: cert,
                    name: name("certificate"),
                },
                Pem {
                    bytes: key,
                    name: name("key"),
                },
            )),
            Pem {
                bytes: ca,
                name: name("CA"),
            },
        )
    }

    /// A client that verifies servers against `ca` but presents no certificate of its
    /// own (servers, which all require one, refuse it). It cannot serve.
    pub fn client_without_certificate(ca: &[u8]) -> Result<TlsConfig, TlsError> {
        TlsConfig::build(
            None,
            Pem {
                bytes: ca,
                name: "(CA, in memory)".into(),
            },
        )
    }

    fn build(own: Option<(Pem<'_>, Pem<'_>)>, ca: Pem<'_>) -> Result<TlsConfig, TlsError> {
        let ca_err = |reason: String| TlsError::Ca {
            name: ca.name.clone(),
            reason,
        };
        let mut roots = RootCertStore::empty();
        for c in certs("CA", &ca)? {
            roots.add(c).map_err(|e| ca_err(e.to_string()))?;
        }
        let roots = Arc::new(roots);
        // TLS 1.3 only (the docs promise it; a 1.2-only peer fails the handshake).
        let versions: &[&rustls::SupportedProtocolVersion] = &[&rustls::version::TLS13];
        let client = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(versions)
            .map_err(|e| ca_err(e.to_string()))?
            .with_root_certificates(roots.clone());
        let Some((cert, key)) = own else {
            return Ok(TlsConfig {
                client: Arc::new(client.with_no_client_auth()),
                server: None,
                identity: None,
            });
        };
        let chain = certs("certificate", &cert)?;
        let private = PrivateKeyDer::from_pem_slice(key.bytes).map_err(|e| TlsError::Pem {
            what: "private key",
            name: key.name.clone(),
            reason: e.to_string(),
        })?;
        let identity = identity_of(&chain[0]).ok_or_else(|| TlsError::NoIdentity {
            name: cert.name.clone(),
        })?;
        let mismatch = |e: rustls::Error| TlsError::Mismatch {
            cert: cert.name.clone(),
            key: key.name.clone(),
            reason: e.to_string(),
        };
        let client = client
            .with_client_auth_cert(chain.clone(), private.clone_key())
            .map_err(mismatch)?;
        let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider())
            .build()
            .map_err(|e| ca_err(e.to_string()))?;
        let mut server = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(versions)
            .map_err(|e| ca_err(e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain, private)
            .map_err(mismatch)?;
        server.send_tls13_tickets = 0;
        Ok(TlsConfig {
            client: Arc::new(client),
            server: Some(Arc::new(server)),
            identity: Some(identity),
        })
    }

    /// The identity this node's own certificate names (`None` without one).
    pub fn identity(&self) -> Option<&str> {
        self.identity.as_deref()
    }

    /// True if this configuration can serve (it has a certificate and key).
    pub fn can_serve(&self) -> bool {
        self.server.is_some()
    }

    /// The client side of the TLS handshake with the server at `addr` (`host:port`),
    /// whose certificate must name `host`; returns the server's identity too.
    pub(crate) async fn connect(
        &self,
        addr: &str,
        tcp: TcpStream,
    ) -> Result<(tokio_rustls::client::TlsStream<TlsTcp>, Option<String>), String> {
        let host = host_of(addr);
        let name = ServerName::try_from(host.to_string())
            .map_err(|e| format!("{host:?} is not a name a certificate can be checked against: {e}"))?;
        let stream = tokio_rustls::TlsConnector::from(self.client.clone())
            .connect(name, TlsTcp::new(tcp))
            .await
            .map_err(|e| {
                format!("{e} (does the server run with TLS, and its certificate name {host} and come from our CA?)")
            })?;
        let mut stream = stream;
        stream
            .get_mut()
            .1
            .set_buffer_limit(Some(super::stream::TLS_WRITE_BUFFER));
        let identity = stream
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .and_then(identity_of);
        Ok((stream, identity))
    }

    /// The server side of the TLS handshake; returns the client's identity.
    pub(crate) async fn accept(
        &self,
        tcp: TcpStream,
    ) -> Result<(tokio_rustls::server::TlsStream<TlsTcp>, String), AcceptError> {
        let server = self.server.clone().ok_or(AcceptError::Other(
            "this TLS configuration has no certificate to serve with".into(),
        ))?;
        let stream = tokio_rustls::TlsAcceptor::from(server)
            .accept(TlsTcp::new(tcp))
            .await
            .map_err(|e| {
                let tls = e.get_ref().is_some_and(|i| i.is::<rustls::Error>());
                match tls {
                    true => AcceptError::Refused(e.to_string()),
                    false => AcceptError::Other(e.to_string()),
                }
            })?;
        let identity = stream
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .and_then(identity_of)
            .ok_or_else(|| AcceptError::Refused("the client certificate names no identity".into()))?;
        let mut stream = stream;
        stream
            .get_mut()
            .1
            .set_buffer_limit(Some(super::stream::TLS_WRITE_BUFFER));
        Ok((stream, identity))
    }
}

/// Why the server side of a TLS handshake failed.
#[derive(Debug)]
pub(crate) enum AcceptError {
    /// The client failed TLS authentication (no certificate, an untrusted one, a TLS
    /// protocol error): an authentication failure.
    Refused(String),
    /// I/O: the client went away.
    Other(String),
}

/// The host part of `host:port` (brackets of an IPv6 literal removed).
fn host_of(addr: &str) -> &str {
    let host = match addr.rsplit_once(':') {
        Some((h, p)) if p.chars().all(|c| c.is_ascii_digit()) => h,
        _ => addr,
    };
    host.trim_start_matches('[').trim_end_matches(']')
}

/// A certificate's identity: its subject common name, else its first DNS, URI or IP
/// subject alternative name.
fn identity_of(cert: &CertificateDer<'_>) -> Option<String> {
    use x509_parser::extensions::GeneralName;
    let (_, x) = x509_parser::parse_x509_certificate(cert.as_ref()).ok()?;
    if let Some(cn) = x.subject().iter_common_name().next().and_then(|c| c.as_str().ok()) {
        if !cn.is_empty() {
            return Some(cn.to_string());
        }
    }
    let san = x.subject_alternative_name().ok()??;
    san.value.general_names.iter().find_map(|n| match n {
        GeneralName::DNSName(s) | GeneralName::URI(s) => Some(s.to_string()),
        GeneralName::IPAddress(b) => match b.len() {
            4 => Some(std::net::Ipv4Addr::from(<[u8; 4]>::try_from(*b).ok()?).to_string()),
            16 => Some(std::net::Ipv6Addr::from(<[u8; 16]>::try_from(*b).ok()?).to_string()),
            _ => None,
        },
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_of_strips_the_port_and_brackets() {
        assert_eq!(host_of("127.0.0.1:9000"), "127.0.0.1");
        assert_eq!(host_of("[::1]:9000"), "::1");
        assert_eq!(host_of("prefill-0.local:1"), "prefill-0.local");
        assert_eq!(host_of("node"), "node");
    }
}
