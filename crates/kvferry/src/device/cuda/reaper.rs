//! The reaper: a per-device thread that watches abandoned events (timed out, dropped)
//! until they settle, so their quarantined pages are released soon after the GPU
//! finishes, and frees device memory, so dropping a buffer never blocks the caller on
//! a busy device (`cuMemFree` may synchronise). The thread exists only while there is
//! something to watch or free; it polls with backoff from 1 ms up to 100 ms, back to
//! 1 ms whenever new work arrives. If the thread cannot be started, watched pages stay
//! quarantined and queued frees leak (both safe), and a warning says so.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys;
use parking_lot::{Condvar, Mutex};

use super::driver::Ctx;
use super::event::CudaEv;

const REAP_MIN: Duration = Duration::from_millis(1);
const REAP_MAX: Duration = Duration::from_millis(100);

struct ReaperState {
    watches: Vec<Arc<CudaEv>>,
    frees: Vec<(Arc<Ctx>, sys::CUdeviceptr)>,
    running: bool,
    kicked: bool,
}

struct ReaperInner {
    state: Mutex<ReaperState>,
    cv: Condvar,
}

/// Watches abandoned events and frees device memory, on a thread that exists only while
/// there is work.
#[derive(Clone)]
pub(super) struct Reaper {
    inner: Arc<ReaperInner>,
}

impl Reaper {
    pub(super) fn new() -> Reaper {
        Reaper {
            inner: Arc::new(ReaperInner {
                state: Mutex::new(ReaperState {
                    watches: Vec::new(),
                    frees: Vec::new(),
                    running: false,
                    kicked: false,
                }),
                cv: Condvar::new(),
            }),
        }
    }

    pub(super) fn watch(&self, ev: Arc<CudaEv>) {
        self.kick(|st| st.watches.push(ev));
    }

    pub(super) fn free(&self, ctx: Arc<Ctx>, ptr: sys::CUdeviceptr) {
        self.kick(|st| st.frees.push((ctx, ptr)));
    }

    fn kick(&self, add: impl FnOnce(&mut ReaperState)) {
        let mut st = self.inner.state.lock();
        add(&mut st);
        st.kicked = true;
        if st.running {
            self.inner.cv.notify_one();
            return;
        }
        st.running = true;
        let inner = self.inner.clone();
        let spawned = std::thread::Builder::new()
            .name("kvferry-cuda-reaper".into())
            .spawn(move || reap(inner));
        if let Err(e) = spawned {
            // Nothing is released without the thread: watched pages stay quarantined and
            // queued frees leak. Both are safe; report it.
            st.running = false;
            tracing::warn!(target: "kvferry::device", "cannot start the CUDA reaper thread: {e}");
        }
    }
}

fn reap(inner: Arc<ReaperInner>) {
    let mut backoff = REAP_MIN;
    loop {
        let (frees, watches) = {
            let mut st = inner.state.lock();
            if st.watches.is_empty() && st.frees.is_empty() {
                st.running = false;
                return;
            }
            if std::mem::take(&mut st.kicked) {
                backoff = REAP_MIN;
            }
            (std::mem::take(&mut st.frees), std::mem::take(&mut st.watches))
        };
        for (ctx, ptr) in frees {
            if ctx.bind().is_ok() {
                // SAFETY: `ptr` was allocated with cuMemAlloc in `ctx`, and every
                // operation that used it held the buffer until it completed.
                unsafe {
                    sys::cuMemFree_v2(ptr);
                }
            }
        }
        // A query that sees an event settle runs its callbacks (releasing quarantine).
        let pending: Vec<_> = watches.into_iter().filter(|ev| !ev.query().is_settled()).collect();
        let mut st = inner.state.lock();
        st.watches.extend(pending);
        if !st.kicked && !st.watches.is_empty() && st.frees.is_empty() {
            inner.cv.wait_for(&mut st, backoff);
            backoff = (backoff * 2).min(REAP_MAX);
        }
    }
}
