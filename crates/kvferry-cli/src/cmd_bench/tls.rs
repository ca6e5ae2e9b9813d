//! Ephemeral TLS material for `kvferry bench --tls`: a CA and one certificate per
//! engine, generated in memory for the run (valid for 127.0.0.1), never written out (a
//! producer process gets its PEMs on its stdin).

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
        let (cert, key, ca) = self.node_pem(cn)?;
        from_pem(&(cert, key, ca))
    }

    /// The PEMs of a certificate for the engine named `cn`: `(certificate, key, CA)`,
    /// handed to the producer process on its stdin (never written to a file).
    pub fn node_pem(&self, cn: &str) -> anyhow::Result<(String, String, String)> {
        let mut p = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])?;
        p.distinguished_name.push(DnType::CommonName, cn);
        let key = KeyPair::generate()?;
        let cert = p.signed_by(&key, &self.cert, &self.key)?;
        Ok((cert.pem(), key.serialize_pem(), self.cert.pem()))
    }
}

/// The mutual-TLS configuration of `(certificate, key, CA)` PEMs.
pub fn from_pem((cert, key, ca): &(String, String, String)) -> anyhow::Result<TlsConfig> {
    Ok(TlsConfig::from_pem(cert.as_bytes(), key.as_bytes(), ca.as_bytes())?)
}
