//! Device offloads on the `sim` backend: D2H copies from a patterned device buffer into
//! staging pages, under a bounded wait, with never-completing events and failing copies
//! injected at random. A copy whose event never completes times out at its deadline and
//! its pages are quarantined; every so often the device completes its stuck work late
//! (`release_stuck`), which must release those pages. What is still stuck at the end
//! stays quarantined and is reported, not counted as leaked.

use std::sync::Arc;
use std::time::Duration;

use kvferry::device::{Device, DeviceBuffer, DeviceError, Fault, FaultRule, SimConfig, SimDevice, Trigger};
use kvferry::mem::{Arena, ArenaConfig};
use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};
use tokio::time::Instant;

use super::ledger::{ArenaReport, Ledger, Outcome};

/// Bytes in the device buffer offloads read from.
const BUFFER_BYTES: usize = 64 << 10;
/// Staging pages for offloads.
const PAGES: usize = 256;
const PAGE: usize = 4096;

/// One offload's fault plan.
#[derive(Clone, Copy, Debug)]
pub struct OffloadPlan {
    /// Pages of the lease (1–4).
    pub pages: usize,
    /// Where in the device buffer.
    pub offset: usize,
    /// Bytes copied.
    pub len: usize,
    /// The bounded wait.
    pub timeout: Duration,
    /// Inject a never-completing event.
    pub never_complete: bool,
    /// Inject a failing copy.
    pub fail_copy: bool,
    /// Let the device complete its stuck work first (late completion).
    pub release_stuck: bool,
}

/// The sim device, its buffer and the staging arena offloads land in.
pub struct SimRig {
    dev: Arc<SimDevice>,
    buf: DeviceBuffer,
    pattern: Vec<u8>,
    arena: Arena,
}

impl SimRig {
    /// A sim device (100 µs latency, 2 GB/s) on the current runtime.
    pub fn new(seed: u64) -> anyhow::Result<SimRig> {
        let dev = SimDevice::new(
            SimConfig::new(0)
                .with_latency(Duration::from_micros(100))
                .with_bandwidth(2_000_000_000),
        )?;
        let buf = dev.alloc(BUFFER_BYTES)?;
        let mut pattern = vec![0u8; BUFFER_BYTES];
        StdRng::seed_from_u64(seed).fill_bytes(&mut pattern);
        buf.write(0, &pattern)?;
        let arena = Arena::new(ArenaConfig::new(PAGE, PAGES).unpinned())?;
        Ok(SimRig {
            dev,
            buf,
            pattern,
            arena,
        })
    }

    /// Draws an offload plan.
    pub fn plan(rng: &mut StdRng, rate: f64) -> OffloadPlan {
        use rand::Rng;
        let pages = rng.gen_range(1..=4);
        let len = rng.gen_range(1..=pages * PAGE);
        let never_complete = rng.gen_bool((0.12 * rate).min(1.0));
        // A stuck event is waited for 10-40 ms; a healthy copy gets a generous bound,
        // or (a fault) one shorter than the copy itself.
        let timeout = if never_complete {
            Duration::from_millis(rng.gen_range(10..=40))
        } else if rng.gen_bool((0.1 * rate).min(1.0)) {
            Duration::from_micros(rng.gen_range(20..=150))
        } else {
            Duration::from_secs(2)
        };
        OffloadPlan {
            pages,
            offset: rng.gen_range(0..=BUFFER_BYTES - len),
            len,
            timeout,
            never_complete,
            fail_copy: rng.gen_bool((0.05 * rate).min(1.0)),
            release_stuck: rng.gen_bool(0.08),
        }
    }

    /// Runs one offload and books it.
    pub async fn offload(&self, ledger: &Ledger, index: u64, p: OffloadPlan) {
        if p.release_stuck {
            self.dev.release_stuck();
        }
        let lease = match self.arena.try_alloc(p.pages) {
            Ok(l) => l,
            Err(e) => {
                ledger.error_class("device_staging_exhausted", &e.to_string());
                ledger.outcome(Outcome::Failed);
                return;
            }
        };
        let stream = match self.dev.create_stream("chaos-offload") {
            Ok(s) => s,
            Err(e) => {
                ledger.anomaly(format!("cannot create a sim stream: {e}"));
                ledger.outcome(Outcome::Failed);
                return;
            }
        };
        let fault = if p.never_complete {
            Some((Fault::NeverComplete, "device_never_complete"))
        } else if p.fail_copy {
            Some((Fault::FailCopy, "device_copy_failures"))
        } else {
            None
        };
        if let Some((fault, name)) = fault {
            // One-shot: it hits the next copy this device submits (this one, or a
            // concurrent offload's — the count is the same).
            if self
                .dev
                .inject(FaultRule {
                    fault,
                    trigger: Trigger::Next,
                })
                .is_ok()
            {
                ledger.fault(name, 1);
            }
        }
        if !p.never_complete && p.timeout < Duration::from_millis(1) {
            ledger.fault("short_deadlines", 1);
        }
        let op = format!("chaos offload {index}");
        let pending = match stream.copy_d2h(&self.buf, p.offset, lease, 0, p.len, &op) {
            Ok(pc) => pc,
            Err(e) => {
                ledger.anomaly(format!("sim copy submission failed: {e}"));
                ledger.outcome(Outcome::Failed);
                return;
            }
        };
        let deadline = Instant::now() + p.timeout;
        let r = pending.wait(deadline).await;
        ledger.returned("device wait", deadline, Instant::now());
        match r {
            Ok(lease) => {
                let got = lease.to_vec(0, p.len).unwrap_or_default();
                let want = &self.pattern[p.offset..p.offset + p.len];
                let bad = got.iter().zip(want).filter(|(a, b)| a != b).count() + want.len().saturating_sub(got.len());
                ledger.verified(p.len, bad);
                if bad > 0 {
                    ledger.anomaly(format!("{op}: {bad} bytes differ from the device buffer"));
                }
                ledger.outcome(Outcome::Completed);
            }
            Err(e @ DeviceError::Timeout { .. }) => {
                ledger.error_class("device_timeout", &e.to_string());
                ledger.outcome(Outcome::TimedOut);
            }
            Err(e @ DeviceError::CopyFailed { .. }) => {
                ledger.error_class("device_copy_failed", &e.to_string());
                ledger.outcome(Outcome::Failed);
            }
            Err(e) => {
                ledger.error_class("device_other", &e.to_string());
                ledger.outcome(Outcome::Failed);
            }
        }
    }

    /// The staging arena's accounting (leased pages count as leaked: every offload is
    /// over by now).
    pub fn report(&self) -> ArenaReport {
        let s = self.arena.stats();
        ArenaReport {
            name: "sim-offload".into(),
            total_pages: s.total_pages as u64,
            free_pages: s.free_pages as u64,
            quarantined_pages: s.quarantined_pages as u64,
            leaked_pages: (s.total_pages - s.free_pages - s.quarantined_pages) as u64,
        }
    }
}
