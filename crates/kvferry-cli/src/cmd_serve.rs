//! `kvferry serve`: a producer/peer daemon on TCP.

use std::time::Duration;

use clap::Args;

use crate::node::{start_producer, NodeArgs};

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
    #[command(flatten)]
    node: NodeArgs,
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        let peer_id = args.peer_id.clone().unwrap_or_else(|| format!("kvferry-{}", std::process::id()));
        if !args.listen.starts_with("127.") && !args.listen.starts_with("localhost") && args.node.secret()?.is_none() {
            eprintln!("warning: serving on {} without a shared secret: any host that can reach it may read KV", args.listen);
        }
        let node = start_producer(&args.node, &args.listen, &peer_id).await?;
        let a = node.producer.arena();
        println!(
            "kvferry serve: listening on {} (peer {peer_id}, incarnation {:#x}, model {}, {} blocks, arena {} x {} {})",
            node.server.local_addr(),
            node.producer.incarnation(),
            args.node.model,
            node.layout.blocks,
            a.page_count(),
            kvferry::mem::ByteSize(a.page_size() as u64),
            a.backing_kind()
        );
        use std::io::Write;
        std::io::stdout().flush()?;
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        eprintln!("kvferry serve: shutting down");
        let producer = node.producer.clone();
        node.server.shutdown().await;
        producer.release_all();
        let report = producer.arena().close(tokio::time::Instant::now() + Duration::from_secs(5)).await;
        eprintln!(
            "kvferry serve: arena closed: {} pages outstanding, {} quarantined",
            report.outstanding_pages, report.quarantined_pages
        );
        Ok(())
    })
}
