//! The registry: a list of [`MetricsSource`]s read at scrape time.
//!
//! Sources keep no copies of the numbers: each one reads the live `stats()` of the
//! object it watches when the registry is rendered, so those counters stay the single
//! source of truth and nothing is counted twice.

use std::sync::Arc;

use parking_lot::Mutex;

use super::Encoder;

/// Something that writes its current metrics into an [`Encoder`] when scraped.
///
/// Implemented by [`Producer`](crate::peer::Producer), [`Consumer`](crate::peer::Consumer),
/// [`Leader`](crate::cluster::Leader) and by any `Fn(&mut Encoder) + Send + Sync`
/// closure (use one to watch something the registry cannot own, through a `Weak`).
/// `collect` runs on the scraping task: it must be quick and must not block on I/O.
pub trait MetricsSource: Send + Sync {
    /// Writes this source's samples.
    fn collect(&self, out: &mut Encoder);
}

impl<F> MetricsSource for F
where
    F: Fn(&mut Encoder) + Send + Sync,
{
    fn collect(&self, out: &mut Encoder) {
        self(out)
    }
}

/// The sources one endpoint serves. Cheap to share through an `Arc`; sources may be
/// added while it is being scraped.
#[derive(Default)]
pub struct Registry {
    sources: Mutex<Vec<Arc<dyn MetricsSource>>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("sources", &self.sources.lock().len())
            .finish()
    }
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Registry {
        Registry::default()
    }

    /// Adds a source; it is read at every later scrape.
    pub fn register(&self, source: impl MetricsSource + 'static) {
        self.sources.lock().push(Arc::new(source));
    }

    /// Number of sources.
    pub fn len(&self) -> usize {
        self.sources.lock().len()
    }

    /// Whether no source is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Reads every source now and renders the text format.
    pub fn render(&self) -> String {
        // Collect outside the lock, so a slow source cannot block `register`.
        let sources: Vec<Arc<dyn MetricsSource>> = self.sources.lock().clone();
        let mut enc = Encoder::new();
        for s in &sources {
            s.collect(&mut enc);
        }
        enc.finish()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;

    #[test]
    fn sources_are_read_at_render_time() {
        let n = Arc::new(AtomicU64::new(1));
        let r = Registry::new();
        assert!(r.is_empty());
        let n2 = n.clone();
        r.register(move |e: &mut Encoder| e.counter("n_total", "N.", &[], n2.load(Ordering::Relaxed)));
        assert_eq!(r.len(), 1);
        assert!(r.render().contains("n_total 1\n"));
        n.store(5, Ordering::Relaxed);
        assert!(r.render().contains("n_total 5\n"));
    }
}
