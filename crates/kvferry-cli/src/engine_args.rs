//! The engine's command-line settings (store, staging, limits, secret), turned into a
//! [`kvferry::engine::EngineConfig`]; shared by `serve`, `bench` and `chaos`.

use std::time::Duration;

use clap::Args;
use kvferry::engine::{Engine, EngineConfig, EngineOptions, StoreConfig};
use kvferry::layout::{Arrangement, KvLayout, Preset};
use kvferry::mem::ByteSize;
use kvferry::net::TlsConfig;

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
    /// Which movers carry bytes: "auto" lets a consumer on this host read granted
    /// bytes from this process with process_vm_readv (one copy, every chunk verified),
    /// the socket elsewhere; "tcp" puts every byte on the connection.
    #[arg(long, default_value = "auto")]
    pub transport: kvferry::peer::Transport,
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

    /// The library's options these flags set (the flags' defaults are
    /// [`EngineOptions::serving`], checked by this module's tests), serving on `listen`
    /// (`None`: client only) as `peer_id`.
    pub fn options(&self, listen: Option<&str>, peer_id: &str) -> anyhow::Result<EngineOptions> {
        Ok(EngineOptions {
            listen: listen.map(str::to_string),
            peer_id: Some(peer_id.to_string()),
            secret: self.secret()?,
            tls_cert: self.tls.tls_cert.clone(),
            tls_key: self.tls.tls_key.clone(),
            tls_ca: self.tls.tls_ca.clone(),
            arena_bytes: self.arena.bytes() as usize,
            page_size: self.page_size.bytes() as usize,
            copy_threads: self.copy_threads,
            store_capacity: self.store_capacity,
            ttl: self.ttl,
            max_ttl: self.max_ttl,
            lease_grace: self.lease_grace,
            max_gets: self.max_gets,
            peer_quota_pages: self.peer_quota_pages,
            connection_quota_pages: self.connection_quota_pages,
            source_quota_pages: self.source_quota_pages,
            unproven_quota_pages: self.unproven_quota_pages,
            io_timeout: self.io_timeout,
            min_rate: self.min_rate.bytes(),
            min_rate_grace: self.min_rate_grace,
            idle_timeout: self.idle_timeout,
            max_connections: self.max_connections,
            max_control_bytes: self.max_control.bytes(),
            max_bulk_bytes: self.max_bulk.bytes(),
            transport: self.transport,
            ..EngineOptions::serving()
        })
    }

    /// The engine's configuration: the store laid out by `--model`/`--blocks`, serving
    /// on `listen` (`None`: client only) as `peer_id`. Every value is checked once, by
    /// the library's options; an error names the flag.
    pub fn config(&self, listen: Option<&str>, peer_id: &str) -> anyhow::Result<EngineConfig> {
        let mut cfg = self
            .options(listen, peer_id)?
            .to_config()
            .map_err(|e| anyhow::anyhow!("--{}: {}", flag_of(e.option), e.why))?;
        cfg.store = StoreConfig::Layout(self.layout(Arrangement::LayerSeparate)?);
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

/// The command line's flag for a library option.
fn flag_of(option: &str) -> String {
    let flag = match option {
        "arena_bytes" => "arena",
        "max_control_bytes" => "max_control",
        "max_bulk_bytes" => "max_bulk",
        "ttl" => "ttl",
        o => o,
    };
    flag.replace('_', "-")
}

impl Default for EngineArgs {
    /// The flags' own defaults (one declaration: the `#[arg]` attributes above).
    fn default() -> Self {
        #[derive(clap::Parser)]
        struct Only {
            #[command(flatten)]
            args: EngineArgs,
        }
        <Only as clap::Parser>::parse_from(["kvferry"]).args
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
    fn the_flags_defaults_are_the_librarys_serving_options() {
        let o = EngineArgs::default().options(None, "t").unwrap();
        assert_eq!(
            o,
            EngineOptions {
                listen: None,
                peer_id: Some("t".into()),
                ..EngineOptions::serving()
            }
        );
    }

    #[test]
    fn a_bad_flag_is_named() {
        let args = EngineArgs {
            copy_threads: Some(0),
            ..EngineArgs::default()
        };
        let e = args.config(None, "t").unwrap_err().to_string();
        assert!(e.contains("--copy-threads"), "{e}");
        let args = EngineArgs {
            arena: ByteSize(1 << 20),
            ..EngineArgs::default()
        };
        let e = args.config(None, "t").unwrap_err().to_string();
        assert!(e.contains("--arena"), "{e}");
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
