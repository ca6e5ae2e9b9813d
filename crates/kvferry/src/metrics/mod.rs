//! Prometheus metrics on the standard crates: `prometheus-client` encodes what the
//! [`MetricsSource`]s in a [`Registry`] report at scrape time (OpenMetrics text), and
//! a hyper endpoint ([`MetricsServer`]) serves it with `/healthz` and `/readyz`.
//!
//! # Semantics
//!
//! This module sits above the layers it reads. The `stats()` methods of the arena,
//! copy engine, transport server, connection pools, producer and consumer, the
//! producer's [`RequestStats`](crate::stats::RequestStats), the consumer's latency
//! histograms (from the leaf [`crate::stats`]) and the cluster leader's
//! [`StepOutcomeCounts`](crate::cluster::StepOutcomeCounts) are the single source of
//! truth: a scrape reads them at that moment and encodes them (see [`sources`] for the
//! mapping and `docs/metrics.md` for the list). Nothing is counted twice and nothing is
//! cached; no lower layer imports this module.
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

mod endpoint;
mod registry;
mod samples;
pub mod sources;

pub use endpoint::{listen_address, read_token_file, HttpConfig, MetricsServer, Readiness};
pub use registry::{render, MetricsSource, Registry, CONTENT_TYPE};
pub use samples::{valid_label_name, valid_metric_name, MetricKind, Samples};

/// Errors of the metrics module.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// An endpoint setting is unusable.
    #[error("invalid metrics endpoint configuration: {0}")]
    InvalidConfig(String),
    /// The bearer token file cannot be used.
    #[error("cannot use metrics token file {path}: {reason}")]
    Token {
        /// The file.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The endpoint could not listen.
    #[error("cannot serve metrics on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: String,
        /// The underlying error.
        source: std::io::Error,
    },
}

impl MetricsError {
    /// The stable code of this error.
    pub fn code(&self) -> crate::ErrorCode {
        use crate::ErrorCode as C;
        match self {
            MetricsError::InvalidConfig(_) | MetricsError::Token { .. } => C::InvalidConfig,
            MetricsError::Bind { .. } => C::BindFailed,
        }
    }
}
