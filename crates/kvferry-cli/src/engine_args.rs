//! The engine's command-line settings (store, staging, limits, secret), turned into a
//! [`kvferry::engine::EngineConfig`]; shared by `serve`, `bench` and `chaos`.

use std::time::Duration;

use clap::Args;
use kvferry::engine::{Engine, EngineConfig, StoreConfig};
use kvferry::layout::{Arrangement, KvLayout, Preset};
use kvferry::mem::ByteSize;
use kvferry::net::{NetConfig, TlsConfig};
use kvferry::peer::ProducerConfig;
use kvferry::wire::Limits;

use crate::util::{parse_model, parse_timeout, read_secret_file};

/// Settings of a node's KV store and staging.
#[derive(Args, Debug, Clone)]
pub struct EngineArgs {
    /// Model preset giving the KV layout: llama3-8b, llama3-70b-tp8, tiny.
    #[arg(long, default_value = "llama3-70b-tp8", value_parser = parse_model)]
    pub model: String,
    /// Blocks in this node's KV region (the store's capacity in blocks).
    #[arg(long, default_value_t = 1024)]
    pub blocks: u32,
    /// Staging arena size.
    #[arg(long, default_value = "256MiB")]
    pub arena: ByteSize,
    /// Staging arena page size.
    #[arg(long, default_value = "2MiB")]
    pub page_size: ByteSize,
    /// Most chunks the store holds (least recently used are evicted).
    #[arg(long, default_value_t = 100_000)]
    pub store_capacity: usize,
    /// Copy threads (default: available cores).
    #[arg(long)]
    pub copy_threads: Option<usize>,
    /// TTL of staged leases not released by `Done` (granted when a client asks for none).
    #[arg(long, default_value = "10s", value_parser = parse_timeout)]
    pub ttl: Duration,
    /// Longest TTL a client may ask for (default: --ttl). Caps how long one client's
    /// staged pages can stay leased without a `Done`.
    #[arg(long, value_parser = parse_timeout)]
    pub max_ttl: Option<Duration>,
    /// Staging pages one peer may hold at once (default: half the arena), so that one
    /// client cannot lock the whole arena.
    #[arg(long)]
    pub peer_quota_pages: Option<usize>,
    /// Staging pages the requests of one connection may hold at once (default: the
    /// peer quota).
    #[arg(long)]
    pub connection_quota_pages: Option<usize>,
    /// Staging pages peers without a TLS certificate may hold from one source address
    /// (IPv6: a /64), whatever peer ids they claim (default: three quarters of the
    /// arena, or the peer quota if larger).
    #[arg(long)]
    pub source_quota_pages: Option<usize>,
    /// Staging pages all peers without a TLS certificate may hold together (default:
    /// seven eighths of the arena, or the peer quota if larger).
    #[arg(long)]
    pub unproven_quota_pages: Option<usize>,
    /// How long an eager get's staged pages outlive its connection when it closes without
    /// `Done` (leases staged for a later pull keep their TTL).
    #[arg(long, default_value = "2s", value_parser = parse_grace)]
    pub lease_grace: Duration,
    /// Staging requests served at once; more get an immediate "busy" miss.
    #[arg(long, default_value_t = 64)]
    pub max_gets: usize,
    /// Shared secret for HMAC authentication (prefer --secret-file or KVFERRY_SECRET).
    #[arg(long, env = "KVFERRY_SECRET", hide_env_values = true)]
    pub secret: Option<String>,
    /// File holding the shared secret.
    #[arg(long, conflicts_with = "secret")]
    pub secret_file: Option<std::path::PathBuf>,
    /// Largest control frame accepted.
    #[arg(long, default_value = "1MiB")]
    pub max_control: ByteSize,
    /// Largest bulk frame (chunk) accepted.
    #[arg(long, default_value = "256MiB")]
    pub max_bulk: ByteSize,
    /// A read or write fails when no byte moved for this long (a progress timeout: a slow
    /// but steady transfer never trips it; each request's own deadline bounds the total).
    #[arg(long, default_value = "5s", value_parser = parse_timeout)]
    pub io_timeout: Duration,
    /// A frame a client sends or receives slower than this, in bytes per second, fails
    /// once it took longer than --min-rate-grace (0: off). Ends trickles that the
    /// progress timeout never trips.
    #[arg(long, default_value = "64KiB")]
    pub min_rate: ByteSize,
    /// The grace of --min-rate.
    #[arg(long, default_value = "5s", value_parser = parse_timeout)]
    pub min_rate_grace: Duration,
    /// Idle connections are closed after this long.
    #[arg(long, default_value = "300s", value_parser = parse_timeout)]
    pub idle_timeout: Duration,
    /// Accepted connections at once; more are refused.
    #[arg(long, default_value_t = 4096)]
    pub max_connections: usize,
    #[command(flatten)]
    pub tls: TlsArgs,
}

/// Mutual TLS between peers: all three flags, or none.
#[derive(Args, Debug, Clone, Default)]
pub struct TlsArgs {
    /// This node's certificate chain (PEM), signed by --tls-ca. Turns on mutual TLS.
    #[arg(long, requires_all = ["tls_key", "tls_ca"])]
    pub tls_cert: Option<std::path::PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, requires_all = ["tls_cert", "tls_ca"])]
    pub tls_key: Option<std::path::PathBuf>,
    /// The CA (PEM) that signs every peer's certificate; peers without one are refused.
    #[arg(long, requires_all = ["tls_cert", "tls_key"])]
    pub tls_ca: Option<std::path::PathBuf>,
}

impl TlsArgs {
    /// The TLS configuration, if the flags ask for TLS (files loaded and checked now).
    pub fn config(&self) -> anyhow::Result<Option<TlsConfig>> {
        match (&self.tls_cert, &self.tls_key, &self.tls_ca) {
            (Some(c), Some(k), Some(a)) => Ok(Some(TlsConfig::from_files(c, k, a)?)),
            (None, None, None) => Ok(None),
            _ => anyhow::bail!("--tls-cert, --tls-key and --tls-ca go together"),
        }
    }
}

/// A grace period: a duration, zero allowed (release at once).
fn parse_grace(s: &str) -> Result<Duration, String> {
    let num = s.trim().trim_end_matches(|c: char| c.is_alphabetic() || c == 'µ');
    if num.trim().parse::<f64>() == Ok(0.0) {
        return Ok(Duration::ZERO);
    }
    parse_timeout(s)
}

impl EngineArgs {
    pub fn layout(&self, arrangement: Arrangement) -> anyhow::Result<KvLayout> {
        let preset: Preset = self.model.parse()?;
        Ok(KvLayout::preset(preset, self.blocks, arrangement)?)
    }

    pub fn secret(&self) -> anyhow::Result<Option<Vec<u8>>> {
        if let Some(f) = &self.secret_file {
            return Ok(Some(read_secret_file(f)?));
        }
        Ok(self.secret.as_ref().map(|s| s.as_bytes().to_vec()))
    }

    pub fn net(&self, peer_id: &str) -> anyhow::Result<NetConfig> {
        let mut net = NetConfig::new(peer_id);
        net.secret = self.secret()?;
        net.io_timeout = self.io_timeout;
        net.min_rate = self.min_rate.bytes();
        net.min_rate_grace = self.min_rate_grace;
        net.idle_timeout = self.idle_timeout;
        net.max_connections = self.max_connections;
        net.tls = self.tls.config()?;
        net.limits = Limits {
            max_control_bytes: self.max_control.bytes(),
            max_bulk_bytes: self.max_bulk.bytes(),
            ..Limits::default()
        };
        net.validate()?;
        Ok(net)
    }

    /// The engine's configuration: the store laid out by `--model`/`--blocks`, serving
    /// on `listen` (`None`: client only) as `peer_id`.
    pub fn config(&self, listen: Option<&str>, peer_id: &str) -> anyhow::Result<EngineConfig> {
        let page = self.page_size.bytes() as usize;
        anyhow::ensure!(page > 0, "--page-size must be greater than zero");
        anyhow::ensure!(
            self.arena.bytes() as usize >= page,
            "--arena ({}) must hold at least one page of {}",
            self.arena,
            self.page_size
        );
        let max_ttl = self.max_ttl.unwrap_or(self.ttl);
        anyhow::ensure!(
            max_ttl >= self.ttl,
            "--max-ttl ({max_ttl:?}) must be at least --ttl ({:?})",
            self.ttl
        );
        let mut cfg = EngineConfig {
            listen: listen.map(str::to_string),
            net: self.net(peer_id)?,
            arena_bytes: self.arena.bytes() as usize,
            page_size: page,
            ..EngineConfig::default()
        };
        if let Some(t) = self.copy_threads {
            anyhow::ensure!(t > 0, "--copy-threads must be at least 1");
            cfg.copy.threads = t;
        }
        cfg.store = StoreConfig::Layout(self.layout(Arrangement::LayerSeparate)?);
        cfg.store_capacity = self.store_capacity;
        cfg.producer = ProducerConfig {
            default_ttl: self.ttl,
            max_ttl,
            max_concurrent_gets: self.max_gets,
            max_staged_pages_per_peer: self.peer_quota_pages,
            max_staged_pages_per_connection: self.connection_quota_pages,
            max_staged_pages_per_source: self.source_quota_pages,
            max_unproven_staged_pages: self.unproven_quota_pages,
            lease_grace: self.lease_grace,
        };
        Ok(cfg)
    }

    /// Starts an engine with these settings, adjusted by `adjust` (e.g. a directory).
    pub async fn start_with(
        &self,
        listen: Option<&str>,
        peer_id: &str,
        adjust: impl FnOnce(&mut EngineConfig),
    ) -> anyhow::Result<Engine> {
        let mut cfg = self.config(listen, peer_id)?;
        adjust(&mut cfg);
        let engine = Engine::start(cfg).await?;
        let a = engine.arena();
        if let Some(why) = a.fallback_reason() {
            note_unpinned(&a.backing_kind().to_string(), &why);
        }
        Ok(engine)
    }
}

/// Says once per process (however many engines it starts) that staging memory is not
/// pinned, why, and how to fix it.
pub fn note_unpinned(backing: &str, why: &str) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        eprintln!(
            "note: staging memory is not pinned: {backing} ({why}); raise the locked-memory \
             limit (`ulimit -l unlimited`, or LimitMEMLOCK=infinity in a systemd unit) for pinned staging"
        );
    });
}

impl Default for EngineArgs {
    fn default() -> Self {
        EngineArgs {
            model: "llama3-70b-tp8".into(),
            blocks: 1024,
            arena: ByteSize(256 << 20),
            page_size: ByteSize(2 << 20),
            store_capacity: 100_000,
            copy_threads: None,
            ttl: Duration::from_secs(10),
            max_ttl: None,
            peer_quota_pages: None,
            connection_quota_pages: None,
            source_quota_pages: None,
            unproven_quota_pages: None,
            lease_grace: Duration::from_secs(2),
            max_gets: 64,
            secret: None,
            secret_file: None,
            max_control: ByteSize(1 << 20),
            max_bulk: ByteSize(256 << 20),
            io_timeout: Duration::from_secs(5),
            min_rate: ByteSize(64 << 10),
            min_rate_grace: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(300),
            max_connections: 4096,
            tls: TlsArgs::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_grace_takes_durations_and_zero() {
        assert_eq!(parse_grace("0").unwrap(), Duration::ZERO);
        assert_eq!(parse_grace("0s").unwrap(), Duration::ZERO);
        assert_eq!(parse_grace("250ms").unwrap(), Duration::from_millis(250));
        assert!(parse_grace("-1s").is_err());
        assert!(parse_grace("soon").is_err());
        let cfg = EngineArgs {
            lease_grace: Duration::from_millis(300),
            ..EngineArgs::default()
        };
        let cfg = cfg.config(None, "t").unwrap();
        assert_eq!(cfg.producer.lease_grace, Duration::from_millis(300));
        assert!(cfg.net.tls.is_none());
    }

    #[test]
    fn tls_flags_go_together() {
        let args = TlsArgs {
            tls_cert: Some("c.pem".into()),
            ..TlsArgs::default()
        };
        let e = args.config().unwrap_err().to_string();
        assert!(e.contains("go together"), "{e}");
    }
}
