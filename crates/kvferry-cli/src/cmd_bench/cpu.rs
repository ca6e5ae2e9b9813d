//! CPU accounting for the benchmark's phases, and the contention mode.
//!
//! [`CpuClock`] reads the process's CPU time (user + system, every thread, from
//! `getrusage(RUSAGE_SELF)`) minus what the contention threads of [`Contention`] used
//! (each thread publishes its own `CLOCK_THREAD_CPUTIME_ID` as it runs), so a phase's
//! CPU seconds are exactly what the benchmark itself spent between two readings, with or
//! without busy threads beside it.
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

/// CPU seconds the whole process used so far (user + system, all threads).
fn process_cpu_s() -> f64 {
    // SAFETY: getrusage(2) writes the struct we pass; zeroed is a valid initial value.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a valid pointer to a rusage has no other precondition.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return 0.0;
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(u.ru_utime) + tv(u.ru_stime)
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

/// Reads the benchmark's own CPU time: the process's, less the contention threads'.
#[derive(Clone, Default)]
pub struct CpuClock {
    contention_ns: Option<Arc<AtomicU64>>,
}

impl CpuClock {
    /// CPU seconds the benchmark (not the contention threads) used so far.
    pub fn now(&self) -> f64 {
        let busy = self.contention_ns.as_ref().map_or(0, |n| n.load(Ordering::Acquire)) as f64 / 1e9;
        process_cpu_s() - busy
    }
}

/// `N` busy threads beside the benchmark (see the module docs); stopped and joined on
/// drop.
pub struct Contention {
    stop: Arc<AtomicBool>,
    used_ns: Arc<AtomicU64>,
    threads: Vec<JoinHandle<()>>,
}

impl Contention {
    /// Starts `n` busy threads (none for 0).
    pub fn start(n: usize) -> Contention {
        let stop = Arc::new(AtomicBool::new(false));
        let used_ns = Arc::new(AtomicU64::new(0));
        let threads = (0..n)
            .map(|i| {
                let (stop, used) = (stop.clone(), used_ns.clone());
                std::thread::Builder::new()
                    .name(format!("bench-contend-{i}"))
                    .spawn(move || {
                        let buf: Vec<u8> = (0..256 << 10).map(|j| (j * 7 + i) as u8).collect();
                        let mut seen = thread_cpu_ns();
                        let mut acc = 0u32;
                        while !stop.load(Ordering::Relaxed) {
                            acc ^= kvferry::checksum::checksum(&buf);
                            let now = thread_cpu_ns();
                            used.fetch_add(now.saturating_sub(seen), Ordering::AcqRel);
                            seen = now;
                        }
                        std::hint::black_box(acc);
                    })
                    .expect("spawn a contention thread")
            })
            .collect();
        Contention { stop, used_ns, threads }
    }

    /// The clock that leaves these threads' CPU out.
    pub fn clock(&self) -> CpuClock {
        CpuClock {
            contention_ns: Some(self.used_ns.clone()),
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
        let (t0, p0) = (clock.now(), process_cpu_s());
        let wall = std::time::Instant::now();
        while wall.elapsed() < std::time::Duration::from_millis(300) {
            std::thread::sleep(std::time::Duration::from_millis(10)); // the benchmark idles
        }
        let (own, all) = (clock.now() - t0, process_cpu_s() - p0);
        drop(c);
        assert!(all > 0.03, "the busy thread ran: {all}");
        assert!(own < all / 2.0, "its CPU is subtracted: own {own}, process {all}");
    }
}
