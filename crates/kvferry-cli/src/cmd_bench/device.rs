//! `kvferry bench device`: the device layer's bounded waits and host-backend copies.
//!
//! - **Wait CPU cost**: process CPU time (`CLOCK_PROCESS_CPUTIME_ID`, all threads)
//!   consumed while one waiter waits `--wait-ms` (default 1 s) on an event that stays
//!   pending, as a percentage of one core — async (`Event::wait` on a tokio task) and
//!   blocking (`Event::wait_blocking`).
//! - **Wake-up latency**: another thread completes the pending work at a random moment
//!   (0.2–3 ms after the wait starts) and notes the time; the waiter notes when it
//!   resumes; p50/p99/max of the difference over `--samples` runs.
//!
//! Both use the same pending work on each backend: a stream made to wait on a manual
//! host event (the "gate"), then an event recorded after it — so completion travels
//! gate → stream executor → recorded event → waiter. The `manual` rows wait on the gate
//! itself. Backends: sim, host, and cuda when built with `--features cuda` on a machine
//! with a GPU (otherwise reported as skipped).
//!
//! - **Throughput**: host-backend D2H and H2D of `--bytes` (default 256 MiB) through the
//!   copy engine against a single-thread memcpy of the same bytes in the same run.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use kvferry::copy::{CopyConfig, CopyEngine};
use kvferry::device::{
    Device, DeviceBuffer, DeviceError, Event, EventTrigger, HostDevice, SimConfig, SimDevice, Stream,
};
use kvferry::mem::{Arena, ArenaConfig, ByteSize};
use rand::Rng;
use serde::Serialize;
use tokio::runtime::Runtime;

/// Options for `bench device`.
#[derive(Args, Debug, Clone)]
pub struct DeviceBenchArgs {
    /// Bytes per throughput case.
    #[arg(long, default_value = "256MiB")]
    bytes: ByteSize,
    /// How long the waiter waits on a pending event while its CPU cost is measured.
    #[arg(long, default_value_t = 1000)]
    wait_ms: u64,
    /// Wake-up latency samples per backend and waiter.
    #[arg(long, default_value_t = 200)]
    samples: usize,
    /// Repetitions per throughput case; the best is reported.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Copy threads of the host backend (default: available cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Print a JSON object instead of tables.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize, Debug)]
struct CpuRow {
    backend: String,
    waiter: &'static str,
    wall_ms: f64,
    cpu_ms: f64,
    core_pct: f64,
    outcome: String,
}

#[derive(Serialize, Debug)]
struct WakeRow {
    backend: String,
    waiter: &'static str,
    samples: usize,
    p50_us: f64,
    p99_us: f64,
    max_us: f64,
}

#[derive(Serialize, Debug)]
struct ThroughputRow {
    case: &'static str,
    bytes: u64,
    gbps: f64,
    memcpy_gbps: f64,
    ratio: f64,
    threads: usize,
    arena: String,
}

#[derive(Serialize, Debug)]
struct Report {
    cores: usize,
    wait_ms: u64,
    cpu: Vec<CpuRow>,
    wake: Vec<WakeRow>,
    throughput: Vec<ThroughputRow>,
    cuda: String,
}

/// A backend under test: a stream to gate, or none for the bare manual event.
struct Target {
    name: String,
    stream: Option<Stream>,
    /// Keeps the device alive.
    _device: Option<Arc<dyn Device>>,
}

pub fn run(args: DeviceBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.reps >= 1, "--reps must be at least 1");
    anyhow::ensure!(args.samples >= 1, "--samples must be at least 1");
    anyhow::ensure!(args.wait_ms >= 1, "--wait-ms must be at least 1");
    let bytes = args.bytes.bytes() as usize;
    anyhow::ensure!(bytes >= 1 << 20, "--bytes must be at least 1MiB");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut config = CopyConfig::default();
    if let Some(t) = args.threads {
        config.threads = t;
    }
    let threads = config.threads;
    let engine = CopyEngine::new(config).context("starting copy engine")?;

    let mut targets = vec![Target {
        name: "manual".into(),
        stream: None,
        _device: None,
    }];
    let sim = SimDevice::with_runtime(SimConfig::new(0), rt.handle().clone())?;
    targets.push(Target {
        name: "sim".into(),
        stream: Some(sim.create_stream("bench")?),
        _device: Some(sim),
    });
    let host = HostDevice::with_runtime(engine.clone(), 0, rt.handle().clone());
    targets.push(Target {
        name: "host".into(),
        stream: Some(host.create_stream("bench")?),
        _device: Some(host.clone()),
    });
    let cuda = open_cuda(&mut targets);

    let wait = Duration::from_millis(args.wait_ms);
    let mut cpu = Vec::new();
    let mut wake = Vec::new();
    for t in &targets {
        cpu.push(cpu_cost(&rt, t, wait, false)?);
        cpu.push(cpu_cost(&rt, t, wait, true)?);
        wake.push(wake_latency(&rt, t, args.samples, false)?);
        wake.push(wake_latency(&rt, t, args.samples, true)?);
    }
    let throughput = host_throughput(&rt, &host, bytes, args.reps, threads)?;
    drop(targets);
    engine.shutdown();

    let report = Report {
        cores,
        wait_ms: args.wait_ms,
        cpu,
        wake,
        throughput,
        cuda,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_tables(&report);
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn open_cuda(targets: &mut Vec<Target>) -> String {
    match kvferry::device::CudaDevice::open(0, 0) {
        Ok(dev) => match dev.create_stream("bench") {
            Ok(s) => {
                let name = format!("cuda ({})", dev.name());
                targets.push(Target {
                    name: "cuda".into(),
                    stream: Some(s),
                    _device: Some(dev),
                });
                name
            }
            Err(e) => format!("skipped: {e}"),
        },
        Err(e) => format!("skipped: {e}"),
    }
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_targets: &mut Vec<Target>) -> String {
    "skipped: built without the cuda feature (cargo run --release --features cuda -- bench device)".into()
}

/// A pending event on `t`: the stream waits on a manual gate and records after it.
fn pending(t: &Target) -> anyhow::Result<(Event, EventTrigger)> {
    let (gate, trigger) = Event::manual("bench gate", 0);
    let ev = match &t.stream {
        Some(s) => {
            s.wait_event(&gate)?;
            s.record("bench: after gate")?
        }
        None => gate,
    };
    Ok((ev, trigger))
}

/// CPU time of the whole process (all threads).
fn process_cpu() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes into the struct we pass; the clock id is valid.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn cpu_cost(rt: &Runtime, t: &Target, wait: Duration, blocking: bool) -> anyhow::Result<CpuRow> {
    let (ev, trigger) = pending(t)?;
    let c0 = process_cpu();
    let t0 = Instant::now();
    let result = if blocking {
        ev.wait_blocking(Instant::now() + wait)
    } else {
        let ev2 = ev.clone();
        rt.block_on(async move { tokio::spawn(async move { wait_from_now(&ev2, wait).await }).await })?
    };
    let wall = t0.elapsed();
    let used = process_cpu().saturating_sub(c0);
    // Let the stream drain before the next case.
    trigger.complete();
    ev.wait_blocking(Instant::now() + Duration::from_secs(30))
        .context("draining after the CPU case")?;
    Ok(CpuRow {
        backend: t.name.clone(),
        waiter: if blocking { "blocking" } else { "async" },
        wall_ms: wall.as_secs_f64() * 1e3,
        cpu_ms: used.as_secs_f64() * 1e3,
        core_pct: 100.0 * used.as_secs_f64() / wall.as_secs_f64().max(1e-9),
        outcome: match result {
            Ok(()) => "completed (unexpected)".into(),
            Err(DeviceError::Timeout { waited, .. }) => format!("timeout at deadline (waited {waited:.1?})"),
            Err(e) => e.to_string(),
        },
    })
}

/// Waits until `wait` from now (not from submission: the benchmark measures the wait).
async fn wait_from_now(ev: &Event, wait: Duration) -> Result<(), DeviceError> {
    ev.wait(tokio::time::Instant::now() + wait).await
}

fn wake_latency(rt: &Runtime, t: &Target, samples: usize, blocking: bool) -> anyhow::Result<WakeRow> {
    let mut rng = rand::thread_rng();
    let mut lat = Vec::with_capacity(samples);
    for _ in 0..samples {
        let (ev, trigger) = pending(t)?;
        let delay = Duration::from_micros(rng.gen_range(200..3000));
        let completer = std::thread::spawn(move || {
            std::thread::sleep(delay);
            let at = Instant::now();
            trigger.complete();
            at
        });
        let resumed = if blocking {
            ev.wait_blocking(Instant::now() + Duration::from_secs(30))?;
            Instant::now()
        } else {
            let ev2 = ev.clone();
            rt.block_on(async move {
                tokio::spawn(async move {
                    wait_from_now(&ev2, Duration::from_secs(30))
                        .await
                        .map(|()| Instant::now())
                })
                .await
            })??
        };
        let completed = completer
            .join()
            .map_err(|_| anyhow::anyhow!("completer thread panicked"))?;
        lat.push(resumed.saturating_duration_since(completed));
    }
    lat.sort_unstable();
    let pct = |p: f64| lat[((lat.len() - 1) as f64 * p).round() as usize].as_secs_f64() * 1e6;
    Ok(WakeRow {
        backend: t.name.clone(),
        waiter: if blocking { "blocking" } else { "async" },
        samples,
        p50_us: pct(0.5),
        p99_us: pct(0.99),
        max_us: pct(1.0),
    })
}

fn host_throughput(
    rt: &Runtime,
    dev: &Arc<HostDevice>,
    bytes: usize,
    reps: usize,
    threads: usize,
) -> anyhow::Result<Vec<ThroughputRow>> {
    let page = 2 << 20;
    let pages = bytes.div_ceil(page);
    let arena = Arena::new(ArenaConfig::new(page, pages)).context("creating staging arena")?;
    let arena_kind = match arena.fallback_reason() {
        None => arena.backing_kind().to_string(),
        Some(why) => {
            eprintln!("note: staging arena is {} ({why})", arena.backing_kind());
            arena.backing_kind().to_string()
        }
    };
    let src = dev.alloc(bytes)?;
    let chunk: Vec<u8> = (0..1 << 20).map(|i: usize| (i * 131 + i / 977) as u8).collect();
    for off in (0..bytes).step_by(1 << 20) {
        let n = (1 << 20).min(bytes - off);
        let mut c = chunk[..n].to_vec();
        c[0] = (off >> 20) as u8;
        src.write(off, &c)?;
    }
    let dst = dev.alloc(bytes)?;
    let stream = dev.create_stream("bench-throughput")?;
    let mut plain = vec![1u8; bytes]; // touched, so the memcpy limit pays no page faults
    let far = || tokio::time::Instant::now() + Duration::from_secs(600);

    // D2H: device buffer -> lease, vs memcpy device buffer -> plain buffer.
    let mut limit = f64::MAX;
    for _ in 0..reps {
        let t = Instant::now();
        src.read(0, &mut plain)?;
        limit = limit.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&plain);
    let mut lease = Some(arena.try_alloc(pages).context("arena too small")?);
    let mut best = f64::MAX;
    for _ in 0..reps {
        let l = lease.take().expect("lease back");
        let t = Instant::now();
        let l = rt.block_on(stream.copy_d2h(&src, 0, l, 0, bytes, "bench d2h")?.wait(far()))?;
        best = best.min(t.elapsed().as_secs_f64());
        lease = Some(l);
    }
    let lease = lease.expect("lease back");
    verify(&src, 0, |off, n| lease.to_vec(off, n).map_err(Into::into), bytes)?;
    let gb = bytes as f64 / 1e9;
    let mut rows = vec![ThroughputRow {
        case: "host d2h",
        bytes: bytes as u64,
        gbps: gb / best,
        memcpy_gbps: gb / limit,
        ratio: limit / best,
        threads,
        arena: arena_kind.clone(),
    }];

    // H2D: lease -> device buffer, vs memcpy plain buffer -> device buffer.
    let mut limit = f64::MAX;
    for _ in 0..reps {
        let t = Instant::now();
        dst.write(0, &plain)?;
        limit = limit.min(t.elapsed().as_secs_f64());
    }
    let mut lease = Some(lease);
    let mut best = f64::MAX;
    for _ in 0..reps {
        let l = lease.take().expect("lease back");
        let t = Instant::now();
        let l = rt.block_on(stream.copy_h2d(l, 0, &dst, 0, bytes, "bench h2d")?.wait(far()))?;
        best = best.min(t.elapsed().as_secs_f64());
        lease = Some(l);
    }
    verify(&src, 0, |off, n| dst.to_vec(off, n).map_err(Into::into), bytes)?;
    rows.push(ThroughputRow {
        case: "host h2d",
        bytes: bytes as u64,
        gbps: gb / best,
        memcpy_gbps: gb / limit,
        ratio: limit / best,
        threads,
        arena: arena_kind,
    });
    Ok(rows)
}

/// Compares one 4 KiB sample per MiB so the benchmark cannot pass by copying nothing.
fn verify(
    src: &DeviceBuffer,
    base: usize,
    read: impl Fn(usize, usize) -> anyhow::Result<Vec<u8>>,
    bytes: usize,
) -> anyhow::Result<()> {
    for off in (0..bytes).step_by(1 << 20) {
        let n = 4096.min(bytes - off);
        anyhow::ensure!(
            read(off, n)? == src.to_vec(base + off, n)?,
            "verification failed at offset {off}"
        );
    }
    Ok(())
}

fn print_tables(r: &Report) {
    println!(
        "event wait CPU cost ({} ms wait on a pending event; {} cores; % of one core)",
        r.wait_ms, r.cores
    );
    println!(
        "{:<10} {:<9} {:>9} {:>8} {:>8}  outcome",
        "backend", "waiter", "wall ms", "cpu ms", "% core"
    );
    for c in &r.cpu {
        println!(
            "{:<10} {:<9} {:>9.1} {:>8.3} {:>8.3}  {}",
            c.backend, c.waiter, c.wall_ms, c.cpu_ms, c.core_pct, c.outcome
        );
    }
    println!();
    println!("wake-up latency (completion by another thread -> waiter resumes)");
    println!(
        "{:<10} {:<9} {:>8} {:>9} {:>9} {:>9}",
        "backend", "waiter", "samples", "p50 µs", "p99 µs", "max µs"
    );
    for w in &r.wake {
        println!(
            "{:<10} {:<9} {:>8} {:>9.1} {:>9.1} {:>9.1}",
            w.backend, w.waiter, w.samples, w.p50_us, w.p99_us, w.max_us
        );
    }
    println!();
    println!("host backend copies vs single-thread memcpy of the same bytes");
    println!(
        "{:<10} {:>10} {:>9} {:>12} {:>7} {:>8}  arena",
        "case", "bytes", "GB/s", "memcpy GB/s", "ratio", "threads"
    );
    for t in &r.throughput {
        println!(
            "{:<10} {:>10} {:>9.2} {:>12.2} {:>7.2} {:>8}  {}",
            t.case,
            ByteSize(t.bytes).to_string(),
            t.gbps,
            t.memcpy_gbps,
            t.ratio,
            t.threads,
            t.arena
        );
    }
    println!();
    println!("cuda: {}", r.cuda);
}
