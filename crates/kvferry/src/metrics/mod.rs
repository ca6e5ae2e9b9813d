//! Prometheus metrics, with no dependencies beyond tokio: a lock-free fixed-bucket
//! [`Histogram`], a hand-written text-format [`Encoder`] (exposition format 0.0.4), a
//! [`Registry`] of [`MetricsSource`]s read at scrape time, and a tiny HTTP endpoint
//! ([`MetricsServer`]) answering `GET /metrics`.
//!
//! # Semantics
//!
//! The `stats()` methods of the arena, copy engine, server, producer and consumer are
//! the single source of truth: a scrape reads them at that moment and renders them
//! (see [`sources`] for the mapping and `README-notes.md` for the metric list).
//! Nothing is counted twice and nothing is cached; a scrape costs one `stats()` call
//! per source. The only state this module adds to the hot path is the consumer's
//! latency [`Histogram`] (a few relaxed atomic increments per transfer).
//!
//! Counters reset when the process restarts (Prometheus handles that); gauges are
//! instantaneous and may be mutually inconsistent by the events between two reads
//! (e.g. arena pages are read under one lock and always add up to the total, but a
//! transfer counted as completed may still hold pages in a different source).
//!
//! # Cancellation
//!
//! Dropping a [`MetricsServer`] (or a future of it) stops the endpoint and aborts its
//! connection tasks; those own nothing but their socket and a rendered body, so no
//! state is left behind. Sources are never cancelled mid-read: `collect` is synchronous.

mod histogram;
mod http;
mod registry;
mod render;
pub mod sources;

pub use histogram::{Histogram, HistogramSnapshot, LATENCY_BUCKETS};
pub use http::{HttpConfig, MetricsServer};
pub use registry::{MetricsSource, Registry};
pub use render::{
    escape_label_value, format_f64, valid_label_name, valid_metric_name, Encoder, MetricKind, CONTENT_TYPE,
};
pub use sources::StepOutcomeCounts;

/// Errors of the metrics module.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// Histogram bucket bounds are unusable.
    #[error("invalid histogram buckets: {0}")]
    InvalidBuckets(String),
    /// An endpoint setting is unusable.
    #[error("invalid metrics endpoint configuration: {0}")]
    InvalidConfig(String),
    /// The endpoint could not listen.
    #[error("cannot serve metrics on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: String,
        /// The underlying error.
        source: std::io::Error,
    },
}
