//! `kvferry bench` (the main job): producers and a consumer over real loopback sockets,
//! the producers in a process of their own by default with the same-host mover
//! (`--mover auto`, see `child`), in the benchmark's process with `--mover tcp`. Producers are filled with a model preset's KV for many requests,
//! each request with its own byte pattern; the consumer pulls them through host staging
//! with many transfers in flight and verifies every landed byte (a crc32c of the landed
//! chunk against the pattern's, and an exact comparison on mismatch — another request's
//! bytes are caught). The limit is raw loopback TCP measured in the same run: plain
//! sockets moving the same bytes (as much memory as the producers hold, chunk by chunk)
//! over the same number of connections. Also reported: TCP from one hot 4 MiB buffer,
//! memcpy, and the staged-pipeline limit (see `limits`).
//!
//! With `--mover auto` the consumer reads the producers' granted bytes with
//! `process_vm_readv` when the engines choose the same-host mover (the point names the
//! mover chosen, or why not), and the one-copy limit is measured in the same rounds:
//! plain `process_vm_readv` of the same chunks from the producer process, as many
//! threads as the consumer copies with (`limits::cma_limit`).
//!
//! A point runs in phases, one file each: `producers` (start and fill), `consumer`
//! (start, destination slots), `rounds` (the transfer rounds interleaved with raw-TCP
//! runs, every landed byte verified), then here: the staging backing, leak accounting
//! after a quiesce, the remaining limits, and the [`Point`]. `args` holds the options,
//! `point` the result, `report` the printed summaries.

mod args;
mod child;
mod consumer;
mod point;
mod producers;
mod report;
mod rounds;

use std::time::{Duration, Instant};

use anyhow::Context;
use kvferry::layout::Arrangement;
use kvferry::mem::ByteSize;

pub use args::{BenchPath, P2pBenchArgs, Verify};
pub use point::Point;

use super::cpu::{per_chunk, per_gb, Contention, CpuClock};
use super::limits::{memcpy_limit, pipeline_limit};
use crate::engine_args::EngineArgs;
use report::{join, points_word, print_point_summary, print_sweep_summary, print_table};

/// The sizes of a point, derived from its options.
#[derive(Clone, Copy, Debug)]
struct Shape {
    /// Blocks per chunk.
    bpc: usize,
    chunk_bytes: usize,
    /// Requests each producer holds (the last may hold fewer).
    per_producer_reqs: usize,
    /// Page size of every staging arena.
    staging_page: usize,
    staged: bool,
    on_device: bool,
    /// Blocks of each producer's KV cache.
    producer_blocks: u32,
}

/// The sweep's points `(blocks per chunk, transfers in flight)`: the dimensions given on
/// the command line are fixed, the others take the sweep's values.
fn sweep_plan(args: &P2pBenchArgs) -> Vec<(u32, usize)> {
    let bpcs = match args.blocks_per_chunk_arg {
        Some(b) => vec![b],
        None => vec![1, 2, 4, 6],
    };
    let inflights = match args.in_flight_arg {
        Some(n) => vec![n],
        None => vec![1, 4, 16],
    };
    bpcs.iter()
        .flat_map(|&b| inflights.iter().map(move |&n| (b, n)))
        .collect()
}

pub fn run(mut args: P2pBenchArgs) -> anyhow::Result<()> {
    if let Some(b) = args.blocks_per_chunk_arg {
        args.blocks_per_chunk = b;
    }
    if let Some(n) = args.in_flight_arg {
        args.in_flight = n;
    }
    if args.serve_producers {
        return child::serve(args);
    }
    anyhow::ensure!(args.in_flight >= 1, "--in-flight must be at least 1");
    anyhow::ensure!(args.connections >= 1, "--connections must be at least 1");
    anyhow::ensure!(args.producers >= 1, "--producers must be at least 1");
    anyhow::ensure!(
        args.requests >= 1 && args.chunks_per_request >= 1,
        "--requests and --chunks-per-request must be at least 1"
    );
    anyhow::ensure!(args.blocks_per_chunk >= 1, "--blocks-per-chunk must be at least 1");
    anyhow::ensure!(
        args.keys_per_get >= 1 && args.chunks_per_request.is_multiple_of(args.keys_per_get),
        "--keys-per-get ({}) must divide --chunks-per-request ({})",
        args.keys_per_get,
        args.chunks_per_request
    );
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let sweep = args.sweep || args.plot.is_some();
    let points = if sweep {
        let plan = sweep_plan(&args);
        let per_point = ByteSize(args.bytes.bytes().min(1 << 30));
        if !args.json {
            let fixed = |given: bool| if given { " (given)" } else { "" };
            let mut bpcs: Vec<u32> = plan.iter().map(|p| p.0).collect();
            bpcs.dedup();
            let mut ifs: Vec<usize> = plan.iter().map(|p| p.1).collect();
            ifs.sort_unstable();
            ifs.dedup();
            eprintln!(
                "sweep: {}: {} blocks per chunk{} x {} in flight{}; {} connection(s) per producer, \
                 {} producer(s), path {}, {} per point",
                points_word(plan.len()),
                join(&bpcs),
                fixed(args.blocks_per_chunk_arg.is_some()),
                join(&ifs),
                fixed(args.in_flight_arg.is_some()),
                args.connections,
                args.producers,
                args.path,
                per_point
            );
        }
        let mut pts = Vec::new();
        for (bpc, inflight) in plan {
            let mut a = args.clone();
            a.blocks_per_chunk = bpc;
            a.in_flight = inflight;
            a.bytes = per_point;
            a.quiet = true;
            let busy = Contention::start(args.contend);
            let p = on_workers(&rt, &a, busy.clock(), busy.threads())?;
            drop(busy);
            if !args.json {
                eprintln!(
                    "  chunk {:>9}  in flight {:>2}: {:.2} GB/s ({:.2} of raw TCP moving the same bytes, \
                     {:.2} of the staged pipeline)",
                    ByteSize(p.chunk_bytes as u64).to_string(),
                    inflight,
                    p.gbps,
                    p.ratio,
                    p.pipeline_ratio
                );
            }
            pts.push(p);
        }
        pts
    } else {
        let mut p = on_workers(&rt, &args, CpuClock::default(), 0)?;
        if args.contend > 0 {
            let busy = Contention::start(args.contend);
            let q = on_workers(&rt, &args, busy.clock(), busy.threads())?;
            drop(busy);
            p.contended = Some(Box::new(q));
        }
        vec![p]
    };
    if let Some(path) = &args.plot {
        std::fs::write(path, super::plot::svg(&points)).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("plot written to {}", path.display());
    }
    if args.json {
        if sweep {
            println!("{}", serde_json::to_string_pretty(&points)?);
        } else {
            println!("{}", serde_json::to_string_pretty(&points[0])?);
        }
    } else {
        print_table(&points);
        if sweep {
            print_sweep_summary(&points);
        } else {
            print_point_summary(&points[0]);
        }
    }
    let bad: Vec<&Point> = points
        .iter()
        .flat_map(|p| std::iter::once(p).chain(p.contended.as_deref()))
        .filter(|p| p.corrupted_bytes > 0 || p.leaked_pages > 0)
        .collect();
    anyhow::ensure!(
        bad.is_empty(),
        "integrity failure: {} point(s) with corrupted bytes or leaked pages",
        bad.len()
    );
    Ok(())
}

/// Runs one point as a task on the runtime's worker threads. The point's dispatch loop
/// (take a permit, spawn the next transfer) wakes once per landed chunk: driven from
/// `block_on` it would run on the main thread, a third thread beside the two workers,
/// and every chunk would cost a hand-off to it that the raw-TCP limit (whose driver only
/// joins its tasks) does not pay.
fn on_workers(
    rt: &tokio::runtime::Runtime,
    args: &P2pBenchArgs,
    cpu: CpuClock,
    contend: usize,
) -> anyhow::Result<Point> {
    let args = args.clone();
    rt.block_on(async move { tokio::spawn(async move { run_point(&args, &cpu, contend).await }).await? })
}

/// The sizes of a point with these options.
fn shape(args: &P2pBenchArgs) -> anyhow::Result<Shape> {
    let probe = EngineArgs {
        model: args.model.clone(),
        blocks: 1,
        ..EngineArgs::default()
    };
    let block_bytes = probe.layout(Arrangement::LayerSeparate)?.block_bytes();
    let bpc = args.blocks_per_chunk as usize;
    let chunk_bytes = block_bytes * bpc;
    let per_producer_reqs = args.requests.div_ceil(args.producers);
    let staging_page: usize = 1 << 20;
    let staged = args.path == BenchPath::Staged;
    let on_device = args.path == BenchPath::DeviceSim;
    let producer_blocks = (per_producer_reqs * args.chunks_per_request * bpc) as u32;
    Ok(Shape {
        bpc,
        chunk_bytes,
        per_producer_reqs,
        staging_page,
        staged,
        on_device,
        producer_blocks,
    })
}

async fn run_point(args: &P2pBenchArgs, cpu: &CpuClock, contend: usize) -> anyhow::Result<Point> {
    let shape = shape(args)?;
    let chunk_bytes = shape.chunk_bytes;
    let ca = match args.tls {
        true => Some(super::tls::EphemeralCa::new()?),
        false => None,
    };
    let mut producers = match args.in_child() {
        true => producers::start_child(args, &shape, ca.as_ref()).await?,
        false => producers::start(args, &shape, ca.as_ref()).await?,
    };
    // The producer process's threads are the benchmark's too.
    let cpu = match &producers.child {
        Some(_) => cpu.with_child(producers.pid),
        None => cpu.clone(),
    };
    let cpu = &cpu;
    let side = consumer::start(args, &shape, ca.as_ref()).await?;
    let rounds::Rounds {
        total_chunks,
        rounds,
        elapsed,
        round_gbps,
        best_round,
        tcp,
        tcp_hot,
        tcp_usage,
        transfer_usage,
        errors,
        corrupted,
        latencies,
        rss_warm,
        rss_end,
        limit_bytes,
        conns,
        source,
        src_layout,
        from_receive,
        moved,
        cma_limit,
        cma_verified_limit,
        cma_threads,
    } = rounds::run(args, &shape, cpu, &producers, &side).await?;
    // The mover the consumer chose per producer: `cma` when every producer's bytes were
    // read from its memory, `socket` when none, else `mixed`; the first reason given
    // for a socket the options did not ask for.
    let movers = side.engine.consumer().movers();
    let cma_bytes = side.engine.stats().consumer.cma_bytes;
    let mover = if !movers.is_empty() && movers.iter().all(|m| m.mover == kvferry::peer::Mover::Cma) {
        "cma"
    } else if movers.iter().any(|m| m.mover == kvferry::peer::Mover::Cma) {
        "mixed"
    } else {
        "socket"
    };
    let mover_fallback = movers.iter().find_map(|m| m.fallback.clone());
    let transfer_cpu = transfer_usage.cpu_s;
    let producers_in_child = producers.child.is_some();
    let consumer::Consumer {
        engine: consumer,
        arena,
        ..
    } = side;

    // Staging backing, for the summary: the least pinned arena's.
    let is_pinned = |a: &kvferry::mem::Arena| a.backing_kind() != kvferry::mem::BackingKind::Unlocked;
    let mut staging = (arena.backing_kind().to_string(), arena.fallback_reason());
    let mut pinned = is_pinned(&arena);
    for p in &producers.engines {
        let a = p.arena();
        if pinned && !is_pinned(a) {
            staging = (a.backing_kind().to_string(), a.fallback_reason());
            pinned = false;
        }
    }
    // The producer process's arenas, as it reported them (it noted why itself).
    if let Some((kind, why, child_pinned)) = producers.child_staging.clone() {
        if pinned && !child_pinned {
            staging = (kind, why.clone());
            pinned = false;
        }
    }
    if let Some(why) = &staging.1 {
        crate::engine_args::note_unpinned(&staging.0, why);
    }

    // Quiesce and account every page of every arena.
    let quiesce = Instant::now() + Duration::from_secs(5);
    let leaked = loop {
        let s = arena.stats();
        let mut leaked = (s.total_pages - s.free_pages - s.quarantined_pages) as u64;
        for p in &producers.engines {
            let s = p.arena().stats();
            leaked += (s.total_pages - s.free_pages - s.quarantined_pages) as u64;
        }
        if leaked == 0 || Instant::now() > quiesce {
            break leaked;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    // The producer process counts its own arenas' pages once its stdin closes.
    let mut leaked = leaked;
    if let Some(child) = producers.child.take() {
        let bye = tokio::task::spawn_blocking(move || child.finish()).await??;
        leaked += bye.leaked_pages;
    }
    for p in producers.engines {
        p.close(tokio::time::Instant::now() + Duration::from_secs(5)).await;
    }
    consumer
        .close(tokio::time::Instant::now() + Duration::from_secs(5))
        .await;

    let tcp_cpu_s_per_gb = per_gb(tcp_usage.cpu_s, rounds * limit_bytes);
    let tcp_pieces = rounds * limit_bytes / chunk_bytes as u64;
    let memcpy = memcpy_limit(256 << 20);
    let pipeline = tokio::task::block_in_place(|| -> anyhow::Result<f64> {
        let mut best = 0f64;
        for _ in 0..3 {
            best = best.max(pipeline_limit(
                src_layout,
                &source,
                args.blocks_per_chunk,
                conns,
                limit_bytes,
            )?);
        }
        Ok(best)
    })?;
    let mut lat = latencies;
    lat.sort_by(|a, b| a.total_cmp(b));
    let pct = |q: f64| {
        if lat.is_empty() {
            0.0
        } else {
            lat[((lat.len() - 1) as f64 * q).round() as usize]
        }
    };
    let gbps = moved as f64 / elapsed / 1e9;
    Ok(Point {
        model: args.model.clone(),
        path: args.path,
        tls: args.tls,
        chunk_bytes,
        in_flight: args.in_flight,
        keys_per_get: args.keys_per_get,
        slots: args.slot_count(chunk_bytes),
        connections: args.connections,
        producers: args.producers,
        chunks: total_chunks,
        bytes: moved,
        elapsed_s: elapsed,
        gbps,
        tcp_limit_gbps: tcp,
        tcp_hot_limit_gbps: tcp_hot,
        round_gbps,
        best_round_gbps: best_round,
        ratio: best_round / tcp,
        ratio_overall: gbps / tcp,
        memcpy_gbps: memcpy,
        pipeline_limit_gbps: pipeline,
        pipeline_ratio: best_round / pipeline,
        p50_ms: pct(0.5),
        p99_ms: pct(0.99),
        errors,
        corrupted_bytes: corrupted,
        leaked_pages: leaked,
        rss_warm_mib: rss_warm,
        rss_end_mib: rss_end,
        cpu_s_per_gb: per_gb(transfer_cpu, moved),
        tcp_cpu_s_per_gb,
        cpu_ratio: if tcp_cpu_s_per_gb > 0.0 {
            per_gb(transfer_cpu, moved) / tcp_cpu_s_per_gb
        } else {
            0.0
        },
        contend,
        verify: if from_receive { Verify::Receive } else { Verify::Reread },
        wakeups_per_chunk: per_chunk(transfer_usage.wakeups, total_chunks),
        preemptions_per_chunk: per_chunk(transfer_usage.preemptions, total_chunks),
        tcp_wakeups_per_chunk: per_chunk(tcp_usage.wakeups, tcp_pieces),
        contended: None,
        staging_backing: staging.0,
        staging_pinned: pinned,
        checksum_impl: kvferry::checksum::backend().name().to_string(),
        staging_fallback: staging.1,
        mover: mover.to_string(),
        mover_fallback,
        producer_process: producers_in_child,
        cma_bytes,
        cma_limit_gbps: cma_limit,
        cma_threads,
        ratio_cma_limit: cma_limit.map(|l| best_round / l),
        cma_verified_limit_gbps: cma_verified_limit,
        ratio_cma_verified_limit: cma_verified_limit.map(|l| best_round / l),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sweep_sweeps_only_what_was_not_given() {
        let mut a = P2pBenchArgs::default();
        assert_eq!(sweep_plan(&a).len(), 12);
        a.in_flight_arg = Some(8);
        assert_eq!(sweep_plan(&a), [(1, 8), (2, 8), (4, 8), (6, 8)]);
        a.blocks_per_chunk_arg = Some(3);
        assert_eq!(sweep_plan(&a), [(3, 8)]);
        a.in_flight_arg = None;
        assert_eq!(sweep_plan(&a), [(3, 1), (3, 4), (3, 16)]);
    }
}
