//! Plain threads for `get_blocking` transfers (which refuse to run inside the tokio
//! runtime), fed through a channel.

use std::sync::{mpsc, Arc, Mutex};

/// Work for a [`BlockingPool`] thread.
type Job = Box<dyn FnOnce() + Send>;

/// Plain threads for `get_blocking` (which refuses to run inside the runtime).
pub struct BlockingPool {
    tx: Mutex<Option<mpsc::Sender<Job>>>,
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl BlockingPool {
    /// `n` threads.
    pub fn new(n: usize) -> BlockingPool {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let threads = (0..n)
            .map(|i| {
                let rx = rx.clone();
                std::thread::Builder::new()
                    .name(format!("chaos-blocking-{i}"))
                    .spawn(move || loop {
                        let job = rx.lock().unwrap().recv();
                        match job {
                            Ok(job) => job(),
                            Err(_) => return,
                        }
                    })
                    .expect("spawn a blocking thread")
            })
            .collect();
        BlockingPool {
            tx: Mutex::new(Some(tx)),
            threads: Mutex::new(threads),
        }
    }

    /// Runs `f` on a pool thread; `None` if the pool is shut down or `f` panicked.
    pub async fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move || {
            let _ = tx.send(f());
        });
        self.tx.lock().unwrap().as_ref()?.send(job).ok()?;
        rx.await.ok()
    }

    /// Stops the threads once their queue is empty.
    pub fn shutdown(&self) {
        self.tx.lock().unwrap().take();
        for t in self.threads.lock().unwrap().drain(..) {
            let _ = t.join();
        }
    }
}
