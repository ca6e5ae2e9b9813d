//! The registry: a list of [`MetricsSource`]s read at scrape time, rendered through a
//! `prometheus-client` registry (one collector) into the OpenMetrics text format.
//!
//! Sources keep no copies of the numbers: each one reads the live `stats()` of the
//! object it watches when the registry is rendered, so those counters stay the single
//! source of truth and nothing is counted twice. Every registry also reports
//! `kvferry_build_info{version}` (value 1).

use std::sync::Arc;

use parking_lot::Mutex;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;

use super::Samples;

/// The `Content-Type` of what [`Registry::render`] returns.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Something that adds its current samples when scraped.
///
/// Implemented by [`Producer`](crate::peer::Producer), [`Consumer`](crate::peer::Consumer),
/// [`Leader`](crate::cluster::Leader) (in [`super::sources`]) and by any
/// `Fn(&mut Samples) + Send + Sync` closure (use one to watch something the registry
/// cannot own, through a `Weak`). `collect` runs on the scraping task: it must be quick
/// and must not block on I/O.
pub trait MetricsSource: Send + Sync {
    /// Adds this source's samples.
    fn collect(&self, out: &mut Samples);
}

impl<F> MetricsSource for F
where
    F: Fn(&mut Samples) + Send + Sync,
{
    fn collect(&self, out: &mut Samples) {
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
    /// An empty registry (it still reports `kvferry_build_info`).
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

    /// Reads every source now (after `kvferry_build_info`).
    pub fn collect(&self) -> Samples {
        // Collect outside the lock, so a slow source cannot block `register`.
        let sources: Vec<Arc<dyn MetricsSource>> = self.sources.lock().clone();
        let mut out = Samples::new();
        build_info(&mut out);
        for s in &sources {
            s.collect(&mut out);
        }
        out
    }

    /// Reads every source now and renders the OpenMetrics text format.
    pub fn render(&self) -> String {
        render(self.collect())
    }
}

/// Renders `samples` in the OpenMetrics text format (ending with `# EOF`).
pub fn render(samples: Samples) -> String {
    let mut registry = prometheus_client::registry::Registry::default();
    registry.register_collector(Box::new(Collected(samples)));
    let mut out = String::new();
    // Writing into a String fails only if an encoder refuses a value, which ours never
    // produce (every histogram has its +Inf bucket); an empty answer would be visible.
    if prometheus_client::encoding::text::encode(&mut out, &registry).is_err() {
        tracing::warn!(target: "kvferry::metrics", "encoding the metrics failed");
    }
    out
}

/// `kvferry_build_info{version="…"} 1`.
fn build_info(out: &mut Samples) {
    out.info(
        "kvferry_build_info",
        "The kvferry library serving these metrics.",
        &[("version", env!("CARGO_PKG_VERSION"))],
    );
}

/// One scrape's samples as a `prometheus-client` collector.
#[derive(Debug)]
struct Collected(Samples);

impl Collector for Collected {
    fn encode(&self, encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        self.0.encode(encoder)
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
        r.register(move |e: &mut Samples| e.counter("n_total", "N.", &[], n2.load(Ordering::Relaxed)));
        assert_eq!(r.len(), 1);
        assert!(r.render().contains("\nn_total 1\n"));
        n.store(5, Ordering::Relaxed);
        let out = r.render();
        assert!(out.contains("\nn_total 5\n"), "{out}");
        assert!(
            out.starts_with(&format!(
                "# HELP kvferry_build The kvferry library serving these metrics.\n\
                 # TYPE kvferry_build info\n\
                 kvferry_build_info{{version=\"{}\"}} 1\n",
                env!("CARGO_PKG_VERSION")
            )),
            "{out}"
        );
        assert!(out.ends_with("# EOF\n"));
    }
}
