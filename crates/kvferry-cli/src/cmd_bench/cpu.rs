//! CPU accounting for the benchmark's phases, and the contention mode.
//!
//! [`CpuClock`] reads the process's CPU time (user + system, every thread, from
//! `getrusage(RUSAGE_SELF)`) minus what the contention threads of [`Contention`] used
//! (each thread publishes its own `CLOCK_THREAD_CPUTIME_ID` as it runs), so a phase's
//! CPU seconds are exactly what the benchmark itself spent between two readings, with or
//! without busy threads beside it.
//!
//! [`CpuClock::usage`] also reads the benchmark's context switches (from the same
//! `getrusage`, less the contention threads' own `RUSAGE_THREAD` counts): a
//! *voluntary* switch is a thread that blocked and had to be woken again — a wake-up,
//! the cost of every hand-off between threads that finds the other one asleep — and
//! an *involuntary* one a thread preempted. Per chunk, they count the wake-ups and
//! hand-offs a transfer costs.
//!
//! [`Contention`] starts `N` busy threads that stand for the rest of an inference host
//! (tokenizers, the HTTP front end, the engine's own threads): each computes crc32c
//! over its own 256 KiB buffer in a loop (memory and ALU, never sleeping, never touching
//! the benchmark's data), and stops when the `Contention` is dropped, which joins them.
//!
//! # Cancellation
//! Nothing here is async. Dropping a [`Contention`] stops and joins its threads (each
//! checks its stop flag after every 256 KiB).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// `getrusage(who)`, zeroed on failure.
fn rusage(who: libc::c_int) -> libc::rusage {
    // SAFETY: getrusage(2) writes the struct we pass; zeroed is a valid initial value.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF / RUSAGE_THREAD with a valid pointer to a rusage has no
    // other precondition.
    if unsafe { libc::getrusage(who, &mut u) } != 0 {
        // SAFETY: as above, all-zero is a valid rusage.
        return unsafe { std::mem::zeroed() };
    }
    u
}

/// CPU seconds the whole process used so far (user + system, all threads).
#[cfg(test)]
fn process_cpu_s() -> f64 {
    let u = rusage(libc::RUSAGE_SELF);
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(u.ru_utime) + tv(u.ru_stime)
}

/// What the benchmark used so far: CPU seconds and context switches.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Usage {
    /// CPU seconds, user + system.
    pub cpu_s: f64,
    /// Voluntary context switches (a thread blocked, then was woken).
    pub wakeups: u64,
    /// Involuntary context switches (a thread preempted).
    pub preemptions: u64,
}

impl std::ops::Sub for Usage {
    type Output = Usage;
    fn sub(self, o: Usage) -> Usage {
        Usage {
            cpu_s: self.cpu_s - o.cpu_s,
            wakeups: self.wakeups.saturating_sub(o.wakeups),
            preemptions: self.preemptions.saturating_sub(o.preemptions),
        }
    }
}

impl std::ops::AddAssign for Usage {
    fn add_assign(&mut self, o: Usage) {
        self.cpu_s += o.cpu_s;
        self.wakeups += o.wakeups;
        self.preemptions += o.preemptions;
    }
}

/// CPU time of the calling thread, nanoseconds.
fn thread_cpu_ns() -> u64 {
    // SAFETY: zeroed timespec is valid; clock_gettime writes it.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: CLOCK_THREAD_CPUTIME_ID with a valid pointer has no other precondition.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Reads the benchmark's own CPU time: the process's, less the contention threads',
/// plus a producer child's (see [`CpuClock::with_child`]).
#[derive(Clone, Default)]
pub struct CpuClock {
    contention: Option<Arc<Used>>,
    /// The producer process, when the producers run in one: its threads are the
    /// benchmark's too.
    child: Option<u32>,
}

/// CPU seconds and context switches of every live thread of process `pid`, from
/// `/proc/PID/task/*/schedstat` (nanoseconds on CPU) and `.../status`; zero where they
/// cannot be read.
fn process_usage(pid: u32) -> Usage {
    let mut u = Usage::default();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return u;
    };
    for t in tasks.flatten() {
        let dir = t.path();
        if let Some(ns) = std::fs::read_to_string(dir.join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse::<u64>().ok()))
        {
            u.cpu_s += ns as f64 / 1e9;
        }
        if let Ok(status) = std::fs::read_to_string(dir.join("status")) {
            for line in status.lines() {
                let num = |l: &str| {
                    l.split_whitespace()
                        .nth(1)
                        .and_then(|v| v.parse::<u64>().ok())
                        .unwrap_or(0)
                };
                if line.starts_with("voluntary_ctxt_switches:") {
                    u.wakeups += num(line);
                } else if line.starts_with("nonvoluntary_ctxt_switches:") {
                    u.preemptions += num(line);
                }
            }
        }
    }
    u
}

/// What the contention threads used, as they publish it.
#[derive(Default)]
struct Used {
    ns: AtomicU64,
    wakeups: AtomicU64,
    preemptions: AtomicU64,
}

impl CpuClock {
    /// CPU seconds and context switches of the benchmark (not the contention
    /// threads) so far.
    pub fn usage(&self) -> Usage {
        let u = rusage(libc::RUSAGE_SELF);
        let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
        let (ns, w, p) = self.contention.as_ref().map_or((0, 0, 0), |c| {
            (
                c.ns.load(Ordering::Acquire),
                c.wakeups.load(Ordering::Acquire),
                c.preemptions.load(Ordering::Acquire),
            )
        });
        let own = Usage {
            cpu_s: tv(u.ru_utime) + tv(u.ru_stime) - ns as f64 / 1e9,
            wakeups: (u.ru_nvcsw as u64).saturating_sub(w),
            preemptions: (u.ru_nivcsw as u64).saturating_sub(p),
        };
        match self.child {
            Some(pid) => {
                let c = process_usage(pid);
                Usage {
                    cpu_s: own.cpu_s + c.cpu_s,
                    wakeups: own.wakeups + c.wakeups,
                    preemptions: own.preemptions + c.preemptions,
                }
            }
            None => own,
        }
    }

    /// The same clock, also counting every thread of process `pid` (the producer
    /// process: what the producers spend is part of a transfer's cost).
    pub fn with_child(&self, pid: u32) -> CpuClock {
        CpuClock {
            contention: self.contention.clone(),
            child: Some(pid),
        }
    }
}

/// `N` busy threads beside the benchmark (see the module docs); stopped and joined on
/// drop.
pub struct Contention {
    stop: Arc<AtomicBool>,
    used: Arc<Used>,
    threads: Vec<JoinHandle<()>>,
}

impl Contention {
    /// Starts `n` busy threads (none for 0).
    pub fn start(n: usize) -> Contention {
        let stop = Arc::new(AtomicBool::new(false));
        let used_all = Arc::new(Used::default());
        let threads = (0..n)
            .map(|i| {
                let (stop, used) = (stop.clone(), used_all.clone());
                std::thread::Builder::new()
                    .name(format!("bench-contend-{i}"))
                    .spawn(move || {
                        let buf: Vec<u8> = (0..256 << 10).map(|j| (j * 7 + i) as u8).collect();
                        let mut seen = thread_cpu_ns();
                        let (mut seen_w, mut seen_p) = (0u64, 0u64);
                        let mut acc = 0u32;
                        while !stop.load(Ordering::Relaxed) {
                            acc ^= kvferry::checksum::checksum(&buf);
                            let now = thread_cpu_ns();
                            used.ns.fetch_add(now.saturating_sub(seen), Ordering::AcqRel);
                            seen = now;
                            let r = rusage(libc::RUSAGE_THREAD);
                            let (w, p) = (r.ru_nvcsw as u64, r.ru_nivcsw as u64);
                            used.wakeups.fetch_add(w.saturating_sub(seen_w), Ordering::AcqRel);
                            used.preemptions.fetch_add(p.saturating_sub(seen_p), Ordering::AcqRel);
                            (seen_w, seen_p) = (w, p);
                        }
                        std::hint::black_box(acc);
                    })
                    .expect("spawn a contention thread")
            })
            .collect();
        Contention {
            stop,
            used: used_all,
            threads,
        }
    }

    /// The clock that leaves these threads' CPU out.
    pub fn clock(&self) -> CpuClock {
        CpuClock {
            contention: Some(self.used.clone()),
            child: None,
        }
    }

    /// Busy threads running.
    pub fn threads(&self) -> usize {
        self.threads.len()
    }
}

impl Drop for Contention {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Profiling one phase with `perf`: with `KVFERRY_PERF_CTL` naming perf's control
/// FIFO (`perf record --control fifo:PATH -D -1 ...`, which starts with counting
/// off), the benchmark writes `enable` to it when the phase named by
/// `KVFERRY_PERF_PHASE` (`transfer`, the default, or `tcp`: the raw-TCP limit of the
/// same bytes) starts and `disable` when it ends, so the profile holds that phase
/// alone. Without the variable nothing happens. docs/benchmarks.md shows the commands.
pub fn perf_phase(phase: &str, on: bool) {
    let Some(ctl) = std::env::var_os("KVFERRY_PERF_CTL") else {
        return;
    };
    let want = std::env::var("KVFERRY_PERF_PHASE").unwrap_or_else(|_| "transfer".into());
    if want != phase {
        return;
    }
    let cmd: &[u8] = if on { b"enable\n" } else { b"disable\n" };
    if let Err(e) = std::fs::OpenOptions::new()
        .write(true)
        .open(&ctl)
        .and_then(|mut f| std::io::Write::write_all(&mut f, cmd))
    {
        eprintln!("KVFERRY_PERF_CTL {}: {e}", std::path::Path::new(&ctl).display());
    }
}

/// `n` per chunk (0 when there were none).
pub fn per_chunk(n: u64, chunks: u64) -> f64 {
    if chunks == 0 {
        0.0
    } else {
        n as f64 / chunks as f64
    }
}

/// CPU seconds per GB moved (0 when nothing moved).
pub fn per_gb(cpu_s: f64, bytes: u64) -> f64 {
    if bytes == 0 {
        0.0
    } else {
        cpu_s / (bytes as f64 / 1e9)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contention_threads_are_left_out_of_the_benchmarks_cpu() {
        let c = Contention::start(1);
        let clock = c.clock();
        let (t0, p0) = (clock.usage().cpu_s, process_cpu_s());
        let wall = std::time::Instant::now();
        while wall.elapsed() < std::time::Duration::from_millis(300) {
            std::thread::sleep(std::time::Duration::from_millis(10)); // the benchmark idles
        }
        let (own, all) = (clock.usage().cpu_s - t0, process_cpu_s() - p0);
        drop(c);
        assert!(all > 0.03, "the busy thread ran: {all}");
        assert!(own < all / 2.0, "its CPU is subtracted: own {own}, process {all}");
    }

    #[test]
    fn a_child_process_cpu_is_counted() {
        let me = process_usage(std::process::id());
        assert!(me.cpu_s > 0.0, "this process ran: {me:?}");
        assert_eq!(process_usage(u32::MAX), Usage::default(), "no such process: zero");
    }

    #[test]
    fn usage_counts_this_threads_wakeups() {
        let clock = CpuClock::default();
        let u0 = clock.usage();
        for _ in 0..20 {
            std::thread::sleep(std::time::Duration::from_millis(1)); // blocks: one wake-up each
        }
        let d = clock.usage() - u0;
        assert!(d.wakeups >= 20, "20 sleeps are at least 20 wake-ups: {d:?}");
        assert!(d.cpu_s >= 0.0);
    }
}
