//! Loom model of the copy job's drain protocol (run with
//! `RUSTFLAGS="--cfg kvferry_loom" cargo test -p kvferry --test loom_drain --release`).
//!
//! Two copy threads each own one slice of a job that owns one arena page; a caller
//! cancels by stopping the ledger and dropping its handle. In every interleaving the
//! page is never free while a thread writes it, and it is freed exactly once.
#![cfg(kvferry_loom)]

use kvferry::copy::SliceLedger;
use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;

struct Page {
    free: AtomicBool,
    writers: AtomicUsize,
    frees: AtomicUsize,
}

/// Stands for a job: it owns the page until the last holder drops it.
struct Job {
    ledger: SliceLedger,
    page: Arc<Page>,
    settled: AtomicBool,
}

impl Drop for Job {
    fn drop(&mut self) {
        assert_eq!(
            self.page.writers.load(Ordering::SeqCst),
            0,
            "page freed under a live writer"
        );
        assert!(self.ledger.is_drained() || !self.settled.load(Ordering::SeqCst));
        self.page.free.store(true, Ordering::SeqCst);
        self.page.frees.fetch_add(1, Ordering::SeqCst);
    }
}

fn run_slice(job: Arc<Job>) {
    if job.ledger.begin() {
        job.page.writers.fetch_add(1, Ordering::SeqCst);
        assert!(!job.page.free.load(Ordering::SeqCst), "writing a free page");
        job.page.writers.fetch_sub(1, Ordering::SeqCst);
    }
    if job.ledger.finish() {
        job.settled.store(true, Ordering::SeqCst);
        assert_eq!(
            job.page.writers.load(Ordering::SeqCst),
            0,
            "settled with a writer inside"
        );
    }
    drop(job);
}

#[test]
fn cancel_never_frees_a_page_under_a_writer() {
    loom::model(|| {
        let page = Arc::new(Page {
            free: AtomicBool::new(false),
            writers: AtomicUsize::new(0),
            frees: AtomicUsize::new(0),
        });
        let job = Arc::new(Job {
            ledger: SliceLedger::new(2),
            page: page.clone(),
            settled: AtomicBool::new(false),
        });
        let w1 = {
            let j = job.clone();
            thread::spawn(move || run_slice(j))
        };
        let w2 = {
            let j = job.clone();
            thread::spawn(move || run_slice(j))
        };
        // The caller cancels: stop unstarted slices, drop its handle.
        job.ledger.stop();
        drop(job);
        w1.join().unwrap();
        w2.join().unwrap();
        assert!(page.free.load(Ordering::SeqCst));
        assert_eq!(page.frees.load(Ordering::SeqCst), 1);
    });
}

#[test]
fn failure_in_one_slice_settles_once_after_both() {
    loom::model(|| {
        let page = Arc::new(Page {
            free: AtomicBool::new(false),
            writers: AtomicUsize::new(0),
            frees: AtomicUsize::new(0),
        });
        let job = Arc::new(Job {
            ledger: SliceLedger::new(2),
            page: page.clone(),
            settled: AtomicBool::new(false),
        });
        let settles = Arc::new(AtomicUsize::new(0));
        let mut hs = Vec::new();
        for fail in [true, false] {
            let j = job.clone();
            let s = settles.clone();
            hs.push(thread::spawn(move || {
                if j.ledger.begin() {
                    j.page.writers.fetch_add(1, Ordering::SeqCst);
                    assert!(!j.page.free.load(Ordering::SeqCst));
                    j.page.writers.fetch_sub(1, Ordering::SeqCst);
                    if fail {
                        j.ledger.stop();
                    }
                }
                if j.ledger.finish() {
                    s.fetch_add(1, Ordering::SeqCst);
                }
            }));
        }
        drop(job);
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(settles.load(Ordering::SeqCst), 1);
        assert_eq!(page.frees.load(Ordering::SeqCst), 1);
    });
}
