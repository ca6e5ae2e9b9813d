//! The copy threads and their queue.
//!
//! `CopyEngine::copy` resolves the plan's segments into contiguous pieces, groups them
//! into slices of similar byte size (merging small segments so per-slice overhead
//! stays negligible, splitting large ones so every thread gets work), and queues one
//! task per slice. Each copy thread pops a task, asks the job's ledger whether it may
//! start, runs the [`CopyBody`] (a memcpy by default), and accounts the slice; the
//! thread accounting the last slice settles the job.
//!
//! # Shutdown
//!
//! [`CopyEngine::shutdown`] (or dropping the last handle) stops accepting copies, fails
//! queued slices with [`CopyError::ShutDown`], lets running slices finish and joins
//! every thread. Memory is never unmapped under a copy thread: jobs own their plans,
//! plans own their leases and regions, leases keep the arena mapped.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

use super::job::{CopyFailure, CopyJob, Job, Partial, Piece};
use super::plan::CopyPlan;
use super::CopyError;

/// The work of one slice, handed to a [`CopyBody`].
pub struct SliceWork<'a> {
    /// The job's id (unique per engine).
    pub job: u64,
    /// The slice's index within its job.
    pub index: usize,
    pieces: &'a [Piece],
    partials: Option<&'a Mutex<Vec<Partial>>>,
    first_piece: usize,
    remote_pid: Option<i32>,
    remote_error: &'a Mutex<Option<super::RemoteReadError>>,
}

impl SliceWork<'_> {
    /// Bytes in this slice.
    pub fn bytes(&self) -> usize {
        self.pieces.iter().map(|p| p.len).sum()
    }

    /// Contiguous pieces in this slice.
    pub fn piece_count(&self) -> usize {
        self.pieces.len()
    }

    /// Whether this slice reads another process's memory.
    pub fn is_remote(&self) -> bool {
        self.remote_pid.is_some()
    }

    /// Performs the slice's copies (and, if the plan asked for them, checksums each
    /// piece right after copying it, while it is in cache). A slice from another
    /// process reads with `process_vm_readv` (at most `IOV_MAX` pieces a call), then
    /// checksums what landed; a failed read is an `Err` (the job then fails with
    /// [`CopyError::RemoteRead`](super::CopyError::RemoteRead)).
    pub fn copy(&self) -> Result<(), String> {
        if let Some(pid) = self.remote_pid {
            // SAFETY: the destination pieces point into memory owned by the job's
            // plan, alive until this slice is accounted; validated plans never write
            // one byte twice, so nothing else touches them during the call.
            if let Err(e) = unsafe { super::remote::read_pieces(pid, self.pieces) } {
                let message = e.to_string();
                self.remote_error.lock().get_or_insert(e);
                return Err(message);
            }
        }
        let mut run: Option<Partial> = None;
        let mut out = Vec::new();
        for (i, p) in self.pieces.iter().enumerate() {
            if self.remote_pid.is_none() {
                // SAFETY: pieces point into memory owned by the job's plan, which the
                // engine keeps alive until this slice is accounted; plans are validated
                // so no two destination ranges (or a destination and a source in the
                // same memory) overlap.
                unsafe { std::ptr::copy_nonoverlapping(p.src, p.dst, p.len) };
            }
            if self.partials.is_some() {
                // SAFETY: as above; these destination bytes were just written by this
                // thread and nothing else writes them.
                let bytes = unsafe { std::slice::from_raw_parts(p.dst as *const u8, p.len) };
                match &mut run {
                    Some(r) if r.group == p.group => {
                        r.crc = crate::checksum::append(r.crc, bytes);
                        r.len += p.len;
                    }
                    _ => {
                        out.extend(run.take());
                        let crc = crate::checksum::checksum(bytes);
                        run = Some(Partial {
                            first_piece: self.first_piece + i,
                            group: p.group,
                            crc,
                            len: p.len,
                        });
                    }
                }
            }
        }
        if let Some(partials) = self.partials {
            out.extend(run);
            partials.lock().extend(out);
        }
        Ok(())
    }
}

/// What a copy thread does with a slice. The default, [`MemcpyBody`], copies it; tests
/// and fault injection wrap it to park, count or fail.
pub trait CopyBody: Send + Sync + 'static {
    /// Runs one slice; an `Err` fails the job (after its siblings drained).
    fn run(&self, work: &SliceWork<'_>) -> Result<(), String>;
}

/// Copies the slice's bytes.
#[derive(Debug, Default, Clone, Copy)]
pub struct MemcpyBody;

impl CopyBody for MemcpyBody {
    fn run(&self, work: &SliceWork<'_>) -> Result<(), String> {
        work.copy()
    }
}

/// Engine settings.
#[derive(Clone, Debug)]
pub struct CopyConfig {
    /// Copy threads (default: the available cores).
    pub threads: usize,
    /// Target bytes per slice (default 1 MiB).
    pub slice_bytes: usize,
}

impl Default for CopyConfig {
    fn default() -> Self {
        CopyConfig {
            threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
            slice_bytes: 1 << 20,
        }
    }
}

/// Counters for observability.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct CopyStats {
    /// Copy threads.
    pub threads: usize,
    /// Slices waiting in the queue.
    pub queued_slices: usize,
    /// Jobs submitted and not yet drained.
    pub jobs_in_flight: usize,
    /// Bytes copied since start.
    pub bytes_copied: u64,
    /// Jobs that completed.
    pub jobs_completed: u64,
    /// Jobs that failed, were cancelled or shut down.
    pub jobs_failed: u64,
}

struct Task {
    job: Arc<Job>,
    slice: usize,
}

struct Shared {
    queue: Mutex<VecDeque<Task>>,
    ready: Condvar,
    shutdown: AtomicBool,
    body: Arc<dyn CopyBody>,
    next_job: AtomicU64,
    in_flight: AtomicUsize,
    bytes: AtomicU64,
    completed: AtomicU64,
    failed: AtomicU64,
}

struct EngineInner {
    shared: Arc<Shared>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    config: CopyConfig,
}

/// A pool of dedicated copy threads. Cheap to clone.
#[derive(Clone)]
pub struct CopyEngine {
    inner: Arc<EngineInner>,
}

impl std::fmt::Debug for CopyEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyEngine")
            .field("config", &self.inner.config)
            .finish()
    }
}

impl CopyEngine {
    /// Starts the copy threads with the default memcpy body.
    pub fn new(config: CopyConfig) -> Result<CopyEngine, CopyError> {
        Self::with_body(config, Arc::new(MemcpyBody))
    }

    /// Starts the copy threads with a custom slice body.
    pub fn with_body(config: CopyConfig, body: Arc<dyn CopyBody>) -> Result<CopyEngine, CopyError> {
        if config.threads == 0 || config.threads > 1024 {
            return Err(CopyError::InvalidConfig(format!(
                "threads must be 1..=1024, got {}",
                config.threads
            )));
        }
        if config.slice_bytes < 4096 {
            return Err(CopyError::InvalidConfig(format!(
                "slice size must be at least 4 KiB, got {}",
                config.slice_bytes
            )));
        }
        let shared = Arc::new(Shared {
            queue: Mutex::new(VecDeque::new()),
            ready: Condvar::new(),
            shutdown: AtomicBool::new(false),
            body,
            next_job: AtomicU64::new(1),
            in_flight: AtomicUsize::new(0),
            bytes: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            failed: AtomicU64::new(0),
        });
        let mut threads = Vec::with_capacity(config.threads);
        for i in 0..config.threads {
            let s = shared.clone();
            let h = std::thread::Builder::new()
                .name(format!("kvferry-copy-{i}"))
                .spawn(move || worker(s))
                .map_err(|e| CopyError::InvalidConfig(format!("cannot spawn copy thread: {e}")))?;
            threads.push(h);
        }
        Ok(CopyEngine {
            inner: Arc::new(EngineInner {
                shared,
                threads: Mutex::new(threads),
                config,
            }),
        })
    }

    /// The engine's configuration.
    pub fn config(&self) -> &CopyConfig {
        &self.inner.config
    }

    /// Counters.
    pub fn stats(&self) -> CopyStats {
        let s = &self.inner.shared;
        CopyStats {
            threads: self.inner.config.threads,
            queued_slices: s.queue.lock().len(),
            jobs_in_flight: s.in_flight.load(Ordering::Relaxed),
            bytes_copied: s.bytes.load(Ordering::Relaxed),
            jobs_completed: s.completed.load(Ordering::Relaxed),
            jobs_failed: s.failed.load(Ordering::Relaxed),
        }
    }

    /// Starts copying `plan`. The returned future resolves once every slice has run
    /// (or, on failure or cancel, once every started slice has stopped).
    pub fn copy(&self, plan: CopyPlan) -> CopyJob {
        let shared = &self.inner.shared;
        if shared.shutdown.load(Ordering::Acquire) {
            return CopyJob::finished(Err(CopyFailure {
                error: CopyError::ShutDown,
                plan,
            }));
        }
        if let Err(error) = plan.validate() {
            return CopyJob::finished(Err(CopyFailure { error, plan }));
        }
        let (pieces, slices) = match cut(&plan, self.slice_target(plan.bytes())) {
            Ok(v) => v,
            Err(error) => return CopyJob::finished(Err(CopyFailure { error, plan })),
        };
        if slices.is_empty() {
            return CopyJob::finished(Ok(plan));
        }
        let id = shared.next_job.fetch_add(1, Ordering::Relaxed);
        let n = slices.len();
        let job = Arc::new(Job::new(id, plan, pieces, slices));
        shared.in_flight.fetch_add(1, Ordering::Relaxed);
        {
            let mut q = shared.queue.lock();
            if shared.shutdown.load(Ordering::Acquire) {
                // Raced with shutdown: nobody will run these; account them here.
                drop(q);
                job.fail(CopyError::ShutDown);
                for _ in 0..n {
                    job.skipped.fetch_add(1, Ordering::Relaxed);
                    if job.ledger.finish() {
                        shared.in_flight.fetch_sub(1, Ordering::Relaxed);
                        shared.failed.fetch_add(1, Ordering::Relaxed);
                        job.settle();
                    }
                }
                return CopyJob::running(job);
            }
            for slice in 0..n {
                q.push_back(Task {
                    job: job.clone(),
                    slice,
                });
            }
        }
        if n == 1 {
            shared.ready.notify_one();
        } else {
            shared.ready.notify_all();
        }
        CopyJob::running(job)
    }

    fn slice_target(&self, total: usize) -> usize {
        // Aim for a few slices per thread on big copies, never tiny slices.
        let max = self.inner.config.slice_bytes;
        let per_thread = total / (self.inner.config.threads * 4).max(1);
        per_thread.clamp(max.min(256 << 10), max)
    }

    /// Stops accepting copies, fails queued slices, lets running ones finish and joins
    /// the threads. Idempotent. Blocks for at most one slice per thread.
    pub fn shutdown(&self) {
        self.inner.shutdown();
    }
}

impl EngineInner {
    fn shutdown(&self) {
        self.shared.shutdown.store(true, Ordering::Release);
        {
            let _q = self.shared.queue.lock();
            self.shared.ready.notify_all();
        }
        let threads: Vec<_> = std::mem::take(&mut *self.threads.lock());
        let me = std::thread::current().id();
        for t in threads {
            if t.thread().id() == me {
                continue; // dropped from inside a copy thread: it exits on its own
            }
            let _ = t.join();
        }
    }
}

impl Drop for EngineInner {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn worker(shared: Arc<Shared>) {
    loop {
        let task = {
            let mut q = shared.queue.lock();
            loop {
                if let Some(t) = q.pop_front() {
                    break Some(t);
                }
                if shared.shutdown.load(Ordering::Acquire) {
                    break None;
                }
                shared.ready.wait(&mut q);
            }
        };
        let Some(Task { job, slice }) = task else { return };
        if shared.shutdown.load(Ordering::Acquire) {
            job.fail(CopyError::ShutDown);
        }
        if job.ledger.begin() {
            let range = job.slices[slice].clone();
            let work = SliceWork {
                job: job.id,
                index: slice,
                pieces: &job.pieces[range.clone()],
                partials: job.partials.as_ref(),
                first_piece: range.start,
                remote_pid: job.remote_pid,
                remote_error: &job.remote_error,
            };
            let bytes = work.bytes();
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| shared.body.run(&work)));
            match result {
                Ok(Ok(())) => {
                    shared.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
                }
                Ok(Err(message)) => match job.remote_error.lock().take() {
                    Some(error) => job.fail(CopyError::RemoteRead { slice, error }),
                    None => job.fail(CopyError::SliceFailed { slice, message }),
                },
                Err(_) => job.fail(CopyError::SliceFailed {
                    slice,
                    message: "copy body panicked".into(),
                }),
            }
        } else {
            job.skipped.fetch_add(1, Ordering::Relaxed);
        }
        if job.ledger.finish() {
            shared.in_flight.fetch_sub(1, Ordering::Relaxed);
            if job.ledger.is_stopped() {
                shared.failed.fetch_add(1, Ordering::Relaxed);
            } else {
                shared.completed.fetch_add(1, Ordering::Relaxed);
            }
            job.settle();
        }
        // The task's `Arc<Job>` drops here; if the handle is gone and this was the last
        // slice, `settle` already released the plan.
    }
}

/// Resolves the plan into pieces and groups them into slices of about `target` bytes.
fn cut(plan: &CopyPlan, target: usize) -> Result<(Vec<Piece>, Vec<Range<usize>>), CopyError> {
    let (src, dst) = (&plan.src, &plan.dst);
    let mut pieces = Vec::with_capacity(plan.segments().len());
    let mut src_runs: Vec<(*mut u8, usize)> = Vec::new();
    let mut dst_runs: Vec<(*mut u8, usize)> = Vec::new();
    let groups = plan.checksum_groups();
    let mut group = 0u32;
    for (seg_index, seg) in plan.segments().iter().enumerate() {
        if let Some(ends) = groups {
            while ends[group as usize] <= seg_index {
                group += 1;
            }
        }
        src_runs.clear();
        dst_runs.clear();
        src.for_each_run(seg.src, seg.len, &mut |p, n| src_runs.push((p, n)))?;
        dst.for_each_run(seg.dst, seg.len, &mut |p, n| dst_runs.push((p, n)))?;
        let (mut si, mut di) = (0, 0);
        let (mut so, mut doff) = (0, 0);
        while si < src_runs.len() && di < dst_runs.len() {
            let (sp, sl) = src_runs[si];
            let (dp, dl) = dst_runs[di];
            let n = (sl - so).min(dl - doff).min(target);
            // Address arithmetic only (nothing is read or written here; a remote
            // source's addresses are not ours, hence wrapping arithmetic).
            let piece = Piece {
                src: sp.wrapping_add(so),
                dst: dp.wrapping_add(doff),
                len: n,
                group,
            };
            // Merge with the previous piece when both sides continue contiguously.
            match pieces.last_mut() {
                Some(Piece {
                    src: ps,
                    dst: pd,
                    len: pl,
                    group: pgroup,
                }) if *pl + n <= target
                    && *pgroup == piece.group
                    && std::ptr::eq(ps.wrapping_add(*pl), piece.src)
                    && pd.wrapping_add(*pl) == piece.dst =>
                {
                    *pl += n
                }
                _ => pieces.push(piece),
            }
            so += n;
            doff += n;
            if so == sl {
                si += 1;
                so = 0;
            }
            if doff == dl {
                di += 1;
                doff = 0;
            }
        }
    }
    let mut slices = Vec::new();
    let mut start = 0;
    let mut acc = 0;
    for (i, p) in pieces.iter().enumerate() {
        acc += p.len;
        if acc >= target {
            slices.push(start..i + 1);
            start = i + 1;
            acc = 0;
        }
    }
    if start < pieces.len() {
        slices.push(start..pieces.len());
    }
    Ok((pieces, slices))
}
