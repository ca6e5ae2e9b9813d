//! [`EngineOptions`]: every setting an embedder starts an engine with, declared once —
//! its name, its type, its default and its documentation are the field below, its
//! check is [`EngineOptions::validate`] (or, where a lower layer owns the rule, that
//! layer's own check, reached through [`EngineOptions::to_config`]).
//!
//! Every front end reads this one list:
//!
//! - the Python package: `kvferry.Engine(**kwargs)` hands its keyword arguments to the
//!   binding, which deserializes them into this type (serde: an unknown name is an
//!   error naming it); `_kvferry.EngineOptions.defaults()` returns [`Default`]'s values,
//!   and the package's tests check that every keyword of `kvferry.Engine` exists here
//!   with the same default (and every field there);
//! - the `kvferry` command: `serve`, `bench` and `chaos` turn their flags into this type
//!   ([`EngineOptions::serving`] are their defaults: a bigger arena with bigger pages,
//!   for a process that only serves), and the command's tests check each flag's default
//!   against it; `serve --config FILE` sets the same flags.
//!
//! Durations are seconds (floats) when serialized, so a Python caller writes
//! `io_timeout=5.0`; sizes are bytes.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::config::{EngineConfig, StoreConfig};
use crate::net::{NetConfig, TlsConfig};
use crate::peer::{ProducerConfig, Transport};
use crate::wire::Limits;

/// A setting that cannot be used; the message names it as the caller wrote it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{option}: {why}")]
pub struct OptionError {
    /// The option's name (the field, which is also the Python keyword).
    pub option: &'static str,
    /// What is wrong with its value.
    pub why: String,
    /// The stable code: `InvalidArgument` for a value out of range, or the code of
    /// the lower layer's error (a TLS file that cannot be loaded: `InvalidConfig`).
    pub code: crate::ErrorCode,
}

impl OptionError {
    fn new(option: &'static str, why: impl Into<String>) -> OptionError {
        OptionError {
            option,
            why: why.into(),
            code: crate::ErrorCode::InvalidArgument,
        }
    }

    fn with_code(mut self, code: crate::ErrorCode) -> OptionError {
        self.code = code;
        self
    }
}

/// Every setting of an engine. Build with `EngineOptions { field: …, ..Default::default() }`
/// (or deserialize it), check with [`validate`](Self::validate), turn into an
/// [`EngineConfig`] with [`to_config`](Self::to_config).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineOptions {
    // -- identity and addresses ----------------------------------------------------
    /// `"host:port"` to serve peers on, or `None` for a client-only engine.
    pub listen: Option<String>,
    /// The engine's stable name (`None`: `kvferry-<pid>-<random>`).
    pub peer_id: Option<String>,
    /// Shared secret peers must prove (HMAC handshake), or `None` for no secret.
    #[serde(with = "secret_bytes")]
    pub secret: Option<Vec<u8>>,
    /// This engine's certificate chain (PEM file); with `tls_key` and `tls_ca`: mutual
    /// TLS 1.3 on every connection. All three or none.
    pub tls_cert: Option<PathBuf>,
    /// The private key of `tls_cert` (PEM file).
    pub tls_key: Option<PathBuf>,
    /// The CA (PEM file) that signs every peer's certificate.
    pub tls_ca: Option<PathBuf>,

    // -- memory ----------------------------------------------------------------------
    /// Size of the host staging arena in bytes (whole pages, at least one).
    pub arena_bytes: usize,
    /// Staging page size in bytes.
    pub page_size: usize,
    /// Ask for mlocked staging memory (falls back, and says so, when refused).
    pub pinned: bool,
    /// Copy threads (`None`: the available cores).
    pub copy_threads: Option<usize>,
    /// Size of the copy-in store (`put`) in bytes.
    pub store_bytes: usize,
    /// Block size of the copy-in store in bytes (a chunk takes whole blocks).
    pub store_block_bytes: usize,
    /// Most chunks the store holds (least recently used are evicted).
    pub store_capacity: usize,

    // -- leases and what peers may hold ------------------------------------------------
    /// TTL this engine asks for the leases it stages on peers for its pulls (seconds).
    #[serde(with = "seconds")]
    pub lease_ttl: Duration,
    /// TTL granted to peers' leases and to publications by default (seconds).
    #[serde(with = "seconds")]
    pub ttl: Duration,
    /// Longest TTL granted (seconds; `None`: `ttl`).
    #[serde(with = "opt_seconds")]
    pub max_ttl: Option<Duration>,
    /// How long an eager get's staged pages outlive its connection when it closes
    /// without `Done` (seconds; zero releases them at once).
    #[serde(with = "seconds")]
    pub lease_grace: Duration,
    /// Staging requests served at once; more get an immediate "busy" miss.
    pub max_gets: usize,
    /// Staging pages one peer may hold at once (`None`: half the arena).
    pub peer_quota_pages: Option<usize>,
    /// Staging pages the requests of one connection may hold (`None`: the peer quota).
    pub connection_quota_pages: Option<usize>,
    /// Staging pages peers without a TLS certificate may hold from one source address
    /// (IPv6: a /64) whatever peer ids they claim (`None`: three quarters of the arena,
    /// or the peer quota if larger).
    pub source_quota_pages: Option<usize>,
    /// Staging pages all peers without a TLS certificate may hold together (`None`:
    /// seven eighths of the arena, or the peer quota if larger).
    pub unproven_quota_pages: Option<usize>,

    // -- the network -----------------------------------------------------------------
    /// An I/O step making no progress for this long fails (seconds).
    #[serde(with = "seconds")]
    pub io_timeout: Duration,
    /// Bound on connecting to a peer (seconds).
    #[serde(with = "seconds")]
    pub connect_timeout: Duration,
    /// Pooled connections to each peer.
    pub connections_per_peer: usize,
    /// A frame moving slower than this many bytes per second fails once it took longer
    /// than `min_rate_grace` (0: off).
    pub min_rate: u64,
    /// The grace of `min_rate` (seconds).
    #[serde(with = "seconds")]
    pub min_rate_grace: Duration,
    /// Idle connections are closed after this long (seconds).
    #[serde(with = "seconds")]
    pub idle_timeout: Duration,
    /// Accepted connections at once; more are refused.
    pub max_connections: usize,
    /// Largest control frame accepted, in bytes.
    pub max_control_bytes: u64,
    /// Largest bulk frame (chunk) accepted, in bytes.
    pub max_bulk_bytes: u64,
    /// Which movers carry bytes: `"auto"` (the default) reads a producer on the same
    /// host with `process_vm_readv`, one copy, and uses the socket elsewhere (or when
    /// the kernel refuses, with the reason in the stats); `"tcp"` puts every byte on
    /// the connection, as a producer and as a consumer.
    pub transport: Transport,

    // -- the directory ---------------------------------------------------------------
    /// `etcd://HOST:PORT[,HOST:PORT…]` of the peer directory, or `None`.
    pub etcd: Option<String>,
    /// The etcd namespace (records live under `NAME/peers/`).
    pub namespace: String,
    /// TTL of the engine's etcd registration (seconds).
    #[serde(with = "seconds")]
    pub directory_ttl: Duration,
    /// `"prefill"`, `"decode"` or `"both"`, registered in the directory.
    pub role: String,
    /// The address registered in the directory (`None`: the bound one).
    pub advertise: Option<String>,

    // -- read by the embedder that owns the runtime and the device -------------------
    /// `"host"`, `"sim"` (a simulated accelerator) or `"cuda:N"`.
    pub device: String,
    /// Simulated time per device copy (`device = "sim"`), microseconds.
    pub device_latency_us: u64,
    /// Bound on each device copy, from its submission (seconds).
    #[serde(with = "seconds")]
    pub device_timeout: Duration,
    /// Threads of the engine's I/O runtime.
    pub runtime_threads: usize,
    /// Run on the process's shared runtime of `runtime_threads` threads.
    pub shared_runtime: bool,
    /// How long a thread waiting on a transfer polls before it sleeps, microseconds
    /// (at most one second; the budget adapts; 0: never spin).
    pub wait_spin_us: u64,
}

/// The most `wait_spin_us` may be: one second.
pub const MAX_WAIT_SPIN_US: u64 = 1_000_000;

impl Default for EngineOptions {
    /// The defaults of an engine embedded in an inference process.
    fn default() -> Self {
        let producer = ProducerConfig::default();
        let net = NetConfig::new("defaults");
        let limits = Limits::default();
        EngineOptions {
            listen: Some("127.0.0.1:0".into()),
            peer_id: None,
            secret: None,
            tls_cert: None,
            tls_key: None,
            tls_ca: None,
            arena_bytes: 64 << 20,
            page_size: 1 << 20,
            pinned: true,
            copy_threads: None,
            store_bytes: 64 << 20,
            store_block_bytes: 64 << 10,
            store_capacity: 100_000,
            lease_ttl: Duration::from_secs(10),
            ttl: producer.default_ttl,
            max_ttl: None,
            lease_grace: producer.lease_grace,
            max_gets: producer.max_concurrent_gets,
            peer_quota_pages: None,
            connection_quota_pages: None,
            source_quota_pages: None,
            unproven_quota_pages: None,
            io_timeout: net.io_timeout,
            connect_timeout: net.connect_timeout,
            connections_per_peer: net.connections_per_peer,
            min_rate: net.min_rate,
            min_rate_grace: net.min_rate_grace,
            idle_timeout: net.idle_timeout,
            max_connections: net.max_connections,
            max_control_bytes: limits.max_control_bytes,
            max_bulk_bytes: limits.max_bulk_bytes,
            transport: Transport::Auto,
            etcd: None,
            namespace: "kvferry".into(),
            directory_ttl: Duration::from_secs(10),
            role: "both".into(),
            advertise: None,
            device: "host".into(),
            device_latency_us: 0,
            device_timeout: Duration::from_secs(5),
            runtime_threads: 2,
            shared_runtime: true,
            wait_spin_us: 200,
        }
    }
}

impl EngineOptions {
    /// The defaults of a process that only serves (`kvferry serve`, the benchmarks):
    /// a 256 MiB arena of 2 MiB pages, since staging is all such a process's memory is
    /// for; everything else as [`Default`].
    pub fn serving() -> EngineOptions {
        EngineOptions {
            arena_bytes: 256 << 20,
            page_size: 2 << 20,
            ..EngineOptions::default()
        }
    }

    /// Checks what no layer below checks; the lower layers' rules (timeouts, TTL
    /// order, arena geometry) are checked by [`to_config`](Self::to_config) and
    /// [`Engine::start`](super::Engine::start).
    pub fn validate(&self) -> Result<(), OptionError> {
        let at_least_one = |option, v: usize| {
            if v == 0 {
                Err(OptionError::new(option, "must be at least 1"))
            } else {
                Ok(())
            }
        };
        at_least_one("page_size", self.page_size)?;
        at_least_one("store_block_bytes", self.store_block_bytes)?;
        at_least_one("runtime_threads", self.runtime_threads)?;
        if let Some(t) = self.copy_threads {
            at_least_one("copy_threads", t)?;
        }
        if self.arena_bytes < self.page_size {
            return Err(OptionError::new(
                "arena_bytes",
                format!("{} must hold at least one page of {}", self.arena_bytes, self.page_size),
            ));
        }
        for (option, d) in [
            ("lease_ttl", self.lease_ttl),
            ("device_timeout", self.device_timeout),
            ("directory_ttl", self.directory_ttl),
        ] {
            if d.is_zero() {
                return Err(OptionError::new(option, "must be greater than zero"));
            }
        }
        if self.wait_spin_us > MAX_WAIT_SPIN_US {
            return Err(OptionError::new(
                "wait_spin_us",
                format!(
                    "must be at most {MAX_WAIT_SPIN_US} (one second, in microseconds), got {}",
                    self.wait_spin_us
                ),
            ));
        }
        if !is_device_name(&self.device) {
            return Err(OptionError::new(
                "device",
                format!(
                    "{:?} is not supported: \"host\" (host memory), \"sim\" (a simulated accelerator) or \"cuda:N\" (GPU N)",
                    self.device
                ),
            ));
        }
        self.role
            .parse::<crate::directory::Role>()
            .map_err(|e| OptionError::new("role", e))?;
        match (&self.tls_cert, &self.tls_key, &self.tls_ca) {
            (None, None, None) | (Some(_), Some(_), Some(_)) => {}
            _ => return Err(OptionError::new("tls_cert", "tls_cert, tls_key and tls_ca go together")),
        }
        Ok(())
    }

    /// The longest TTL granted: `max_ttl`, or `ttl` when unset.
    pub fn max_ttl(&self) -> Duration {
        self.max_ttl.unwrap_or(self.ttl)
    }

    /// The [`EngineConfig`] these options describe (validated; TLS files loaded and
    /// checked now). What the embedder owns — the device, the runtime, the directory's
    /// connection — is left to it: `device*`, `runtime_threads`, `shared_runtime`,
    /// `wait_spin_us`, `etcd`, `namespace` and `directory_ttl` are read from the
    /// options by the embedder.
    pub fn to_config(&self) -> Result<EngineConfig, OptionError> {
        self.validate()?;
        let base = EngineConfig::default();
        let mut net = base.net.clone();
        if let Some(id) = &self.peer_id {
            net.peer_id = id.clone();
        }
        net.secret = self.secret.clone();
        net.tls = match (&self.tls_cert, &self.tls_key, &self.tls_ca) {
            (Some(cert), Some(key), Some(ca)) => Some(
                TlsConfig::from_files(cert, key, ca)
                    .map_err(|e| OptionError::new("tls", e.to_string()).with_code(e.code()))?,
            ),
            _ => None,
        };
        net.io_timeout = self.io_timeout;
        net.connect_timeout = self.connect_timeout;
        net.connections_per_peer = self.connections_per_peer;
        net.min_rate = self.min_rate;
        net.min_rate_grace = self.min_rate_grace;
        net.idle_timeout = self.idle_timeout;
        net.max_connections = self.max_connections;
        net.limits = Limits {
            max_control_bytes: self.max_control_bytes,
            max_bulk_bytes: self.max_bulk_bytes,
            ..Limits::default()
        };
        net.validate()
            .map_err(|e| OptionError::new("network", e.to_string()).with_code(e.code()))?;
        let mut copy = base.copy.clone();
        if let Some(t) = self.copy_threads {
            copy.threads = t;
        }
        let cfg = EngineConfig {
            listen: self.listen.clone(),
            net,
            arena_bytes: self.arena_bytes,
            page_size: self.page_size,
            pinned: self.pinned,
            copy,
            store: StoreConfig::Bytes {
                bytes: self.store_bytes,
                block_bytes: self.store_block_bytes,
            },
            store_capacity: self.store_capacity,
            lease_ttl: self.lease_ttl,
            producer: ProducerConfig {
                default_ttl: self.ttl,
                max_ttl: self.max_ttl(),
                max_concurrent_gets: self.max_gets,
                max_staged_pages_per_peer: self.peer_quota_pages,
                max_staged_pages_per_connection: self.connection_quota_pages,
                max_staged_pages_per_source: self.source_quota_pages,
                max_unproven_staged_pages: self.unproven_quota_pages,
                lease_grace: self.lease_grace,
                transport: self.transport,
            },
            role: self.role.parse().map_err(|e: String| OptionError::new("role", e))?,
            advertise: self.advertise.clone(),
            ..base
        };
        Ok(cfg)
    }
}

/// `"host"`, `"sim"`, `"cuda"` or `"cuda:N"`.
pub fn is_device_name(name: &str) -> bool {
    match name {
        "host" | "sim" | "cuda" => true,
        _ => name
            .strip_prefix("cuda:")
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())),
    }
}

/// A number of seconds: finite, not negative, below a billion.
fn seconds_value<E: serde::de::Error>(s: f64) -> Result<Duration, E> {
    if s.is_finite() && (0.0..1e9).contains(&s) {
        Ok(Duration::from_secs_f64(s))
    } else {
        Err(E::custom(format!("{s} is not a number of seconds (finite, 0 or more)")))
    }
}

/// A [`Duration`] as seconds (a float; integers accepted).
mod seconds {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        super::seconds_value(f64::deserialize(d)?)
    }
}

/// An optional [`Duration`] as seconds or null.
mod opt_seconds {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_some(&d.as_secs_f64()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        Option::<f64>::deserialize(d)?.map(super::seconds_value).transpose()
    }
}

/// A secret given as text or bytes (a list of bytes too); serialized as bytes.
mod secret_bytes {
    use serde::de::{self, Deserializer, SeqAccess, Visitor};
    use serde::Serializer;

    pub fn serialize<S: Serializer>(v: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(b) => s.serialize_some(&serde_bytes_like(b)),
            None => s.serialize_none(),
        }
    }

    struct Bytes<'a>(&'a [u8]);

    impl serde::Serialize for Bytes<'_> {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_bytes(self.0)
        }
    }

    fn serde_bytes_like(b: &[u8]) -> Bytes<'_> {
        Bytes(b)
    }

    struct SecretVisitor;

    impl<'de> Visitor<'de> for SecretVisitor {
        type Value = Option<Vec<u8>>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a secret: text, bytes, or none")
        }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_any(SecretVisitor)
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
            Ok(Some(v.as_bytes().to_vec()))
        }
        fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Self::Value, E> {
            Ok(Some(v.to_vec()))
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some(b) = seq.next_element::<u8>()? {
                out.push(b);
            }
            Ok(Some(out))
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
        d.deserialize_option(SecretVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_make_a_valid_config_matching_the_layers_defaults() {
        let o = EngineOptions::default();
        o.validate().unwrap();
        let cfg = o.to_config().unwrap();
        let base = EngineConfig::default();
        assert_eq!(cfg.listen, base.listen);
        assert_eq!(cfg.arena_bytes, base.arena_bytes);
        assert_eq!(cfg.page_size, base.page_size);
        assert_eq!(cfg.lease_ttl, base.lease_ttl);
        assert_eq!(cfg.producer.default_ttl, base.producer.default_ttl);
        assert_eq!(cfg.producer.max_ttl, base.producer.max_ttl);
        assert_eq!(cfg.net.io_timeout, base.net.io_timeout);
        assert_eq!(cfg.net.limits, base.net.limits);
        EngineOptions::serving().to_config().unwrap();
    }

    #[test]
    fn each_bad_value_is_named() {
        let bad = |f: fn(&mut EngineOptions)| {
            let mut o = EngineOptions::default();
            f(&mut o);
            o.to_config().unwrap_err().option
        };
        assert_eq!(bad(|o| o.wait_spin_us = 1_000_001), "wait_spin_us");
        assert_eq!(bad(|o| o.runtime_threads = 0), "runtime_threads");
        assert_eq!(bad(|o| o.copy_threads = Some(0)), "copy_threads");
        assert_eq!(bad(|o| o.page_size = 0), "page_size");
        assert_eq!(bad(|o| o.arena_bytes = 1000), "arena_bytes");
        assert_eq!(bad(|o| o.device = "tpu".into()), "device");
        assert_eq!(bad(|o| o.device = "cuda:x".into()), "device");
        assert_eq!(bad(|o| o.role = "leader".into()), "role");
        assert_eq!(bad(|o| o.tls_cert = Some("c.pem".into())), "tls_cert");
        assert_eq!(bad(|o| o.lease_ttl = Duration::ZERO), "lease_ttl");
        assert_eq!(bad(|o| o.io_timeout = Duration::ZERO), "network");
        let ok = EngineOptions {
            device: "cuda:3".into(),
            wait_spin_us: MAX_WAIT_SPIN_US,
            ..EngineOptions::default()
        };
        ok.validate().unwrap();
    }

    #[test]
    fn deserializes_seconds_secrets_and_refuses_unknown_names() {
        let o: EngineOptions = serde_json::from_str(
            r#"{"io_timeout": 2.5, "max_ttl": 30, "secret": "s3cret", "lease_grace": 0, "listen": null}"#,
        )
        .unwrap();
        assert_eq!(o.io_timeout, Duration::from_millis(2500));
        assert_eq!(o.max_ttl(), Duration::from_secs(30));
        assert_eq!(o.secret.as_deref(), Some(&b"s3cret"[..]));
        assert_eq!(o.lease_grace, Duration::ZERO);
        assert_eq!(o.listen, None);
        assert_eq!(o.arena_bytes, EngineOptions::default().arena_bytes, "unset: default");
        let bytes: EngineOptions = serde_json::from_str(r#"{"secret": [1, 2, 255]}"#).unwrap();
        assert_eq!(bytes.secret, Some(vec![1, 2, 255]));
        let e = serde_json::from_str::<EngineOptions>(r#"{"io_timeot": 1}"#).unwrap_err();
        assert!(e.to_string().contains("io_timeot"), "{e}");
        let e = serde_json::from_str::<EngineOptions>(r#"{"io_timeout": -1}"#).unwrap_err();
        assert!(e.to_string().contains("seconds"), "{e}");
    }

    #[test]
    fn ttl_order_is_the_producers_rule() {
        let o = EngineOptions {
            ttl: Duration::from_secs(20),
            max_ttl: Some(Duration::from_secs(5)),
            ..EngineOptions::default()
        };
        // Not checked twice: the options pass, the producer refuses at start.
        o.validate().unwrap();
        let cfg = o.to_config().unwrap();
        assert!(cfg.producer.default_ttl > cfg.producer.max_ttl);
    }
}
