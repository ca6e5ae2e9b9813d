//! `kvferry chaos`: a soak of the three promises under injected faults.
//!
//! Producers run as `kvferry serve` **child processes** on loopback; the consumer runs
//! in this process. A bounded number of transfers (default 10,000) is driven, a few at
//! a time, while faults are injected at random: callers that cancel at random points,
//! deadlines shorter than the transfer, slice failures in the copy engine, checksum
//! corruption on the wire, connection resets, slow peers, staging-arena exhaustion,
//! SIGKILL of a producer process (and its restart on the same port), and device events
//! that never complete on the `sim` backend.
//!
//! Every byte that lands is verified against its request's pattern (see
//! `cmd_chaos/workload.rs` for the rules), and every call with a deadline is timed: one
//! returning more than 50 ms past its deadline is a *late return*. At the end the run
//! quiesces (every drain fence fired, nothing draining, dropped transfers released
//! their destinations), checks every arena — the consumer's staging, the sim device's
//! staging, and each producer's, reported by `serve` when it is stopped with SIGTERM —
//! and prints a ledger. The command fails (exit status 1, after the ledger) when any
//! byte was corrupted, any page leaked, any call returned late, or anything else that
//! must not happen was seen (an *anomaly*, listed in the ledger).
//!
//! `--seed` fixes the fault schedule (which transfer does what, which producer is
//! killed when, the data); timing-dependent outcomes still vary from run to run.

#[path = "cmd_chaos/blocking_pool.rs"]
mod blocking_pool;
#[path = "cmd_chaos/device.rs"]
mod device;
#[path = "cmd_chaos/device_link.rs"]
mod device_link;
#[path = "cmd_chaos/driver.rs"]
mod driver;
#[path = "cmd_chaos/faults.rs"]
mod faults;
#[path = "cmd_chaos/ledger.rs"]
mod ledger;
#[path = "cmd_chaos/plan.rs"]
mod plan;
#[path = "cmd_chaos/producers.rs"]
mod producers;
#[path = "cmd_chaos/workload.rs"]
mod workload;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kvferry::copy::{CopyConfig, CopyEngine};
use kvferry::engine::{Engine, EngineConfig, StoreConfig};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::{Mutex, Semaphore};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

use crate::util::{parse_timeout, usage};
use blocking_pool::BlockingPool;
use driver::Ctx;
use faults::FlakyBody;
use ledger::{ArenaReport, EndState, Summary};
use plan::Plan;
use producers::{ChildLog, Producer, Spec};
use workload::{mix, Slots, Workload};

/// Request sets per producer.
const SETS_PER_PRODUCER: usize = 32;
/// Destination slots in the consumer's KV region.
const SLOTS: u32 = 32;
/// Consumer staging page size.
const CONSUMER_PAGE: usize = 64 << 10;
/// Consumer staging pages (40 MiB).
const CONSUMER_PAGES: usize = 640;
/// About one producer kill per this many transfers (at fault rate 1; at least one).
const TRANSFERS_PER_KILL: f64 = 800.0;
/// TTL the consumer asks for staged leases (abandoned ones expire after it).
const LEASE_TTL: Duration = Duration::from_secs(1);

/// Options for `chaos`.
#[derive(Args, Debug)]
pub struct ChaosArgs {
    /// Transfers to drive.
    #[arg(long, default_value_t = 10_000)]
    transfers: u64,
    /// Seed of the fault schedule (default: random; printed at the start). The seed fixes
    /// which transfer gets which fault, which producer is killed when, and the data; it
    /// does not fix timing, so two runs with one seed can still differ in outcomes that
    /// depend on it (which call times out, how far a cancelled transfer got, the counts).
    #[arg(long)]
    seed: Option<u64>,
    /// Producer processes.
    #[arg(long, default_value_t = 2)]
    producers: usize,
    /// Transfers in flight at once.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Scales every fault probability: 0 runs without faults, 2 doubles them.
    #[arg(long, default_value_t = 1.0)]
    fault_rate: f64,
    /// Stop starting transfers after this long (the run then quiesces as usual).
    #[arg(long, default_value = "30m", value_parser = parse_timeout)]
    duration_cap: Duration,
    /// Print the ledger as one JSON object.
    #[arg(long)]
    json: bool,
    /// The consumer's movers: "auto" reads the producer processes (on this host)
    /// from their memory with process_vm_readv, so producer kills land mid-read and
    /// copy-thread faults hit the reads, and the device link copies device to device
    /// by device IPC (the sim device's shared memory); "tcp" receives every byte on
    /// the socket, where the producers' send delays and corrupted frames apply, and
    /// the device link stages through host memory.
    #[arg(long, default_value = "auto")]
    transport: kvferry::peer::Transport,
    /// Break one promise on purpose, to prove the checks catch it (for tests).
    #[arg(long, hide = true, value_enum)]
    sabotage: Option<Sabotage>,
}

/// A deliberate violation (`--sabotage`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sabotage {
    /// Flip a landed byte before it is verified.
    Corrupt,
    /// Keep one consumer staging page forever.
    Leak,
    /// Report one get 80 ms after it returned.
    Late,
}

pub fn run(args: ChaosArgs) -> anyhow::Result<()> {
    // Flag errors exit with status 2, like the parser's own.
    if args.transfers == 0 {
        return Err(usage("--transfers must be at least 1"));
    }
    if !(1..=16).contains(&args.producers) {
        return Err(usage("--producers must be 1..=16"));
    }
    if !(1..=256).contains(&args.concurrency) {
        return Err(usage("--concurrency must be 1..=256"));
    }
    if !(args.fault_rate.is_finite() && (0.0..=10.0).contains(&args.fault_rate)) {
        return Err(usage("--fault-rate must be between 0 and 10"));
    }
    let seed = args.seed.unwrap_or_else(rand::random);
    eprintln!(
        "kvferry chaos: seed {seed}, {} transfers, {} producers, fault rate {}",
        args.transfers, args.producers, args.fault_rate
    );
    // Two workers: the tool's own scheduling must not be what makes a call late.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let summary = rt.block_on(drive(&args, seed));
    // Streams of the sim device still stuck on never-completing events end here.
    rt.shutdown_timeout(Duration::from_secs(2));
    let summary = summary?;
    if args.json {
        println!("{}", serde_json::to_string(&summary)?);
    } else {
        print!("{}", summary.text());
    }
    anyhow::ensure!(
        summary.ok,
        "chaos found {} corrupted bytes, {} leaked pages, {} late returns, {} anomalies (seed {seed})",
        summary.corrupted_bytes,
        summary.leaked_pages,
        summary.late_returns,
        summary.anomalies
    );
    Ok(())
}

/// Which transfers trigger a producer kill: `index → (producer, delay)`.
fn kill_schedule(seed: u64, transfers: u64, rate: f64, producers: usize) -> BTreeMap<u64, (usize, Duration)> {
    let mut rng = StdRng::seed_from_u64(mix(seed, &[3]));
    let n = if rate > 0.0 {
        ((transfers as f64 * rate / TRANSFERS_PER_KILL).round() as u64).max(1)
    } else {
        0
    };
    (0..n)
        .map(|k| {
            let slot = transfers as f64 / n as f64;
            let at = (slot * (k as f64 + rng.gen_range(0.2..0.8))) as u64;
            let victim = rng.gen_range(0..producers);
            let delay = Duration::from_micros(rng.gen_range(0..=5_000));
            (at.min(transfers - 1), (victim, delay))
        })
        .collect()
}

async fn drive(args: &ChaosArgs, seed: u64) -> anyhow::Result<Summary> {
    let started = Instant::now();
    let rate = args.fault_rate;
    let ppm = |base: f64| (base * rate) as u64;
    let work = Workload::new(seed, args.producers, SETS_PER_PRODUCER)?;
    let spec = Spec {
        exe: std::env::current_exe().context("locating the kvferry executable")?,
        blocks: work.producer_blocks() + 16,
        corrupt_ppm: ppm(10_000.0),
        slow_ppm: ppm(15_000.0),
        slow_us: 30_000,
        reset_ppm: ppm(5_000.0),
    };
    let mut procs = Vec::new();
    for i in 0..args.producers {
        let log = Arc::new(ChildLog::default());
        procs.push(Producer::start(&spec, i, "127.0.0.1:0", log).await?);
    }
    let addrs: Vec<String> = procs.iter().map(|p| p.addr.clone()).collect();
    let logs: Vec<Arc<ChildLog>> = procs.iter().map(|p| p.log.clone()).collect();
    let procs: Arc<Vec<Mutex<Option<Producer>>>> = Arc::new(procs.into_iter().map(|p| Mutex::new(Some(p))).collect());

    let body = Arc::new(FlakyBody::new(mix(seed, &[4]), ppm(3_000.0)));
    // The consumer is a client-only engine whose copy threads fail at random.
    let mut cfg = EngineConfig::default()
        .listen(None)
        .peer_id("chaos-consumer")
        .arena(CONSUMER_PAGE * CONSUMER_PAGES, CONSUMER_PAGE);
    cfg.pinned = false;
    cfg.copy = CopyConfig {
        threads: 2,
        slice_bytes: 64 << 10,
    };
    cfg.copy_body = Some(body.clone());
    cfg.producer.transport = args.transport;
    cfg.store = StoreConfig::Bytes {
        bytes: 64 << 10,
        block_bytes: 64 << 10,
    };
    cfg.net.io_timeout = Duration::from_secs(2);
    cfg.net.connect_timeout = Duration::from_secs(1);
    cfg.net.handshake_timeout = Duration::from_secs(1);
    cfg.lease_ttl = LEASE_TTL;
    cfg.lease_guard = Duration::from_millis(100);
    cfg.done_timeout = Duration::from_millis(500);
    let kv_engine = Engine::start(cfg).await?;
    let consumer = kv_engine.consumer().clone();
    let engine = consumer.engine().clone();
    if args.sabotage == Some(Sabotage::Leak) {
        // Proves the leak check: one staging page that never comes back.
        std::mem::forget(consumer.arena().try_alloc(1)?);
    }
    let slots = Arc::new(Slots::new(SLOTS)?);
    let sim = device::SimRig::new(mix(seed, &[5]))?;
    let link = device_link::DeviceLink::new(mix(seed, &[6]), args.transport).await?;
    let ctx = Arc::new(Ctx::new(
        consumer,
        work,
        slots,
        addrs,
        BlockingPool::new(4),
        sim,
        link,
        args.sabotage,
    ));
    for p in 0..args.producers {
        ctx.fill(p).await?;
    }

    let kills = kill_schedule(seed, args.transfers, rate, args.producers);
    let permits = Arc::new(Semaphore::new(args.concurrency));
    let mut tasks = JoinSet::new();
    let mut killer: Option<JoinHandle<anyhow::Result<()>>> = None;
    let cap = started + args.duration_cap;
    let tick = (args.transfers / 10).max(1);
    let stop_canaries = Arc::new(AtomicBool::new(false));
    let canaries = canaries(&ctx, &stop_canaries);
    for i in 0..args.transfers {
        if Instant::now() >= cap {
            eprintln!("kvferry chaos: duration cap reached after {i} transfers; quiescing");
            break;
        }
        let permit = permits.clone().acquire_owned().await?;
        if let Some(&(victim, delay)) = kills.get(&i) {
            if killer.as_ref().is_none_or(|k| k.is_finished()) {
                if let Some(k) = killer.take() {
                    k.await??;
                }
                let (c, p, s) = (ctx.clone(), procs.clone(), spec.clone());
                killer = Some(tokio::spawn(kill_and_restart(c, p, s, victim, delay)));
            }
        }
        let plan = Plan::draw(seed, i, args.producers, SETS_PER_PRODUCER, rate);
        let c = ctx.clone();
        tasks.spawn(async move {
            driver::run(c, plan).await;
            drop(permit);
        });
        while let Some(r) = tasks.try_join_next() {
            if let Err(e) = r {
                ctx.ledger.anomaly(format!("a transfer task panicked: {e}"));
            }
        }
        if i % 64 == 0 {
            ctx.sweep_limbo();
        }
        if !args.json && (i + 1) % tick == 0 {
            let (s, d) = ctx.ledger.progress();
            eprintln!(
                "kvferry chaos: {s} started, {d} finished, {:.1} s",
                started.elapsed().as_secs_f64()
            );
        }
    }
    while let Some(r) = tasks.join_next().await {
        if let Err(e) = r {
            ctx.ledger.anomaly(format!("a transfer task panicked: {e}"));
        }
    }
    if let Some(k) = killer.take() {
        k.await??;
    }

    let mut arenas = quiesce(&ctx, &engine).await;
    // Every staged lease must now come back by Done or TTL: give the TTL time to pass
    // before asking the producers what they still hold.
    tokio::time::sleep(LEASE_TTL + Duration::from_millis(500)).await;
    stop_canaries.store(true, Ordering::Relaxed);
    let (runtime_canary, thread_canary) = canaries;
    let _ = runtime_canary.await;
    let _ = tokio::task::spawn_blocking(move || thread_canary.join()).await;
    ctx.ledger.fault("slice_failures", body.injected());
    for (i, p) in procs.iter().enumerate() {
        let p = p.lock().await.take().context("producer already stopped")?;
        let r = p.stop().await?;
        if r.held_pages > 0 {
            ctx.ledger.anomaly(format!(
                "producer {i} still held {} staging pages after every lease's TTL had passed",
                r.held_pages
            ));
        }
        let leaked = r.held_pages.max(r.outstanding);
        arenas.push(ArenaReport {
            name: format!("producer-{i}"),
            total_pages: producers::ARENA_PAGES,
            free_pages: producers::ARENA_PAGES.saturating_sub(leaked + r.quarantined),
            quarantined_pages: r.quarantined,
            leaked_pages: leaked,
        });
    }
    for log in &logs {
        for (kind, n) in log.faults.lock().unwrap().iter() {
            ctx.ledger.fault(&format!("{kind}s"), *n);
        }
    }
    ctx.blocking.shutdown();
    Ok(ctx.ledger.summary(EndState {
        seed,
        arenas,
        producers: args.producers,
        fault_rate: rate,
        concurrency: args.concurrency,
        wall: started.elapsed(),
        transport: args.transport.to_string(),
        cma_transfers: ctx.consumer.stats().cma_transfers,
        device_ipc_transfers: ctx.link.device_ipc_transfers(),
    }))
}

/// Timers that measure how late the machine (and the tool's own load) wakes a 2 ms
/// sleep: one on the runtime, one on a plain thread. Separates a slow machine from a
/// slow library when reading late returns.
fn canaries(ctx: &Arc<Ctx>, stop: &Arc<AtomicBool>) -> (JoinHandle<()>, std::thread::JoinHandle<()>) {
    const PERIOD: Duration = Duration::from_millis(2);
    let (c, s) = (ctx.clone(), stop.clone());
    let on_runtime = tokio::spawn(async move {
        while !s.load(Ordering::Relaxed) {
            let due = Instant::now() + PERIOD;
            tokio::time::sleep_until(due).await;
            let late = Instant::now().saturating_duration_since(due).as_micros() as u64;
            c.ledger.canary_runtime_us.fetch_max(late, Ordering::Relaxed);
        }
    });
    let (c, s) = (ctx.clone(), stop.clone());
    let on_thread = std::thread::spawn(move || {
        while !s.load(Ordering::Relaxed) {
            let due = std::time::Instant::now() + PERIOD;
            std::thread::sleep(PERIOD);
            let late = std::time::Instant::now().saturating_duration_since(due).as_micros() as u64;
            c.ledger.canary_thread_us.fetch_max(late, Ordering::Relaxed);
        }
    });
    (on_runtime, on_thread)
}

/// SIGKILLs producer `victim` after `delay`, restarts it on the same address and fills
/// it again (its store died with it).
async fn kill_and_restart(
    ctx: Arc<Ctx>,
    procs: Arc<Vec<Mutex<Option<Producer>>>>,
    spec: Spec,
    victim: usize,
    delay: Duration,
) -> anyhow::Result<()> {
    tokio::time::sleep(delay).await;
    {
        let mut slot = procs[victim].lock().await;
        let mut p = slot.take().context("producer already stopped")?;
        ctx.note_kill(victim);
        p.kill().await?;
        ctx.ledger.fault("peer_kills", 1);
        let (addr, log) = (p.addr.clone(), p.log.clone());
        let restarted = Producer::start(&spec, victim, &addr, log)
            .await
            .with_context(|| format!("restarting producer {victim} on {addr}"))?;
        *slot = Some(restarted);
    }
    ctx.fill(victim).await
}

/// Waits until nothing is in flight, then accounts the consumer's and the sim
/// device's arenas and the destination slots.
async fn quiesce(ctx: &Arc<Ctx>, engine: &CopyEngine) -> Vec<ArenaReport> {
    let ledger = &ctx.ledger;
    // Drain checks, hogs, and the checks of dropped transfers as the library lets go of
    // their destinations.
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        if !ctx.join_background(until).await {
            ledger.anomaly("drain checks still running 30 s after the last transfer".into());
            break;
        }
        let held = ctx.sweep_limbo();
        if held == 0 {
            if !ctx.join_background(until).await {
                ledger.anomaly("drain checks still running 30 s after the last transfer".into());
            }
            break;
        }
        if Instant::now() >= until {
            for _ in 0..held {
                ledger.drain(None);
            }
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let until = Instant::now() + Duration::from_secs(10);
    while ctx.consumer.stats().draining > 0 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let draining = ctx.consumer.stats().draining;
    if draining > 0 {
        ledger.anomaly(format!("{draining} transfers still draining 10 s after quiescing"));
    }
    let jobs = engine.stats().jobs_in_flight;
    if jobs > 0 {
        ledger.anomaly(format!("{jobs} landing copies still in flight after quiescing"));
    }
    let arena = ctx.consumer.arena();
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let s = arena.stats();
        if s.free_pages + s.quarantined_pages == s.total_pages || Instant::now() >= until {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let s = arena.stats();
    let consumer = ArenaReport {
        name: "consumer".into(),
        total_pages: s.total_pages as u64,
        free_pages: s.free_pages as u64,
        quarantined_pages: s.quarantined_pages as u64,
        leaked_pages: (s.total_pages - s.free_pages - s.quarantined_pages) as u64,
    };
    let lost = ctx.slots.count() as usize - ctx.slots.free_count();
    if lost > 0 {
        ledger.anomaly(format!("{lost} destination slots never came back"));
    }
    ledger.corrupted(
        ctx.slots.check_free(),
        "free destination slots were written after they were handed back",
    );
    let mut reports = vec![consumer, ctx.sim.report()];
    reports.extend(ctx.link.finish(ledger).await);
    reports
}
