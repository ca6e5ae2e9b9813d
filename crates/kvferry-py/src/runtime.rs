//! The tokio runtimes Python engines run on: one of an engine's own, or the
//! process's shared runtime of N threads, which every engine asking for a shared
//! runtime of N threads uses.
//!
//! Several engines in one process (tests, benchmarks, a rank serving a prefill and a
//! decode role) on one shared runtime run on `N` threads instead of `N` per engine:
//! on a small machine separate runtimes make their threads take turns on the same
//! cores, which costs a quarter of the loopback throughput on 2 cores (measured:
//! docs/benchmarks.md). An engine with a runtime of its own is isolated from its
//! neighbours' tasks.
//!
//! A shared runtime is reference-counted: it starts with the first engine that asks
//! for it and shuts down when the last one holding it closes or is dropped; the
//! registry keeps only a weak reference, so nothing outlives its engines (a later
//! engine starts a fresh runtime). The registry belongs to the process that filled
//! it: a child made by `fork` (whose copies of the parent's runtimes have no threads)
//! finds it empty and starts runtimes of its own.
//!
//! # Shutdown
//!
//! Dropping the last [`RuntimeRef`] shuts the runtime down, waiting up to
//! [`SHUTDOWN_WAIT`] for its tasks to stop; dropped on one of the runtime's own threads
//! (an engine released from a completion callback), it shuts down in the background
//! instead, since a runtime thread cannot wait for itself.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::runtime::{Handle, Runtime};

use crate::linger::Linger;

/// How long closing the last engine of a runtime waits for its threads to stop.
pub const SHUTDOWN_WAIT: Duration = Duration::from_millis(500);

/// Shared runtimes by thread count (weak: they live as long as their engines), and the
/// process they were started in.
static SHARED: Registry = Mutex::new(None);

/// Shared runtimes by thread count, and the process that started them.
type Registry = Mutex<Option<(u32, HashMap<usize, Weak<Held>>)>>;

/// A runtime, shut down when the last reference goes.
struct Held {
    runtime: Option<Runtime>,
    handle: Handle,
    /// The runtime's lingering window (see [`crate::linger`]).
    linger: Arc<Linger>,
    threads: usize,
    shared: bool,
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            if Handle::try_current().is_ok() {
                rt.shutdown_background();
            } else {
                rt.shutdown_timeout(SHUTDOWN_WAIT);
            }
        }
    }
}

/// An engine's hold on its runtime.
#[derive(Clone)]
pub struct RuntimeRef {
    held: Arc<Held>,
}

impl RuntimeRef {
    /// A runtime of `threads` threads: the process's shared one for that count when
    /// `shared` (started if none is running), else one of its own.
    pub fn get(threads: usize, shared: bool) -> std::io::Result<RuntimeRef> {
        if !shared {
            return Self::start(threads, false);
        }
        Self::shared_in(&SHARED, std::process::id(), threads)
    }

    /// The shared runtime of `threads` threads in `registry`, as seen by process `pid`.
    fn shared_in(registry: &Registry, pid: u32, threads: usize) -> std::io::Result<RuntimeRef> {
        let mut registry = registry.lock();
        if registry.as_ref().is_some_and(|(owner, _)| *owner != pid) {
            // Forked: the parent's runtimes have no threads here. Forget them (only
            // weak references: nothing is shut down).
            *registry = None;
        }
        let (_, map) = registry.get_or_insert_with(|| (pid, HashMap::new()));
        map.retain(|_, weak| weak.strong_count() > 0);
        if let Some(held) = map.get(&threads).and_then(Weak::upgrade) {
            return Ok(RuntimeRef { held });
        }
        let r = Self::start(threads, true)?;
        map.insert(threads, Arc::downgrade(&r.held));
        Ok(r)
    }

    fn start(threads: usize, shared: bool) -> std::io::Result<RuntimeRef> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name(if shared { "kvferry-rt-shared" } else { "kvferry-rt" })
            .enable_all()
            .build()?;
        let handle = runtime.handle().clone();
        let linger = Linger::start(&handle);
        Ok(RuntimeRef {
            held: Arc::new(Held {
                runtime: Some(runtime),
                handle,
                linger,
                threads,
                shared,
            }),
        })
    }

    /// The runtime's handle.
    pub fn handle(&self) -> &Handle {
        &self.held.handle
    }

    /// Whether this is a shared runtime.
    pub fn is_shared(&self) -> bool {
        self.held.shared
    }

    /// Its lingering window.
    pub fn linger(&self) -> &Arc<Linger> {
        &self.held.linger
    }

    /// Its worker threads.
    pub fn threads(&self) -> usize {
        self.held.threads
    }

    /// Engines (references) holding this runtime, this one included.
    pub fn holders(&self) -> usize {
        Arc::strong_count(&self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engines_asking_the_same_thread_count_share_one_runtime_until_the_last_goes() {
        // A thread count no other test in this process uses.
        let a = RuntimeRef::get(7, true).unwrap();
        let b = RuntimeRef::get(7, true).unwrap();
        assert!(Arc::ptr_eq(&a.held, &b.held));
        assert_eq!(a.holders(), 2);
        let other = RuntimeRef::get(5, true).unwrap();
        assert!(!Arc::ptr_eq(&a.held, &other.held));
        let own = RuntimeRef::get(7, false).unwrap();
        assert!(!Arc::ptr_eq(&a.held, &own.held) && !own.is_shared());
        let weak = Arc::downgrade(&a.held);
        drop((a, b));
        assert!(weak.upgrade().is_none(), "the last holder shut the shared runtime down");
        let c = RuntimeRef::get(7, true).unwrap();
        assert_eq!(c.holders(), 1, "a later engine starts a fresh shared runtime");
        assert_eq!(c.handle().block_on(async { 6 * 7 }), 42);
    }

    #[test]
    fn a_forked_child_does_not_reuse_its_parents_runtimes() {
        let registry: Registry = Mutex::new(None);
        let parent = RuntimeRef::shared_in(&registry, 1, 3).unwrap();
        let again = RuntimeRef::shared_in(&registry, 1, 3).unwrap();
        assert!(Arc::ptr_eq(&parent.held, &again.held));
        // The same registry seen from another process (a forked child, where the
        // parent's runtime has no threads): a runtime of the child's own.
        let child = RuntimeRef::shared_in(&registry, 2, 3).unwrap();
        assert!(!Arc::ptr_eq(&parent.held, &child.held));
        assert_eq!(child.holders(), 1);
        let child2 = RuntimeRef::shared_in(&registry, 2, 3).unwrap();
        assert!(Arc::ptr_eq(&child.held, &child2.held), "shared within the child");
        assert_eq!(child.handle().block_on(async { 1 + 1 }), 2);
    }

    #[test]
    fn the_last_holder_dropped_inside_a_runtime_shuts_down_in_the_background() {
        let r = RuntimeRef::get(9, true).unwrap();
        let weak = Arc::downgrade(&r.held);
        // Dropped in an async context (as from a completion callback on an engine
        // thread): a blocking shutdown would panic there.
        let other = tokio::runtime::Builder::new_current_thread().build().unwrap();
        other.block_on(async move { drop(r) });
        assert!(weak.upgrade().is_none());
    }
}
