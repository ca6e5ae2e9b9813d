//! Ephemeral TLS material for `kvferry bench --tls`: a CA and one certificate per
//! engine, generated in memory for the run (valid for 127.0.0.1), never written out.

use kvferry::net::TlsConfig;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};

/// A CA generated for one benchmark run.
pub struct EphemeralCa {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl EphemeralCa {
    pub fn new() -> anyhow::Result<EphemeralCa> {
        let mut p = CertificateParams::new(Vec::<String>::new())?;
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(DnType::CommonName, "kvferry bench CA");
        let key = KeyPair::generate()?;
        let cert = p.self_signed(&key)?;
        Ok(EphemeralCa { cert, key })
    }

    /// A mutual-TLS configuration for the engine named `cn`.
    pub fn node(&self, cn: &str) -> anyhow::Result<TlsConfig> {
        let mut p = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])?;
        p.distinguished_name.push(DnType::CommonName, cn);
        let key = KeyPair::generate()?;
        let cert = p.signed_by(&key, &self.cert, &self.key)?;
        let ca = self.cert.pem();
        Ok(TlsConfig::from_pem(
            cert.pem().as_bytes(),
            key.serialize_pem().as_bytes(),
            ca.as_bytes(),
        )?)
    }
}
