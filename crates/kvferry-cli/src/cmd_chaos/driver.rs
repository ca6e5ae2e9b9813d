//! The transfers: each [`Plan`] (drawn from the seed, see `plan.rs`) is run against
//! the consumer, timed against its deadline and verified byte for byte once its
//! destination is quiet.
//!
//! Kinds:
//!
//! - `get`: eager get with a generous deadline;
//! - `get-short`: eager get whose deadline (0.3–3 ms, or 5–40 ms) is shorter than the
//!   transfer, or than a slow send;
//! - `get-drop`: eager get whose future the caller drops at a random point (0–5 ms);
//! - `blocking` / `blocking-short`: `get_blocking` from a plain thread, with a generous
//!   or a short timeout;
//! - `pull`: delayed pull (stage, then resolve — with a generous or short deadline, or
//!   dropped at a random point — or release the lease, or abandon it to its TTL);
//! - `offload`: a D2H copy on the sim device (see `device.rs`).
//!
//! Faults injected around them: see `faults.rs` (slice failures in the consumer's copy
//! engine, staging arena hogs); the producers inject wire corruption, slow sends and
//! connection resets, and are SIGKILLed (see the command).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvferry::peer::{Consumer, GetFailure, Landed};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::blocking_pool::BlockingPool;
use super::device::SimRig;
use super::device_link::DeviceLink;
use super::faults::hog;
use super::ledger::{Ledger, Outcome};
use super::plan::{Kind, Plan, PullMode, GENEROUS};
use super::workload::{Check, Dest, Set, Slots, Workload};
use super::Sabotage;

/// How long a failed transfer's fence may take before it counts as stuck.
const DRAIN_BOUND: Duration = Duration::from_secs(10);
/// How soon a transfer in flight when its producer is killed must fail.
const PROMPT: Duration = Duration::from_millis(500);
/// How long a transfer may wait for a free destination slot.
const SLOT_WAIT: Duration = Duration::from_secs(30);

/// A dropped transfer's private destination, checked once the library let go of it.
struct Limbo {
    dest: Dest,
    producer: usize,
    set: usize,
}

/// Everything the transfers share.
pub struct Ctx {
    /// The consumer under test.
    pub consumer: Consumer,
    /// The request sets.
    pub work: Workload,
    /// Destination slots.
    pub slots: Arc<Slots>,
    /// Counters.
    pub ledger: Ledger,
    /// Producer addresses (fixed across restarts).
    pub addrs: Vec<String>,
    /// Threads for `get_blocking`.
    pub blocking: BlockingPool,
    /// The sim device.
    pub sim: SimRig,
    /// Device KV over the transfer path (two engines, two sim devices).
    pub link: DeviceLink,
    background: Mutex<Vec<JoinHandle<()>>>,
    limbo: Mutex<Vec<Limbo>>,
    sabotage: Mutex<Option<Sabotage>>,
    kills: Mutex<Vec<(usize, Instant)>>,
}

impl Ctx {
    /// Shared state of a run.
    #[allow(clippy::too_many_arguments)] // one argument per part of a run, each named
    pub fn new(
        consumer: Consumer,
        work: Workload,
        slots: Arc<Slots>,
        addrs: Vec<String>,
        blocking: BlockingPool,
        sim: SimRig,
        link: DeviceLink,
        sabotage: Option<Sabotage>,
    ) -> Ctx {
        Ctx {
            consumer,
            work,
            slots,
            ledger: Ledger::default(),
            addrs,
            blocking,
            sim,
            link,
            background: Mutex::new(Vec::new()),
            limbo: Mutex::new(Vec::new()),
            sabotage: Mutex::new(sabotage),
            kills: Mutex::new(Vec::new()),
        }
    }

    /// Producer `p` is being SIGKILLed now.
    pub fn note_kill(&self, p: usize) {
        self.kills.lock().unwrap().push((p, Instant::now()));
    }

    /// A transfer with a generous deadline to `plan.producer` ran from `started` to
    /// `returned`: if its producer was killed meanwhile and it failed, it must have
    /// failed promptly (well before its deadline), with the peer loss.
    fn after_kill<T>(&self, plan: &Plan, started: Instant, returned: Instant, r: &Result<T, GetFailure>) {
        let Err(f) = r else { return };
        if plan.deadline != GENEROUS {
            return;
        }
        let kill = self
            .kills
            .lock()
            .unwrap()
            .iter()
            .filter(|(p, at)| *p == plan.producer && *at >= started && *at <= returned)
            .map(|(_, at)| *at)
            .max();
        if let Some(at) = kill {
            let after = returned - at;
            self.ledger.killed_in_flight(after);
            if after > PROMPT {
                self.ledger.anomaly(format!(
                    "transfer {} was in flight when producer {} was killed and returned {:?} only {:.0} ms later: {}",
                    plan.index,
                    plan.producer,
                    crate::cmd_chaos::ledger::classify(&f.error).0,
                    after.as_secs_f64() * 1e3,
                    f.error
                ));
            }
        }
    }

    /// True once if `--sabotage` asked for `which`.
    fn sabotage(&self, which: Sabotage) -> bool {
        let mut s = self.sabotage.lock().unwrap();
        if *s == Some(which) {
            *s = None;
            return true;
        }
        false
    }

    fn set(&self, producer: usize, set: usize) -> &Set {
        &self.work.sets[producer][set]
    }

    /// Pushes every chunk of producer `p`'s sets to it (after a start or restart),
    /// retrying refusals (busy arena) and losses (a restart in progress).
    pub async fn fill(&self, p: usize) -> anyhow::Result<()> {
        let addr = &self.addrs[p];
        for set in &self.work.sets[p] {
            for c in &set.chunks {
                let mut last = None;
                for _ in 0..100 {
                    let deadline = Instant::now() + GENEROUS;
                    let r = self.consumer.put(addr, c.key, &c.data, deadline).await;
                    self.ledger.returned("put", deadline, Instant::now());
                    match r {
                        Ok(()) => {
                            last = None;
                            break;
                        }
                        Err(e) => last = Some(e),
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                if let Some(e) = last {
                    anyhow::bail!("could not fill producer {p} at {addr}: {e}");
                }
            }
        }
        Ok(())
    }

    /// Keeps a background task (a drain check, a hog) to await at the end.
    fn keep(&self, h: JoinHandle<()>) {
        let mut b = self.background.lock().unwrap();
        if b.len() > 256 {
            b.retain(|h| !h.is_finished());
        }
        b.push(h);
    }

    /// Awaits every background task, until `deadline`; false if some did not finish.
    pub async fn join_background(&self, deadline: Instant) -> bool {
        loop {
            let hs: Vec<_> = std::mem::take(&mut *self.background.lock().unwrap());
            if hs.is_empty() {
                return true;
            }
            for h in hs {
                match tokio::time::timeout_at(deadline, h).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => self.ledger.anomaly(format!("a background check panicked: {e}")),
                    Err(_) => return false,
                }
            }
        }
    }

    /// Checks (in the background) the dropped transfers whose destination the library
    /// released; returns how many are still held.
    pub fn sweep_limbo(self: &Arc<Self>) -> usize {
        let (ready, left) = {
            let mut limbo = self.limbo.lock().unwrap();
            let (ready, held): (Vec<_>, Vec<_>) =
                limbo.drain(..).partition(|l| Arc::strong_count(l.dest.region()) == 1);
            *limbo = held;
            (ready, limbo.len())
        };
        if !ready.is_empty() {
            let ctx = self.clone();
            self.keep(tokio::spawn(async move {
                let c = ctx.clone();
                let bad: usize = cpu(move || {
                    ready
                        .iter()
                        .map(|l| l.dest.check(c.set(l.producer, l.set), Check::PoisonOrOwn))
                        .sum()
                })
                .await;
                ctx.ledger
                    .corrupted(bad, "a dropped transfer's destination holds foreign bytes");
            }));
        }
        left
    }

    /// Books a transfer's result and verifies its destination: at once on success,
    /// after the drain fence fired (in the background) on failure.
    async fn settle(self: &Arc<Self>, r: Result<Landed, GetFailure>, dest: Dest, plan: &Plan, what: &'static str) {
        match r {
            Ok(landed) => self.check_landed(dest, landed, plan, what).await,
            Err(f) => {
                self.ledger.error(&f.error);
                let ctx = self.clone();
                let (p, s, index) = (plan.producer, plan.set, plan.index);
                self.keep(tokio::spawn(async move {
                    let t = Instant::now();
                    if f.fence.wait_until(t + DRAIN_BOUND).await {
                        ctx.ledger.drain(Some(t.elapsed()));
                        let c = ctx.clone();
                        let bad = cpu(move || {
                            let bad = dest.check(c.set(p, s), Check::PoisonOrOwn);
                            dest.finish();
                            bad
                        })
                        .await;
                        let msg = format!("transfer {index} ({what}) after its fence fired ({})", f.error);
                        ctx.ledger.corrupted(bad, &msg);
                    } else {
                        // Never reused: its slot is lost to the run.
                        ctx.ledger.drain(None);
                    }
                }));
            }
        }
    }

    async fn check_landed(self: &Arc<Self>, dest: Dest, landed: Landed, plan: &Plan, what: &str) {
        let set = self.set(plan.producer, plan.set);
        let n = set.chunks.len();
        self.ledger.hit(landed.chunks, n);
        if landed.chunks > n || landed.bytes != set.bytes(landed.chunks) {
            self.ledger.anomaly(format!(
                "transfer {} ({what}) reported {landed:?} for a set of {n} chunks ({} bytes in the first {})",
                plan.index,
                set.bytes(landed.chunks.min(n)),
                landed.chunks.min(n)
            ));
        }
        let (c, p, s) = (self.clone(), plan.producer, plan.set);
        let tamper = landed.bytes > 0 && self.sabotage(Sabotage::Corrupt);
        let bad = cpu(move || {
            if tamper {
                dest.tamper();
            }
            let bad = dest.check(c.set(p, s), Check::Landed(landed.chunks.min(n)));
            dest.finish();
            bad
        })
        .await;
        self.ledger.verified(landed.bytes, 0);
        let msg = format!("transfer {} ({what}) landed {landed:?}", plan.index);
        self.ledger.corrupted(bad, &msg);
        self.ledger.outcome(Outcome::Completed);
    }

    /// A poisoned private destination for `plan`'s set.
    async fn private(self: &Arc<Self>, plan: &Plan) -> Option<Dest> {
        let (c, p, s) = (self.clone(), plan.producer, plan.set);
        match cpu(move || Dest::private(c.set(p, s))).await {
            Ok(d) => Some(d),
            Err(e) => {
                self.ledger.anomaly(format!("cannot allocate a destination: {e}"));
                self.ledger.outcome(Outcome::Failed);
                None
            }
        }
    }

    async fn slot(self: &Arc<Self>, plan: &Plan) -> Option<Dest> {
        let set = self.set(plan.producer, plan.set);
        match self.slots.acquire(set, Instant::now() + SLOT_WAIT).await {
            Some(dest) => {
                let (dest, bad) = cpu(move || {
                    let bad = dest.scrub();
                    (dest, bad)
                })
                .await;
                let msg = format!(
                    "slot taken by transfer {} was written after it was handed back",
                    plan.index
                );
                self.ledger.corrupted(bad, &msg);
                Some(dest)
            }
            None => {
                self.ledger.anomaly(format!(
                    "transfer {}: no destination slot came back within {SLOT_WAIT:?} (drains stuck?)",
                    plan.index
                ));
                self.ledger.outcome(Outcome::Failed);
                None
            }
        }
    }
}

/// Runs byte-crunching work (pattern checks, poisoning, allocating destinations) on a
/// blocking thread, so that the runtime's workers stay free to fire timers on time.
async fn cpu<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f)
        .await
        .expect("a verification step panicked")
}

/// Runs transfer `plan`.
pub async fn run(ctx: Arc<Ctx>, plan: Plan) {
    ctx.ledger.started();
    if let Some((fraction, hold)) = plan.hog {
        let c = ctx.clone();
        ctx.keep(tokio::spawn(async move { hog(&c, fraction, hold).await }));
    }
    match plan.kind {
        Kind::Get | Kind::GetShort => get(&ctx, &plan).await,
        Kind::GetDrop => get_drop(&ctx, &plan).await,
        Kind::Blocking | Kind::BlockingShort => blocking(&ctx, &plan).await,
        Kind::Pull(mode) => pull(&ctx, &plan, mode).await,
        Kind::Offload(p) => ctx.sim.offload(&ctx.ledger, plan.index, p).await,
        Kind::DeviceTransfer(p) => ctx.link.transfer(&ctx.ledger, p).await,
    }
}

fn note_short(ctx: &Ctx, plan: &Plan) {
    if plan.deadline < GENEROUS {
        ctx.ledger.fault("short_deadlines", 1);
    }
}

async fn get(ctx: &Arc<Ctx>, plan: &Plan) {
    let Some(dest) = ctx.slot(plan).await else { return };
    let set = ctx.set(plan.producer, plan.set);
    note_short(ctx, plan);
    let started = Instant::now();
    let deadline = started + plan.deadline;
    let r = ctx
        .consumer
        .get(&ctx.addrs[plan.producer], &set.keys(), dest.destination(set), deadline)
        .await;
    if plan.deadline == GENEROUS && ctx.sabotage(Sabotage::Late) {
        tokio::time::sleep_until(deadline + Duration::from_millis(80)).await;
    }
    let returned = Instant::now();
    ctx.ledger.returned("get", deadline, returned);
    ctx.after_kill(plan, started, returned, &r);
    ctx.settle(r, dest, plan, "get").await;
}

async fn get_drop(ctx: &Arc<Ctx>, plan: &Plan) {
    let set = ctx.set(plan.producer, plan.set);
    let Some(dest) = ctx.private(plan).await else { return };
    let deadline = Instant::now() + plan.deadline;
    let drop_at = Instant::now() + plan.drop_after;
    let keys = set.keys();
    let fut = ctx
        .consumer
        .get(&ctx.addrs[plan.producer], &keys, dest.destination(set), deadline);
    dropped_or_settled(ctx, plan, dest, drop_at, deadline, fut, "get-drop").await;
}

/// Awaits `fut` until `drop_at`; then drops it (the caller gives up) and leaves the
/// destination to the limbo check.
async fn dropped_or_settled(
    ctx: &Arc<Ctx>,
    plan: &Plan,
    dest: Dest,
    drop_at: Instant,
    deadline: Instant,
    fut: impl std::future::Future<Output = Result<Landed, GetFailure>>,
    what: &'static str,
) {
    let r = tokio::time::timeout_at(drop_at, fut).await;
    let now = Instant::now();
    match r {
        Ok(r) => {
            ctx.ledger.returned(what, deadline, now);
            ctx.settle(r, dest, plan, what).await;
        }
        Err(_) => {
            // The future was dropped inside the timeout: a blocking drop shows here.
            ctx.ledger.returned(what, drop_at, now);
            ctx.ledger.fault("caller_drops", 1);
            ctx.ledger.outcome(Outcome::Cancelled);
            ctx.limbo.lock().unwrap().push(Limbo {
                dest,
                producer: plan.producer,
                set: plan.set,
            });
        }
    }
}

async fn blocking(ctx: &Arc<Ctx>, plan: &Plan) {
    let Some(dest) = ctx.slot(plan).await else { return };
    let set = ctx.set(plan.producer, plan.set);
    note_short(ctx, plan);
    let consumer = ctx.consumer.clone();
    let (addr, keys, dst, timeout) = (
        ctx.addrs[plan.producer].clone(),
        set.keys(),
        dest.destination(set),
        plan.deadline,
    );
    let started = Instant::now();
    let out = ctx
        .blocking
        .run(move || {
            let t = std::time::Instant::now();
            let r = consumer.get_blocking(&addr, &keys, dst, timeout);
            (r, t.elapsed().saturating_sub(timeout))
        })
        .await;
    match out {
        Some((r, over)) => {
            ctx.ledger.overrun("get_blocking", over);
            ctx.after_kill(plan, started, Instant::now(), &r);
            ctx.settle(r, dest, plan, "blocking").await;
        }
        None => {
            ctx.ledger
                .anomaly(format!("transfer {}: get_blocking panicked", plan.index));
            ctx.ledger.outcome(Outcome::Failed);
        }
    }
}

async fn pull(ctx: &Arc<Ctx>, plan: &Plan, mode: PullMode) {
    let set = ctx.set(plan.producer, plan.set);
    let addr = &ctx.addrs[plan.producer];
    let deadline = Instant::now() + GENEROUS;
    let staged = ctx.consumer.stage(addr, &set.keys(), deadline).await;
    ctx.ledger.returned("stage", deadline, Instant::now());
    let handle = match staged {
        Ok(h) => h,
        Err(e) => {
            ctx.ledger.error(&e);
            return;
        }
    };
    match mode {
        PullMode::Release => {
            let deadline = Instant::now() + GENEROUS;
            let r = ctx.consumer.release(&handle, deadline).await;
            ctx.ledger.returned("release", deadline, Instant::now());
            match r {
                Ok(()) => ctx.ledger.outcome(Outcome::Completed),
                Err(e) => {
                    ctx.ledger.error(&e);
                }
            }
        }
        PullMode::Abandon => {
            ctx.ledger.fault("abandoned_leases", 1);
            ctx.ledger.outcome(Outcome::Cancelled);
        }
        PullMode::Resolve | PullMode::ResolveShort => {
            let Some(dest) = ctx.slot(plan).await else { return };
            note_short(ctx, plan);
            let started = Instant::now();
            let deadline = started + plan.deadline;
            let r = ctx.consumer.resolve(handle, dest.destination(set), deadline).await;
            let returned = Instant::now();
            ctx.ledger.returned("resolve", deadline, returned);
            ctx.after_kill(plan, started, returned, &r);
            ctx.settle(r, dest, plan, "pull").await;
        }
        PullMode::ResolveDrop => {
            let Some(dest) = ctx.private(plan).await else { return };
            let deadline = Instant::now() + plan.deadline;
            let drop_at = Instant::now() + plan.drop_after;
            let fut = ctx.consumer.resolve(handle, dest.destination(set), deadline);
            dropped_or_settled(ctx, plan, dest, drop_at, deadline, fut, "pull-drop").await;
        }
    }
}
