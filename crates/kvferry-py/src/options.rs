//! `EngineOptions`: everything an engine is started with, as one object.
//!
//! The Python `kvferry.Engine` builds one from its keyword arguments (where the
//! defaults and their documentation live) and hands it to the extension's constructor;
//! fields are plain values, readable and writable from Python, and checked when the
//! engine starts (a bad value is an `InvalidArgumentError` naming the field).

use pyo3::prelude::*;

/// Everything `_kvferry.Engine` is started with (see `kvferry.Engine` for each field).
#[pyclass(name = "EngineOptions", module = "kvferry._kvferry")]
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Address to listen on, or None for a client-only engine.
    #[pyo3(get, set)]
    pub listen: Option<String>,
    /// Shared secret (HMAC handshake), or None.
    #[pyo3(get, set)]
    pub secret: Option<Vec<u8>>,
    /// Staging arena size in bytes.
    #[pyo3(get, set)]
    pub arena_bytes: usize,
    /// Staging page size in bytes.
    #[pyo3(get, set)]
    pub page_size: usize,
    /// The engine's peer id, or None for a generated one.
    #[pyo3(get, set)]
    pub peer_id: Option<String>,
    /// Copy threads, or None for the available cores.
    #[pyo3(get, set)]
    pub copy_threads: Option<usize>,
    /// Copy-in store size in bytes.
    #[pyo3(get, set)]
    pub store_bytes: usize,
    /// Copy-in store block size in bytes.
    #[pyo3(get, set)]
    pub store_block_bytes: usize,
    /// TTL asked for leases staged on peers (seconds).
    #[pyo3(get, set)]
    pub lease_ttl: f64,
    /// TTL granted to peers' leases and publications by default (seconds).
    #[pyo3(get, set)]
    pub default_ttl: f64,
    /// Longest TTL granted (seconds).
    #[pyo3(get, set)]
    pub max_ttl: f64,
    /// An I/O step making no progress for this long fails (seconds).
    #[pyo3(get, set)]
    pub io_timeout: f64,
    /// Bound on connecting to a peer (seconds).
    #[pyo3(get, set)]
    pub connect_timeout: f64,
    /// Pooled connections to each peer.
    #[pyo3(get, set)]
    pub connections_per_peer: usize,
    /// Ask for mlocked staging memory.
    #[pyo3(get, set)]
    pub pinned: bool,
    /// Threads of the engine's I/O runtime.
    #[pyo3(get, set)]
    pub runtime_threads: usize,
    /// Use the process's shared runtime of `runtime_threads` threads.
    #[pyo3(get, set)]
    pub shared_runtime: bool,
    /// `"host"`, `"sim"` or `"cuda[:N]"`.
    #[pyo3(get, set)]
    pub device: String,
    /// Simulated time per device copy (`device="sim"`), microseconds.
    #[pyo3(get, set)]
    pub device_latency_us: u64,
    /// Bound on each device copy (seconds).
    #[pyo3(get, set)]
    pub device_timeout: f64,
    /// `etcd://…` URL of the peer directory, or None.
    #[pyo3(get, set)]
    pub etcd: Option<String>,
    /// The etcd namespace.
    #[pyo3(get, set)]
    pub namespace: String,
    /// TTL of the etcd registration (seconds).
    #[pyo3(get, set)]
    pub directory_ttl: f64,
    /// `"prefill"`, `"decode"` or `"both"`.
    #[pyo3(get, set)]
    pub role: String,
    /// Address registered in the directory, or None for the bound one.
    #[pyo3(get, set)]
    pub advertise: Option<String>,
    /// How long a waiting thread polls before it sleeps (microseconds, ≤ 1 s).
    #[pyo3(get, set)]
    pub wait_spin_us: u64,
    /// This engine's certificate chain (PEM file); with `tls_key` and `tls_ca`, mutual TLS.
    #[pyo3(get, set)]
    pub tls_cert: Option<String>,
    /// The private key of `tls_cert` (PEM file).
    #[pyo3(get, set)]
    pub tls_key: Option<String>,
    /// The CA (PEM file) that signs every peer's certificate.
    #[pyo3(get, set)]
    pub tls_ca: Option<String>,
}

#[pymethods]
impl EngineOptions {
    /// Options with the package's defaults; any field may be given as a keyword.
    #[new]
    #[pyo3(signature = (*, listen=Some("127.0.0.1:0".to_string()), secret=None, arena_bytes=64 << 20,
        page_size=1 << 20, peer_id=None, copy_threads=None, store_bytes=64 << 20,
        store_block_bytes=64 << 10, lease_ttl=10.0, default_ttl=10.0, max_ttl=10.0,
        io_timeout=5.0, connect_timeout=3.0, connections_per_peer=4, pinned=true,
        runtime_threads=2, shared_runtime=true, device="host".to_string(), device_latency_us=0,
        device_timeout=5.0, etcd=None, namespace="kvferry".to_string(), directory_ttl=10.0,
        role="both".to_string(), advertise=None, wait_spin_us=0, tls_cert=None, tls_key=None, tls_ca=None))]
    fn new(
        listen: Option<String>,
        secret: Option<Vec<u8>>,
        arena_bytes: usize,
        page_size: usize,
        peer_id: Option<String>,
        copy_threads: Option<usize>,
        store_bytes: usize,
        store_block_bytes: usize,
        lease_ttl: f64,
        default_ttl: f64,
        max_ttl: f64,
        io_timeout: f64,
        connect_timeout: f64,
        connections_per_peer: usize,
        pinned: bool,
        runtime_threads: usize,
        shared_runtime: bool,
        device: String,
        device_latency_us: u64,
        device_timeout: f64,
        etcd: Option<String>,
        namespace: String,
        directory_ttl: f64,
        role: String,
        advertise: Option<String>,
        wait_spin_us: u64,
        tls_cert: Option<String>,
        tls_key: Option<String>,
        tls_ca: Option<String>,
    ) -> EngineOptions {
        EngineOptions {
            listen,
            secret,
            arena_bytes,
            page_size,
            peer_id,
            copy_threads,
            store_bytes,
            store_block_bytes,
            lease_ttl,
            default_ttl,
            max_ttl,
            io_timeout,
            connect_timeout,
            connections_per_peer,
            pinned,
            runtime_threads,
            shared_runtime,
            device,
            device_latency_us,
            device_timeout,
            etcd,
            namespace,
            directory_ttl,
            role,
            advertise,
            wait_spin_us,
            tls_cert,
            tls_key,
            tls_ca,
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "EngineOptions(listen={:?}, device={:?}, peer_id={:?}, secret={}, tls={}, arena_bytes={}, etcd={:?}, role={:?})",
            self.listen,
            self.device,
            self.peer_id,
            if self.secret.is_some() { "<hidden>" } else { "None" },
            self.tls_cert.is_some(),
            self.arena_bytes,
            self.etcd,
            self.role,
        )
    }
}
