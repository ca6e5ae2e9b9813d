//! The ledger: what happened to every transfer, every fault injected, every deadline,
//! every landed byte and every page, printed at the end as text or one JSON object.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use kvferry::peer::PeerError;
use serde::Serialize;
use tokio::time::Instant;

/// A call returning more than this past its deadline is a late return.
pub const LATE_BOUND: Duration = Duration::from_millis(50);

/// How a transfer ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// It landed (a miss or a partial hit counts: what was landed is verified).
    Completed,
    /// The caller dropped it, abandoned it, or it reported `Cancelled`.
    Cancelled,
    /// It returned `Timeout`.
    TimedOut,
    /// Any other typed error.
    Failed,
}

/// Running counters. Everything is additive, so tasks update it concurrently.
#[derive(Default)]
pub struct Ledger {
    transfers: AtomicU64,
    completed: AtomicU64,
    cancelled: AtomicU64,
    timed_out: AtomicU64,
    failed: AtomicU64,
    misses: AtomicU64,
    partial_hits: AtomicU64,
    corrupted_bytes: AtomicU64,
    verified_bytes: AtomicU64,
    timed_calls: AtomicU64,
    late_returns: AtomicU64,
    max_overrun_us: AtomicU64,
    max_overrun_call: Mutex<String>,
    drains: AtomicU64,
    max_drain_us: AtomicU64,
    stuck_drains: AtomicU64,
    killed_in_flight: AtomicU64,
    max_kill_to_error_us: AtomicU64,
    /// Worst lateness of a 2 ms timer on the runtime (µs).
    pub canary_runtime_us: AtomicU64,
    /// Worst lateness of a 2 ms sleep on a plain thread (µs).
    pub canary_thread_us: AtomicU64,
    faults: Mutex<BTreeMap<String, u64>>,
    errors: Mutex<BTreeMap<String, u64>>,
    error_examples: Mutex<BTreeMap<String, String>>,
    anomalies: Mutex<Vec<String>>,
    anomaly_count: AtomicU64,
}

fn bump(m: &Mutex<BTreeMap<String, u64>>, key: &str, n: u64) {
    *m.lock().unwrap().entry(key.to_string()).or_default() += n;
}

impl Ledger {
    /// A transfer was started.
    pub fn started(&self) {
        self.transfers.fetch_add(1, Ordering::Relaxed);
    }

    /// A transfer ended with `outcome`.
    pub fn outcome(&self, outcome: Outcome) {
        let c = match outcome {
            Outcome::Completed => &self.completed,
            Outcome::Cancelled => &self.cancelled,
            Outcome::TimedOut => &self.timed_out,
            Outcome::Failed => &self.failed,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// A transfer ended with `error`: counts its class and keeps one example message.
    pub fn error(&self, error: &PeerError) -> Outcome {
        let (class, outcome) = classify(error);
        self.error_class(&class, &error.to_string());
        self.outcome(outcome);
        outcome
    }

    /// Counts an error class (with an example message).
    pub fn error_class(&self, class: &str, message: &str) {
        bump(&self.errors, class, 1);
        self.error_examples
            .lock()
            .unwrap()
            .entry(class.to_string())
            .or_insert_with(|| message.to_string());
    }

    /// A completed transfer landed nothing (miss) or part of what was asked.
    pub fn hit(&self, landed: usize, asked: usize) {
        if landed == 0 {
            self.misses.fetch_add(1, Ordering::Relaxed);
        } else if landed < asked {
            self.partial_hits.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// `n` faults of `kind` were injected.
    pub fn fault(&self, kind: &str, n: u64) {
        if n > 0 {
            bump(&self.faults, kind, n);
        }
    }

    /// Bytes checked and bytes found wrong.
    pub fn verified(&self, checked: usize, bad: usize) {
        self.verified_bytes.fetch_add(checked as u64, Ordering::Relaxed);
        self.corrupted(bad, "");
    }

    /// `bad` corrupted bytes, noted as an anomaly with `what` when non-zero.
    pub fn corrupted(&self, bad: usize, what: &str) {
        if bad > 0 {
            self.corrupted_bytes.fetch_add(bad as u64, Ordering::Relaxed);
            if !what.is_empty() {
                self.anomaly(format!("{bad} corrupted bytes: {what}"));
            }
        }
    }

    /// A call with `deadline` returned at `at`.
    pub fn returned(&self, what: &str, deadline: Instant, at: Instant) {
        self.overrun(what, at.saturating_duration_since(deadline));
    }

    /// A call returned `over` past its deadline.
    pub fn overrun(&self, what: &str, over: Duration) {
        self.timed_calls.fetch_add(1, Ordering::Relaxed);
        let us = over.as_micros() as u64;
        if self.max_overrun_us.fetch_max(us, Ordering::Relaxed) < us {
            *self.max_overrun_call.lock().unwrap() = what.to_string();
        }
        if over > LATE_BOUND {
            self.late_returns.fetch_add(1, Ordering::Relaxed);
            self.anomaly(format!("{what} returned {:.1} ms past its deadline", us as f64 / 1e3));
        }
    }

    /// A failure's drain took `took` (or did not finish: `None`).
    pub fn drain(&self, took: Option<Duration>) {
        match took {
            Some(d) => {
                self.drains.fetch_add(1, Ordering::Relaxed);
                self.max_drain_us.fetch_max(d.as_micros() as u64, Ordering::Relaxed);
            }
            None => {
                self.stuck_drains.fetch_add(1, Ordering::Relaxed);
                self.anomaly("a failed transfer's drain fence did not fire within 10 s".into());
            }
        }
    }

    /// A transfer in flight when its producer was killed failed `after` the kill.
    pub fn killed_in_flight(&self, after: Duration) {
        self.killed_in_flight.fetch_add(1, Ordering::Relaxed);
        self.max_kill_to_error_us
            .fetch_max(after.as_micros() as u64, Ordering::Relaxed);
    }

    /// Something that must not happen (kept: the first 20 messages).
    pub fn anomaly(&self, message: String) {
        self.anomaly_count.fetch_add(1, Ordering::Relaxed);
        let mut a = self.anomalies.lock().unwrap();
        if a.len() < 20 {
            a.push(message);
        }
    }

    /// Counts of transfers so far: (started, finished).
    pub fn progress(&self) -> (u64, u64) {
        let done = [&self.completed, &self.cancelled, &self.timed_out, &self.failed]
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum();
        (self.transfers.load(Ordering::Relaxed), done)
    }

    /// The final summary.
    pub fn summary(&self, end: EndState) -> Summary {
        let ld = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let faults = self.faults.lock().unwrap().clone();
        let faults_injected = faults.values().sum();
        let corrupted_bytes = ld(&self.corrupted_bytes);
        let late_returns = ld(&self.late_returns);
        let leaked_pages = end.arenas.iter().map(|a| a.leaked_pages).sum();
        let quarantined_pages = end.arenas.iter().map(|a| a.quarantined_pages).sum();
        let anomalies = ld(&self.anomaly_count);
        let ok = corrupted_bytes == 0 && leaked_pages == 0 && late_returns == 0 && anomalies == 0;
        Summary {
            ok,
            seed: end.seed,
            transfers: ld(&self.transfers),
            completed: ld(&self.completed),
            cancelled: ld(&self.cancelled),
            timed_out: ld(&self.timed_out),
            failed: ld(&self.failed),
            misses: ld(&self.misses),
            partial_hits: ld(&self.partial_hits),
            peer_kills: faults.get("peer_kills").copied().unwrap_or(0),
            faults_injected,
            faults,
            errors: self.errors.lock().unwrap().clone(),
            corrupted_bytes,
            verified_bytes: ld(&self.verified_bytes),
            leaked_pages,
            quarantined_pages,
            late_returns,
            max_overrun_ms: ld(&self.max_overrun_us) as f64 / 1e3,
            max_overrun_call: self.max_overrun_call.lock().unwrap().clone(),
            timed_calls: ld(&self.timed_calls),
            drains: ld(&self.drains),
            max_drain_ms: ld(&self.max_drain_us) as f64 / 1e3,
            stuck_drains: ld(&self.stuck_drains),
            killed_in_flight: ld(&self.killed_in_flight),
            max_kill_to_error_ms: ld(&self.max_kill_to_error_us) as f64 / 1e3,
            timer_lateness_ms: ld(&self.canary_runtime_us) as f64 / 1e3,
            thread_lateness_ms: ld(&self.canary_thread_us) as f64 / 1e3,
            anomalies,
            anomaly_examples: self.anomalies.lock().unwrap().clone(),
            error_examples: self.error_examples.lock().unwrap().clone(),
            arenas: end.arenas,
            producers: end.producers,
            fault_rate: end.fault_rate,
            concurrency: end.concurrency,
            wall_s: end.wall.as_secs_f64(),
            transport: end.transport,
            cma_transfers: end.cma_transfers,
            device_ipc_transfers: end.device_ipc_transfers,
        }
    }
}

/// The error class and outcome of a transfer error.
pub fn classify(e: &PeerError) -> (String, Outcome) {
    let (class, outcome) = match e {
        PeerError::Timeout { .. } => ("timeout", Outcome::TimedOut),
        PeerError::Cancelled => ("cancelled", Outcome::Cancelled),
        PeerError::PeerLost { .. } => ("peer_lost", Outcome::Failed),
        PeerError::PeerRestarted { .. } => ("peer_restarted", Outcome::Failed),
        PeerError::ChecksumMismatch { .. } => ("checksum_mismatch", Outcome::Failed),
        PeerError::Copy(kvferry::copy::CopyError::SliceFailed { .. }) => ("copy_slice_failed", Outcome::Failed),
        PeerError::Copy(_) => ("copy_other", Outcome::Failed),
        PeerError::StagingExhausted { .. } => ("staging_exhausted", Outcome::Failed),
        PeerError::StaleIncarnation { .. } => ("stale_incarnation", Outcome::Failed),
        PeerError::LeaseExpired { .. } => ("lease_expired", Outcome::Failed),
        PeerError::ShuttingDown => ("shutting_down", Outcome::Failed),
        PeerError::Remote { kind, .. } => {
            return (
                format!("remote_{}", format!("{kind:?}").to_lowercase()),
                Outcome::Failed,
            )
        }
        PeerError::Net(_) => ("net_other", Outcome::Failed),
        PeerError::Device { error, .. } => match error {
            kvferry::device::DeviceError::Timeout { .. } => ("device_timeout", Outcome::TimedOut),
            kvferry::device::DeviceError::CopyFailed { .. } => ("device_copy_failed", Outcome::Failed),
            _ => ("device_other", Outcome::Failed),
        },
        _ => ("other", Outcome::Failed),
    };
    (class.to_string(), outcome)
}

/// One arena's accounting after quiescing.
#[derive(Clone, Debug, Serialize)]
pub struct ArenaReport {
    /// Which arena.
    pub name: String,
    /// Pages in it.
    pub total_pages: u64,
    /// Pages on the free list.
    pub free_pages: u64,
    /// Pages withheld because a device may still target them (by design).
    pub quarantined_pages: u64,
    /// `total - free - quarantined`: pages that never came back.
    pub leaked_pages: u64,
}

/// What the run found at the end, besides the counters.
pub struct EndState {
    /// The seed.
    pub seed: u64,
    /// Per-arena accounting.
    pub arenas: Vec<ArenaReport>,
    /// Producer processes.
    pub producers: usize,
    /// The fault-rate scale.
    pub fault_rate: f64,
    /// Transfers in flight at once.
    pub concurrency: usize,
    /// Wall time.
    pub wall: Duration,
    /// The consumer's transport (`auto` or `tcp`).
    pub transport: String,
    /// Transfers whose bytes were read from a producer's memory (CMA).
    pub cma_transfers: u64,
    /// Device-link transfers copied device to device by device IPC.
    pub device_ipc_transfers: u64,
}

/// The printed ledger.
#[derive(Debug, Serialize)]
pub struct Summary {
    /// No corruption, leak, late return or anomaly.
    pub ok: bool,
    /// Seed of the fault schedule (`--seed` reproduces it).
    pub seed: u64,
    /// Transfers started.
    pub transfers: u64,
    /// Transfers that landed (including misses and partial hits).
    pub completed: u64,
    /// Transfers dropped or abandoned by their caller, or reported `Cancelled`.
    pub cancelled: u64,
    /// Transfers that returned `Timeout`.
    pub timed_out: u64,
    /// Transfers that returned another typed error.
    pub failed: u64,
    /// Completed transfers that landed nothing.
    pub misses: u64,
    /// Completed transfers that landed a prefix.
    pub partial_hits: u64,
    /// Producer processes SIGKILLed (and restarted).
    pub peer_kills: u64,
    /// All faults injected.
    pub faults_injected: u64,
    /// Faults injected, by kind.
    pub faults: BTreeMap<String, u64>,
    /// Transfer errors, by class.
    pub errors: BTreeMap<String, u64>,
    /// Landed bytes that were wrong.
    pub corrupted_bytes: u64,
    /// Bytes compared.
    pub verified_bytes: u64,
    /// Pages that never came back to their arena.
    pub leaked_pages: u64,
    /// Pages quarantined by design (a device may still target them), reported.
    pub quarantined_pages: u64,
    /// Calls that returned more than 50 ms past their deadline.
    pub late_returns: u64,
    /// The largest overrun of a deadline.
    pub max_overrun_ms: f64,
    /// The call that overran most.
    pub max_overrun_call: String,
    /// Calls with a deadline that were timed.
    pub timed_calls: u64,
    /// Failed transfers whose drain fence was awaited.
    pub drains: u64,
    /// The longest drain after a failure returned.
    pub max_drain_ms: f64,
    /// Drains that did not finish within 10 s.
    pub stuck_drains: u64,
    /// Transfers (with a generous deadline) in flight when their producer was killed,
    /// that failed.
    pub killed_in_flight: u64,
    /// The longest such a transfer took to fail after the kill.
    pub max_kill_to_error_ms: f64,
    /// Worst lateness of a 2 ms timer on the tool's runtime (what the machine and the
    /// tool's own load add to any deadline).
    pub timer_lateness_ms: f64,
    /// Worst lateness of a 2 ms sleep on a plain thread (the machine's share of it).
    pub thread_lateness_ms: f64,
    /// Things that must not happen (counted in `ok`).
    pub anomalies: u64,
    /// The first anomalies.
    pub anomaly_examples: Vec<String>,
    /// One message per error class.
    pub error_examples: BTreeMap<String, String>,
    /// Per-arena accounting.
    pub arenas: Vec<ArenaReport>,
    /// Producer processes.
    pub producers: usize,
    /// The fault-rate scale.
    pub fault_rate: f64,
    /// Transfers in flight at once.
    pub concurrency: usize,
    /// Wall time.
    pub wall_s: f64,
    /// The consumer's transport (`auto`: same-host reads; `tcp`: the socket).
    pub transport: String,
    /// Transfers whose bytes were read from a producer's memory (CMA).
    pub cma_transfers: u64,
    /// Device-link transfers copied device to device by device IPC.
    pub device_ipc_transfers: u64,
}

impl Summary {
    /// The human-readable ledger.
    pub fn text(&self) -> String {
        let list = |m: &BTreeMap<String, u64>| {
            if m.is_empty() {
                return "none".to_string();
            }
            m.iter().map(|(k, v)| format!("{k} {v}")).collect::<Vec<_>>().join(", ")
        };
        let mut s = String::new();
        s += &format!(
            "kvferry chaos: {} transfers in {:.1} s (seed {}, {} producers, {} in flight, fault rate {})\n",
            self.transfers, self.wall_s, self.seed, self.producers, self.concurrency, self.fault_rate
        );
        s += &format!(
            "  outcomes    completed {} (misses {}, partial {}), cancelled {}, timed out {}, failed {}\n",
            self.completed, self.misses, self.partial_hits, self.cancelled, self.timed_out, self.failed
        );
        s += &format!(
            "  mover       transport {}: {} transfers read from producer memory (cma), {} device copies by device IPC\n",
            self.transport, self.cma_transfers, self.device_ipc_transfers
        );
        s += &format!(
            "  faults      {} injected: {}\n",
            self.faults_injected,
            list(&self.faults)
        );
        s += &format!("  errors      {}\n", list(&self.errors));
        s += &format!(
            "  deadlines   {} timed calls, late returns {} (> 50 ms), max overrun {:.1} ms{}\n",
            self.timed_calls,
            self.late_returns,
            self.max_overrun_ms,
            if self.max_overrun_call.is_empty() {
                String::new()
            } else {
                format!(" ({})", self.max_overrun_call)
            }
        );
        s += &format!(
            "  scheduling  worst lateness of a 2 ms timer: {:.1} ms on the runtime, {:.1} ms on a thread\n",
            self.timer_lateness_ms, self.thread_lateness_ms
        );
        s += &format!(
            "  drains      {} awaited, max {:.1} ms, stuck {}\n",
            self.drains, self.max_drain_ms, self.stuck_drains
        );
        s += &format!(
            "  peer kills  {} transfers failed in flight, at most {:.1} ms after the SIGKILL\n",
            self.killed_in_flight, self.max_kill_to_error_ms
        );
        s += &format!(
            "  bytes       {} verified, {} corrupted\n",
            kvferry::mem::ByteSize(self.verified_bytes),
            self.corrupted_bytes
        );
        for a in &self.arenas {
            s += &format!(
                "  arena       {:<14} {:>5} pages: {:>5} free, {:>3} quarantined, {} leaked\n",
                a.name, a.total_pages, a.free_pages, a.quarantined_pages, a.leaked_pages
            );
        }
        s += &format!(
            "  totals      corrupted_bytes {}, leaked_pages {}, quarantined_pages {}, late_returns {}\n",
            self.corrupted_bytes, self.leaked_pages, self.quarantined_pages, self.late_returns
        );
        for a in &self.anomaly_examples {
            s += &format!("  ANOMALY     {a}\n");
        }
        s += &format!("  result      {}\n", if self.ok { "OK" } else { "FAILED" });
        s
    }
}
