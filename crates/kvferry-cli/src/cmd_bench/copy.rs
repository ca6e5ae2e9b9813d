//! `kvferry bench copy`: the copy engine against a plain single-thread memcpy of the
//! same bytes, contiguous and gathered.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use kvferry::copy::{CopyConfig, CopyEngine, CopyPlan};
use kvferry::mem::{Arena, ArenaConfig, ByteSize, Region};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::Serialize;

/// Options for `bench copy`.
#[derive(Args, Debug, Clone)]
pub struct CopyBenchArgs {
    /// Bytes moved per case.
    #[arg(long, default_value = "1GiB")]
    bytes: ByteSize,
    /// Copy threads (default: available cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Arena page size.
    #[arg(long, default_value = "2MiB")]
    page_size: ByteSize,
    /// Repetitions per case; the best is reported.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Print a JSON array instead of a table.
    #[arg(long)]
    json: bool,
}

impl Default for CopyBenchArgs {
    fn default() -> Self {
        CopyBenchArgs {
            bytes: ByteSize(1 << 30),
            threads: None,
            page_size: ByteSize(2 << 20),
            reps: 3,
            json: false,
        }
    }
}

#[derive(Serialize, Debug)]
struct Row {
    name: &'static str,
    gbps: f64,
    limit_gbps: f64,
    ratio: f64,
    bytes: u64,
    segments: usize,
    threads: usize,
}

pub fn run(args: CopyBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.reps >= 1, "--reps must be at least 1");
    let bytes = args.bytes.bytes() as usize;
    anyhow::ensure!(bytes >= 1 << 20, "--bytes must be at least 1MiB");
    let mut config = CopyConfig::default();
    if let Some(t) = args.threads {
        config.threads = t;
    }
    let threads = config.threads;
    let engine = CopyEngine::new(config).context("starting copy engine")?;
    let page = args.page_size.bytes() as usize;
    let arena = Arena::new(ArenaConfig::new(page, bytes.div_ceil(page))).context("creating staging arena")?;
    if let Some(why) = arena.fallback_reason() {
        eprintln!("note: staging arena is {} ({why})", arena.backing_kind());
    }
    let src = Arc::new(Region::host("bench-src", bytes)?);
    for off in (0..bytes).step_by(1 << 20) {
        src.fill(off, (1 << 20).min(bytes - off), (off >> 20) as u8)?;
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let mut rows = Vec::new();

    // Case 1: contiguous, 1 MiB segments.
    let seg = 1 << 20;
    let segs: Vec<(usize, usize, usize)> = (0..bytes / seg).map(|i| (i * seg, i * seg, seg)).collect();
    rows.push(case(
        &rt,
        &engine,
        &arena,
        &src,
        "contiguous-1m",
        &segs,
        args.reps,
        threads,
    )?);

    // Case 2: gather of randomly placed 32 KiB segments into contiguous pages.
    let seg = 32 << 10;
    let mut order: Vec<usize> = (0..bytes / seg).collect();
    order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(7));
    let segs: Vec<(usize, usize, usize)> = order
        .iter()
        .enumerate()
        .map(|(i, &s)| (s * seg, i * seg, seg))
        .collect();
    rows.push(case(
        &rt,
        &engine,
        &arena,
        &src,
        "gather-32k",
        &segs,
        args.reps,
        threads,
    )?);

    engine.shutdown();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!(
            "{:<15} {:>10} {:>12} {:>7} {:>10} {:>9} {:>8}",
            "case", "GB/s", "memcpy GB/s", "ratio", "bytes", "segments", "threads"
        );
        for r in &rows {
            println!(
                "{:<15} {:>10.2} {:>12.2} {:>7.2} {:>10} {:>9} {:>8}",
                r.name,
                r.gbps,
                r.limit_gbps,
                r.ratio,
                ByteSize(r.bytes).to_string(),
                r.segments,
                r.threads
            );
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn case(
    rt: &tokio::runtime::Runtime,
    engine: &CopyEngine,
    arena: &Arena,
    src: &Arc<Region>,
    name: &'static str,
    segs: &[(usize, usize, usize)],
    reps: usize,
    threads: usize,
) -> anyhow::Result<Row> {
    let total: usize = segs.iter().map(|s| s.2).sum();
    let mut lease = Some(arena.try_alloc(arena.pages_for(total)).context("arena too small")?);
    // The limit: one thread, plain memcpy of the same segments into a plain buffer.
    let mut dst_plain = vec![1u8; total]; // touched now: no page faults in the timing
    let mut limit_best = f64::MAX;
    for _ in 0..reps {
        let t = Instant::now();
        for &(s, d, n) in segs {
            src.read(s, &mut dst_plain[d..d + n])?;
        }
        limit_best = limit_best.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&dst_plain);
    let mut best = f64::MAX;
    for _ in 0..reps {
        let mut plan = CopyPlan::new(src.clone(), lease.take().expect("lease returned"));
        for &(s, d, n) in segs {
            plan.push(s, d, n);
        }
        let t = Instant::now();
        let plan = rt
            .block_on(engine.copy(plan))
            .map_err(|f| anyhow::anyhow!("copy failed: {}", f.error))?;
        best = best.min(t.elapsed().as_secs_f64());
        let (_, dst) = plan.into_parts();
        lease = dst.into_lease();
    }
    // Verify one sample per segment so the benchmark cannot pass by copying nothing.
    let lease = lease.expect("lease returned");
    for &(s, d, n) in segs.iter().step_by(97) {
        let a = lease.to_vec(d, n)?;
        let b = src.to_vec(s, n)?;
        anyhow::ensure!(a == b, "{name}: verification failed at dst offset {d}");
    }
    let gb = total as f64 / 1e9;
    Ok(Row {
        name,
        gbps: gb / best,
        limit_gbps: gb / limit_best,
        ratio: limit_best / best,
        bytes: total as u64,
        segments: segs.len(),
        threads,
    })
}
