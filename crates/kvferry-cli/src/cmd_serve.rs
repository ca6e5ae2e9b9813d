//! `kvferry serve`: a producer/peer daemon on TCP.

use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use kvferry::engine::Engine;
use kvferry::metrics::sources::{client_connection_metrics, directory_metrics, server_metrics};
use kvferry::metrics::{HttpConfig, MetricsServer, Registry, Samples};

use crate::cmd_peers::DirectoryArgs;
use crate::engine_args::EngineArgs;
use crate::util::check_listen_address;

/// The engine's bind failure in plain words: `cannot listen on ADDR: address in use`
/// rather than the OS error's wording (other failures unchanged).
fn explain_bind(e: anyhow::Error, listen: &str) -> anyhow::Error {
    let Some(kvferry::engine::EngineError::Bind { reason, .. }) = e.downcast_ref::<kvferry::engine::EngineError>()
    else {
        return e;
    };
    let r = reason.strip_prefix("bind: ").unwrap_or(reason);
    let why = if r.contains("os error 98") || r.contains("Address already in use") {
        "address in use (another process listens there; pick another port or stop it)".to_string()
    } else if r.contains("os error 99") || r.contains("Cannot assign requested address") {
        "address not available on this host (no interface has that IP)".to_string()
    } else if r.contains("os error 13") || r.contains("Permission denied") {
        "permission denied (ports below 1024 need privileges)".to_string()
    } else {
        r.to_string()
    };
    anyhow::anyhow!("cannot listen on {listen}: {why}")
}

/// Options for `serve`.
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Address to listen on. Binds loopback unless told otherwise; use 0.0.0.0:PORT
    /// (with --secret) to serve other hosts.
    #[arg(long, default_value = "127.0.0.1:7070")]
    listen: String,
    /// This node's peer id (default: kvferry-<pid>).
    #[arg(long)]
    peer_id: Option<String>,
    /// Serve Prometheus metrics at http://ADDR/metrics, with /healthz and /readyz (off
    /// unless given). A port alone (9090) means 127.0.0.1:9090; name an interface
    /// (0.0.0.0:9090) to serve other hosts, ideally with --metrics-token-file.
    #[arg(long, value_name = "[HOST:]PORT")]
    metrics: Option<String>,
    /// Require `Authorization: Bearer TOKEN` on /metrics, TOKEN being this file's
    /// content (surrounding whitespace removed).
    #[arg(long, value_name = "FILE", requires = "metrics")]
    metrics_token_file: Option<std::path::PathBuf>,
    /// Read settings from a TOML file whose keys are these flags' long names, e.g.
    /// `arena = "1GiB"`, `io-timeout = "5s"`, `max-gets = 128`, `secret-file = "/etc/kvferry/secret"`.
    /// Flags on the command line win over the file; unknown keys are an error.
    #[arg(long, value_name = "FILE.toml")]
    config: Option<std::path::PathBuf>,
    #[command(flatten)]
    node: EngineArgs,
    #[command(flatten)]
    directory: DirectoryArgs,
    /// This node's role, registered in the directory.
    #[arg(long, default_value = "both", value_parser = ["prefill", "decode", "both"])]
    role: String,
    /// The address registered in the directory for peers to reach this node
    /// (default: the bound listen address; required when listening on 0.0.0.0).
    #[arg(long, value_name = "HOST:PORT")]
    advertise: Option<String>,
    #[command(flatten)]
    faults: FaultArgs,
}

/// Fault injection for `kvferry chaos` (hidden: not for production use).
#[derive(Args, Debug)]
pub struct FaultArgs {
    /// Corrupt a sent chunk on the wire with this probability (parts per million).
    #[arg(long, hide = true, default_value_t = 0)]
    fault_corrupt_ppm: u64,
    /// Delay a sent chunk by --fault-slow-us with this probability (parts per million).
    #[arg(long, hide = true, default_value_t = 0)]
    fault_slow_ppm: u64,
    /// The delay of a slow send, in microseconds.
    #[arg(long, hide = true, default_value_t = 20_000)]
    fault_slow_us: u64,
    /// Drop the connection before a sent chunk with this probability (parts per million).
    #[arg(long, hide = true, default_value_t = 0)]
    fault_reset_ppm: u64,
}

impl FaultArgs {
    /// Arms the producer's fault switches.
    fn apply(&self, f: &kvferry::peer::ProducerFaults) {
        use std::sync::atomic::Ordering::Relaxed;
        f.corrupt_ppm.store(self.fault_corrupt_ppm, Relaxed);
        f.slow_ppm.store(self.fault_slow_ppm, Relaxed);
        f.slow_delay_us.store(self.fault_slow_us, Relaxed);
        f.reset_ppm.store(self.fault_reset_ppm, Relaxed);
    }
}

/// Deadline of each etcd call `serve` makes.
const DIRECTORY_CALL_TIMEOUT: Duration = Duration::from_secs(3);

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    // The address first: an unparsable one is a usage error (status 2), and the warning
    // below is only worth printing about an address that can be listened on.
    let ip = check_listen_address(&args.listen)?;
    let local = match ip {
        Some(a) => a.ip().is_loopback(),
        None => args.listen.starts_with("localhost:"),
    };
    if !local && args.node.secret()?.is_none() && args.node.tls.tls_cert.is_none() {
        eprintln!(
            "warning: serving on {} without a shared secret: any host that can reach it may read KV",
            args.listen
        );
    }
    let etcd = args.directory.etcd_config(DIRECTORY_CALL_TIMEOUT)?;
    if etcd.is_some() && args.advertise.is_none() && ip.is_some_and(|a| a.ip().is_unspecified()) {
        return Err(crate::util::usage(format!(
            "listening on {} with --directory {}: give --advertise HOST:PORT, the address peers reach this node on",
            args.listen, args.directory.directory
        )));
    }
    if let Some(a) = &args.advertise {
        check_listen_address(a).map_err(|_| crate::util::usage(format!("--advertise {a}: expected HOST:PORT")))?;
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        // Before anything is announced (the directory, the first line): a SIGTERM
        // from then on is a clean shutdown that deregisters.
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
        let peer_id = args.peer_id.clone().unwrap_or_else(|| match &etcd {
            // Unique across hosts, not just processes.
            Some(_) => format!("kvferry-{}-{:06x}", std::process::id(), rand::random::<u32>() & 0xff_ffff),
            None => format!("kvferry-{}", std::process::id()),
        });
        let directory = match etcd {
            Some(cfg) => Some(std::sync::Arc::new(kvferry::directory::etcd::EtcdDirectory::connect(cfg).await?)),
            None => None,
        };
        let (role, advertise) = (args.role.parse().map_err(anyhow::Error::msg)?, args.advertise.clone());
        let dir = directory.clone();
        let engine = args
            .node
            .start_with(Some(&args.listen), &peer_id, move |cfg| {
                cfg.directory = dir.map(|d| d as std::sync::Arc<dyn kvferry::engine::Directory>);
                cfg.role = role;
                cfg.advertise = advertise;
            })
            .await
            .map_err(|e| explain_bind(e, &args.listen))?;
        args.faults.apply(engine.producer().faults());
        let a = engine.arena();
        // With a directory, the same line says where it registered (one line: scripts
        // that read only the first line keep working).
        let registered = match directory.as_ref().and_then(|d| kvferry::engine::Directory::registration(&**d)) {
            Some(r) => format!(
                "; registered as {} at {} in {} namespace {} (role {}, lease TTL {:?})",
                r.peer_id, r.address, args.directory.directory, args.directory.namespace, r.role, args.directory.directory_ttl
            ),
            None => String::new(),
        };
        // Printed (and flushed) as soon as the socket is bound, before anything else:
        // scripts wait for this line.
        println!(
            "kvferry serve: listening on {} (peer {peer_id}, incarnation {:#x}, model {}, {} blocks, arena {} x {} {}){registered}",
            engine.address().expect("serve listens"),
            engine.incarnation(),
            args.node.model,
            engine.producer().store().layout().blocks,
            a.page_count(),
            kvferry::mem::ByteSize(a.page_size() as u64),
            a.backing_kind()
        );
        use std::io::Write;
        std::io::stdout().flush()?;
        let metrics = match &args.metrics {
            Some(addr) => {
                let m = serve_metrics(addr, args.metrics_token_file.as_deref(), &engine).await?;
                let follower = tokio::spawn(ready_while_registered(m.readiness(), &engine));
                Some((m, follower))
            }
            None => None,
        };
        std::io::stdout().flush()?;
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
        eprintln!("kvferry serve: shutting down");
        // /readyz answers 503 from here on; the endpoint stays up while the engine closes.
        if let Some((m, follower)) = &metrics {
            follower.abort();
            m.readiness().set(false);
        }
        // What was still held before the forced release (pages a Done or a TTL should
        // already have returned; `kvferry chaos` counts them as leaked).
        eprintln!(
            "kvferry serve: stopped serving: {} staged leases, {} pages leased",
            engine.producer().stats().staged_now,
            engine.arena().stats().leased_pages
        );
        let report = engine.close(tokio::time::Instant::now() + Duration::from_secs(5)).await;
        eprintln!(
            "kvferry serve: arena closed: {} pages outstanding, {} quarantined",
            report.outstanding_pages, report.quarantined_pages
        );
        if let Some((m, _)) = metrics {
            m.shutdown().await;
        }
        Ok(())
    })
}

/// `/readyz` follows the directory registration: not ready while peers cannot see
/// this node (its registration lost, or its peer id held by another process), since
/// its producer then refuses every get. Without a directory it stays ready.
fn ready_while_registered(
    ready: kvferry::metrics::Readiness,
    engine: &Engine,
) -> impl std::future::Future<Output = ()> + Send + 'static {
    let state = engine.config().directory.as_ref().and_then(|d| d.registration_state());
    async move {
        let Some(mut state) = state else { return };
        loop {
            let registered = state.borrow_and_update().is_registered();
            ready.set(registered);
            if state.changed().await.is_err() {
                return;
            }
        }
    }
}

/// Starts the metrics endpoint on `spec` (a bare port means loopback) with the
/// producer (its arena and copy engine), the transport server and the consumer's client
/// connections, and prints where it listens.
async fn serve_metrics(
    spec: &str,
    token_file: Option<&std::path::Path>,
    engine: &Engine,
) -> anyhow::Result<MetricsServer> {
    let addr = kvferry::metrics::listen_address(spec)?;
    let bearer_token = token_file.map(kvferry::metrics::read_token_file).transpose()?;
    let registry = Arc::new(Registry::new());
    registry.register(engine.producer().clone());
    let e = engine.clone();
    registry.register(move |out: &mut Samples| {
        server_metrics(out, &e.server_stats());
        client_connection_metrics(out, &e.consumer().connection_stats());
    });
    if let Some(dir) = engine.config().directory.clone() {
        let state = dir.registration_state();
        registry.register(move |out: &mut Samples| {
            let reg = state.as_ref().map(|s| s.borrow().clone());
            directory_metrics(out, &dir.live_peers(), reg.as_ref(), dir.records_taken_back());
        });
    }
    let cfg = HttpConfig {
        bearer_token,
        ..HttpConfig::default()
    };
    let token = cfg.bearer_token.is_some();
    let endpoint = MetricsServer::bind_with(&addr, registry, cfg).await?;
    let local = endpoint.local_addr();
    if !local.ip().is_loopback() && !token {
        eprintln!("warning: metrics on {local} without --metrics-token-file: any host that can reach it may read them");
    }
    let auth = if token { ", bearer token required" } else { "" };
    println!("kvferry serve: metrics on {local} (GET /metrics, /healthz, /readyz{auth})");
    Ok(endpoint)
}
