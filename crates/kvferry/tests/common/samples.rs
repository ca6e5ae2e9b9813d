//! Reading samples out of a parsed Prometheus scrape (`prometheus-parse`, the
//! independent oracle of the metrics tests): a sample by name and exact labels, and its
//! number. Shared by `metrics_scrape` here and the CLI's `serve_metrics`.
#![allow(dead_code)]

use std::collections::HashSet;

use prometheus_parse::{Sample, Scrape, Value};

/// The sample `name` whose labels are exactly `labels`; panics naming the metrics the
/// scrape has when there is none.
pub fn find<'a>(m: &'a Scrape, name: &str, labels: &[(&str, &str)]) -> &'a Sample {
    m.samples
        .iter()
        .find(|s| {
            s.metric == name
                && s.labels.len() == labels.len()
                && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v))
        })
        .unwrap_or_else(|| {
            let names: HashSet<_> = m.samples.iter().map(|s| s.metric.as_str()).collect();
            panic!("no {name}{labels:?}; have {names:?}")
        })
}

/// The value of the counter, gauge or untyped sample `name` with exactly `labels`.
pub fn val(m: &Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    match &find(m, name, labels).value {
        Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => *v,
        other => panic!("{name} is not a number: {other:?}"),
    }
}
