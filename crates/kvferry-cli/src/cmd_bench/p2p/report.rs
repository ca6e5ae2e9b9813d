//! The benchmark's human-readable output: the table of points, one point's summary
//! (with its contended twin under `--contend`), and a sweep's summary (the best point
//! and each figure's range over all points), each against the target ratio.

use kvferry::mem::ByteSize;

use super::args::{BenchPath, Verify};
use super::point::Point;

pub(super) fn points_word(n: usize) -> String {
    format!("{n} point{}", if n == 1 { "" } else { "s" })
}

pub(super) fn join<T: std::fmt::Display>(v: &[T]) -> String {
    v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ")
}

/// The ratio kvferry aims at (docs/benchmarks.md, "Against the target").
const TARGET_RATIO: f64 = 0.85;

pub(super) fn print_table(points: &[Point]) {
    println!(
        "{:>10} {:>9} {:>6} {:>8} {:>9} {:>7} {:>10} {:>8} {:>8} {:>7} {:>9} {:>7}",
        "chunk",
        "in-flight",
        "conns",
        "GB/s",
        "TCP GB/s",
        "ratio",
        "pipe GB/s",
        "p50 ms",
        "p99 ms",
        "errors",
        "corrupted",
        "leaked"
    );
    for p in points {
        println!(
            "{:>10} {:>9} {:>6} {:>8.2} {:>9.2} {:>7.2} {:>10.2} {:>8.2} {:>8.2} {:>7} {:>9} {:>7}",
            ByteSize(p.chunk_bytes as u64).to_string(),
            p.in_flight,
            p.connections,
            p.gbps,
            p.tcp_limit_gbps,
            p.ratio,
            p.pipeline_limit_gbps,
            p.p50_ms,
            p.p99_ms,
            p.errors,
            p.corrupted_bytes,
            p.leaked_pages
        );
    }
}

/// `path direct (zero copy); staging mmap+mlock (pinned)` or, when not pinned, why.
fn setup_line(p: &Point) -> String {
    let path = match p.path {
        BenchPath::Staged => "staged (through staging pages on both sides)",
        BenchPath::DeviceSim => "device-sim (sim device memory on both sides, through staging pages)",
        BenchPath::Direct => "direct (zero copy: sockets read and write the KV blocks)",
    };
    let bypass = if p.path == BenchPath::Direct {
        "; the direct path bypasses it"
    } else {
        ""
    };
    let staging = match &p.staging_fallback {
        None if p.staging_pinned => format!("staging memory pinned ({}{bypass})", p.staging_backing),
        None => format!("staging memory NOT pinned ({}{bypass})", p.staging_backing),
        Some(why) => format!(
            "staging memory NOT pinned ({}: {why}; `ulimit -l unlimited` fixes it{bypass})",
            p.staging_backing
        ),
    };
    let tls = if p.tls {
        "; over mutual TLS (TLS 1.3, AES-256-GCM; the raw TCP limits are plaintext)"
    } else {
        ""
    };
    let mut batch = String::new();
    if p.keys_per_get > 1 {
        batch += &format!("; {} chunks per get", p.keys_per_get);
    }
    if p.slots > p.in_flight {
        batch += &format!("; {} destination slots", p.slots);
    }
    format!("path {path}{tls}{batch}; {staging}; crc32c: {}", p.checksum_impl)
}

/// `mover cma (…); producers in a process of their own` or the socket and why.
fn mover_line(p: &Point) -> String {
    let mover = match (p.mover.as_str(), &p.mover_fallback) {
        ("cma", _) => {
            "cma (the consumer reads granted bytes from the producers' memory with process_vm_readv)".to_string()
        }
        (m, Some(why)) => format!("{m} (same-host mover not used: {why})"),
        (m, None) => format!("{m} (--transport tcp)"),
    };
    let place = if p.producer_process {
        "producers in a process of their own (their CPU counted, their pages accounted there)"
    } else {
        "producers in this process"
    };
    format!("mover {mover}; {place}")
}

/// What a ratio to same-bytes raw TCP means.
const CEILING: &str = "1.00 is the ceiling: kvferry costing nothing over plain sockets \
                       (no framing, checksums or copies)";

pub(super) fn print_point_summary(p: &Point) {
    print_one_point(p);
    if let Some(q) = &p.contended {
        println!();
        println!("the same with {} busy thread(s) beside it (--contend):", q.contend);
        print_one_point(q);
        println!(
            "contention costs {:.0} % of throughput (raw TCP: {:.0} %); ratio {:.2} alone, {:.2} contended",
            (1.0 - q.gbps / p.gbps) * 100.0,
            (1.0 - q.tcp_limit_gbps / p.tcp_limit_gbps) * 100.0,
            p.ratio,
            q.ratio
        );
    }
}

fn print_one_point(p: &Point) {
    println!("{}", setup_line(p));
    println!("{}", mover_line(p));
    println!(
        "moved {} in {} chunks over loopback, every byte verified: {:.2} GB/s",
        ByteSize(p.bytes),
        p.chunks,
        p.gbps
    );
    println!(
        "ratio {:.2} of raw TCP moving the same bytes: best of {} rounds {:.2} GB/s against best of {} raw TCP runs \
         {:.2} GB/s over {} connection(s), interleaved (all rounds together: {:.2})",
        p.ratio,
        p.round_gbps.len(),
        p.best_round_gbps,
        p.round_gbps.len(),
        p.tcp_limit_gbps,
        p.connections * p.producers,
        p.ratio_overall,
    );
    println!(
        "  {CEILING}; target >= {TARGET_RATIO:.2}: {}",
        if p.ratio >= TARGET_RATIO { "met" } else { "not met" }
    );
    match (p.cma_limit_gbps, p.ratio_cma_limit) {
        (Some(l), Some(r)) => println!(
            "one-copy same-host limit {l:.2} GB/s (plain process_vm_readv of the same chunks from the producer \
             process, {} thread(s), no protocol, no verification; best of {}): best round {r:.2} of it",
            p.cma_threads,
            p.round_gbps.len()
        ),
        _ => println!("one-copy same-host limit not measured (the kernel refused process_vm_readv)"),
    }
    if let (Some(l), Some(r)) = (p.cma_verified_limit_gbps, p.ratio_cma_verified_limit) {
        println!(
            "one-copy limit with every byte verified {l:.2} GB/s (the same reads, each chunk's crc32c taken \
             right after it was read): best round {r:.2} of it"
        );
    }
    println!(
        "CPU {:.3} s per GB moved (raw TCP {:.3} s per GB: {:.2}x; user + system, every thread of the benchmark)",
        p.cpu_s_per_gb, p.tcp_cpu_s_per_gb, p.cpu_ratio
    );
    println!(
        "wake-ups {:.1} per chunk (raw TCP {:.1} per chunk-sized write), preemptions {:.1} per chunk; \
         landed bytes verified by {}",
        p.wakeups_per_chunk,
        p.tcp_wakeups_per_chunk,
        p.preemptions_per_chunk,
        match p.verify {
            Verify::Receive => "the receive path's checksums of the destination blocks",
            Verify::Reread => "re-reading every landed chunk",
        }
    );
    println!(
        "staged-pipeline limit {:.2} GB/s (the staged design's copies alone in plain code, {:.2} of raw TCP); \
         kvferry reaches {:.2} of it",
        p.pipeline_limit_gbps,
        p.pipeline_limit_gbps / p.tcp_limit_gbps,
        p.pipeline_ratio
    );
    println!(
        "for reference: raw TCP from one hot 4 MiB buffer {:.2} GB/s (kvferry {:.2} of it; the most flattering \
         loopback figure); single-thread memcpy {:.2} GB/s",
        p.tcp_hot_limit_gbps,
        p.gbps / p.tcp_hot_limit_gbps,
        p.memcpy_gbps
    );
}

/// `lo–hi` of `f` over the points, with `digits` decimals.
fn range(points: &[Point], f: impl Fn(&Point) -> f64) -> String {
    let lo = points.iter().map(&f).fold(f64::INFINITY, f64::min);
    let hi = points.iter().map(&f).fold(f64::NEG_INFINITY, f64::max);
    if (hi - lo).abs() < 0.005 {
        format!("{lo:.2}")
    } else {
        format!("{lo:.2}-{hi:.2}")
    }
}

pub(super) fn print_sweep_summary(points: &[Point]) {
    let Some(best) = points.iter().max_by(|a, b| a.gbps.total_cmp(&b.gbps)) else {
        return;
    };
    let moved: u64 = points.iter().map(|p| p.bytes).sum();
    let chunks: u64 = points.iter().map(|p| p.chunks).sum();
    let met = points.iter().filter(|p| p.ratio >= TARGET_RATIO).count();
    // Staging is reported as the least pinned point's.
    let setup = points
        .iter()
        .find(|p| !p.staging_pinned)
        .map_or_else(|| setup_line(best), setup_line);
    println!("sweep of {}; {setup}", points_word(points.len()));
    println!(
        "moved {} in {} chunks over loopback in all, every byte verified",
        ByteSize(moved),
        chunks
    );
    println!(
        "best point: {:.2} GB/s at {} chunks, {} in flight = {:.2} of raw TCP moving the same bytes ({:.2} GB/s)",
        best.gbps,
        ByteSize(best.chunk_bytes as u64),
        best.in_flight,
        best.ratio,
        best.tcp_limit_gbps
    );
    println!(
        "over all points: {} GB/s; ratio {} of raw TCP moving the same bytes; {} of the staged pipeline; \
         p99 {} ms",
        range(points, |p| p.gbps),
        range(points, |p| p.ratio),
        range(points, |p| p.pipeline_ratio),
        range(points, |p| p.p99_ms)
    );
    println!(
        "limits measured at each point: raw TCP (same bytes) {} GB/s, staged pipeline {} GB/s, \
         raw TCP from a hot buffer {} GB/s, memcpy {} GB/s",
        range(points, |p| p.tcp_limit_gbps),
        range(points, |p| p.pipeline_limit_gbps),
        range(points, |p| p.tcp_hot_limit_gbps),
        range(points, |p| p.memcpy_gbps)
    );
    println!(
        "  {CEILING}; target >= {TARGET_RATIO:.2}: met at {met} of {}",
        points_word(points.len())
    );
}
