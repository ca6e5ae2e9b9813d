//! TLS material generated per test (rcgen): a [`Ca`] that issues node certificates.
#![allow(dead_code)]

use kvferry::net::TlsConfig;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};

/// A CA that signs node certificates.
pub struct Ca {
    pub cert: rcgen::Certificate,
    pub key: KeyPair,
}

impl Ca {
    /// A self-signed CA named `name`.
    pub fn new(name: &str) -> Ca {
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(DnType::CommonName, name);
        let key = KeyPair::generate().unwrap();
        let cert = p.self_signed(&key).unwrap();
        Ca { cert, key }
    }

    /// The CA's certificate, PEM.
    pub fn pem(&self) -> String {
        self.cert.pem()
    }

    /// A node certificate (CN `cn`, valid for 127.0.0.1 and localhost) and its key, PEM.
    pub fn issue(&self, cn: &str) -> (String, String) {
        let mut p = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()]).unwrap();
        p.distinguished_name.push(DnType::CommonName, cn);
        let key = KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, &self.cert, &self.key).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    /// A node's TLS configuration: a certificate [`issue`](Ca::issue)d for `cn`,
    /// trusting this CA.
    pub fn tls(&self, cn: &str) -> TlsConfig {
        let (cert, key) = self.issue(cn);
        TlsConfig::from_pem(cert.as_bytes(), key.as_bytes(), self.pem().as_bytes()).unwrap()
    }
}
