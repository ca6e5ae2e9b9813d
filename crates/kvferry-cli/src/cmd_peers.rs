//! `kvferry peers`: the live peers of a namespace as the directory sees them, and
//! [`DirectoryArgs`], the `--directory`/`--namespace` flags `serve`, `get` and `put`
//! share.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use clap::Args;
use kvferry::directory::etcd::{EtcdConfig, EtcdDirectory};
use kvferry::directory::LivePeers;

use crate::util::{parse_timeout, usage};

/// Which directory peers are found in.
#[derive(Args, Debug, Clone)]
pub struct DirectoryArgs {
    /// Where peers are found: `static` (peers are addresses given on the command
    /// line) or `etcd://HOST:PORT[,HOST:PORT...]`.
    #[arg(long, default_value = "static", value_name = "static|etcd://HOST:PORT[,...]")]
    pub directory: String,
    /// The directory namespace (records live under NAME/peers/).
    #[arg(long, default_value = "kvferry", value_name = "NAME")]
    pub namespace: String,
    /// TTL of this process's registration in etcd (kept alive every TTL/3; a peer that
    /// dies is dropped from the directory after it).
    #[arg(long, default_value = "10s", value_parser = parse_timeout)]
    pub directory_ttl: Duration,
}

impl DirectoryArgs {
    /// True for `--directory static`.
    pub fn is_static(&self) -> bool {
        self.directory == "static"
    }

    /// The etcd settings, or `None` for `static`; a usage error for anything else.
    pub fn etcd_config(&self, call_timeout: Duration) -> anyhow::Result<Option<EtcdConfig>> {
        if self.is_static() {
            return Ok(None);
        }
        let endpoints = EtcdConfig::parse_url(&self.directory).map_err(|e| usage(format!("--directory: {e}")))?;
        let mut c = EtcdConfig::new(endpoints, self.namespace.clone());
        c.ttl = self.directory_ttl;
        c.call_timeout = call_timeout;
        c.stale_after = call_timeout;
        c.validate().map_err(|e| usage(format!("--directory: {e}")))?;
        Ok(Some(c))
    }

    /// Connects to etcd and waits (at most `timeout`) for the first list of peers;
    /// `None` for `static`. Must run inside a tokio runtime.
    pub async fn connect(&self, timeout: Duration) -> anyhow::Result<Option<Arc<EtcdDirectory>>> {
        let Some(cfg) = self.etcd_config(timeout)? else {
            return Ok(None);
        };
        let d = EtcdDirectory::connect(cfg).await?;
        d.wait_listed(timeout).await.map_err(|_| {
            anyhow::anyhow!(
                "cannot reach etcd at {} within {:?} (is it running? see --directory)",
                self.directory,
                timeout
            )
        })?;
        Ok(Some(Arc::new(d)))
    }
}

/// Options for `peers`.
#[derive(Args, Debug)]
pub struct PeersArgs {
    #[command(flatten)]
    dir: DirectoryArgs,
    /// Print JSON (one array) instead of one line per peer.
    #[arg(long)]
    json: bool,
    /// Give up when etcd does not answer within this long.
    #[arg(long, default_value = "3s", value_parser = parse_timeout)]
    timeout: Duration,
}

pub fn run(args: PeersArgs) -> anyhow::Result<()> {
    if args.dir.is_static() {
        return Err(usage(
            "peers needs a directory to list: --directory etcd://HOST:PORT (static peers are only known to the command line)",
        ));
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let view = rt.block_on(async {
        let dir = args.dir.connect(args.timeout).await?.expect("etcd directory");
        let view = kvferry::directory::Directory::live_peers(&*dir);
        dir.close();
        anyhow::Ok(view)
    })?;
    print(&view, args.json)
}

fn print(view: &LivePeers, json: bool) -> anyhow::Result<()> {
    let now = SystemTime::now();
    if json {
        let peers: Vec<serde_json::Value> = view
            .peers
            .iter()
            .map(|p| {
                let r = &p.record;
                serde_json::json!({
                    "peer_id": r.peer_id,
                    "address": r.address,
                    "incarnation": format!("{:#x}", r.incarnation),
                    "role": r.role.to_string(),
                    "engine_id": r.engine_id,
                    "dp_rank": r.dp_rank,
                    "tp_rank": r.tp_rank,
                    "pp_rank": r.pp_rank,
                    "protocol_version": r.protocol_version,
                    "capabilities": r.capabilities,
                    "age_ms": r.age(now).as_millis() as u64,
                    "stale": view.stale,
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&peers)?);
        return Ok(());
    }
    for p in &view.peers {
        let r = &p.record;
        println!(
            "{} {} incarnation={:#x} role={} age={:.1}s {}",
            r.peer_id,
            r.address,
            r.incarnation,
            r.role,
            r.age(now).as_secs_f64(),
            if view.stale { "stale" } else { "fresh" }
        );
    }
    Ok(())
}
