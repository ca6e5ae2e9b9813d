//! [`Samples`]: what the sources report at one scrape, grouped by metric family, and
//! written with `prometheus-client`'s OpenMetrics text encoder.
//!
//! Sources add samples in any order; each family is written once (its `# HELP` and
//! `# TYPE`, then its series), in the order families were first seen. The output stays
//! valid whatever the sources do:
//!
//! - a sample with an invalid metric or label name is dropped;
//! - a sample whose family was first seen with another type is dropped;
//! - two samples of the same family with the same labels are *added* (two consumers in
//!   one process registered without distinguishing labels show as their sum), so a
//!   series never appears twice;
//! - counters are named with their `_total` suffix (the sample name); the family is
//!   that name without it, as OpenMetrics spells it; a counter name without `_total`
//!   is dropped;
//! - label values are escaped by the encoder.

use std::collections::HashMap;

use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;

use crate::stats::HistogramSnapshot;

/// The type of a metric family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricKind {
    /// Only goes up (resets on restart).
    Counter,
    /// Goes up and down.
    Gauge,
    /// Bucketed observations with a sum and a count.
    Histogram,
    /// Constant labels describing the process (value 1).
    Info,
}

#[derive(Clone, Debug)]
enum Value {
    Int(u64),
    Float(f64),
    Histogram(HistogramSnapshot),
    /// An info series (its labels are the information).
    One,
}

impl Value {
    /// Adds `other` to `self`; false (leaving `self`) when they cannot be added.
    fn add(&mut self, other: &Value) -> bool {
        match (self, other) {
            (Value::Int(a), Value::Int(b)) => *a = a.saturating_add(*b),
            (Value::Float(a), Value::Float(b)) => *a += b,
            (Value::Histogram(a), Value::Histogram(b)) => return a.merge(b),
            (Value::One, Value::One) => {}
            _ => return false,
        }
        true
    }
}

type Labels = Vec<(String, String)>;

#[derive(Debug)]
struct Family {
    name: String,
    help: String,
    kind: MetricKind,
    series: Vec<(Labels, Value)>,
}

/// Samples of one scrape, grouped by family (see the module docs).
#[derive(Debug, Default)]
pub struct Samples {
    families: Vec<Family>,
    index: HashMap<String, usize>,
}

impl Samples {
    /// No samples.
    pub fn new() -> Samples {
        Samples::default()
    }

    /// Adds a counter sample; `name` ends with `_total`.
    pub fn counter(&mut self, name: &str, help: &str, labels: &[(&str, &str)], value: u64) {
        if name.strip_suffix("_total").is_some_and(|f| !f.is_empty()) {
            self.add(name, help, MetricKind::Counter, labels, Value::Int(value));
        }
    }

    /// Adds an integer gauge sample.
    pub fn gauge(&mut self, name: &str, help: &str, labels: &[(&str, &str)], value: u64) {
        self.add(name, help, MetricKind::Gauge, labels, Value::Int(value));
    }

    /// Adds a floating-point gauge sample.
    pub fn gauge_f64(&mut self, name: &str, help: &str, labels: &[(&str, &str)], value: f64) {
        self.add(name, help, MetricKind::Gauge, labels, Value::Float(value));
    }

    /// Adds a histogram series. `labels` must not contain `le`.
    pub fn histogram(&mut self, name: &str, help: &str, labels: &[(&str, &str)], snapshot: &HistogramSnapshot) {
        if labels.iter().any(|(k, _)| *k == "le") {
            return;
        }
        let value = Value::Histogram(snapshot.clone());
        self.add(name, help, MetricKind::Histogram, labels, value);
    }

    /// Adds an info series: `name` ends with `_info`, its value is 1.
    pub fn info(&mut self, name: &str, help: &str, labels: &[(&str, &str)]) {
        if name.strip_suffix("_info").is_some_and(|f| !f.is_empty()) {
            self.add(name, help, MetricKind::Info, labels, Value::One);
        }
    }

    /// Number of families with at least one series.
    pub fn len(&self) -> usize {
        self.families.iter().filter(|f| !f.series.is_empty()).count()
    }

    /// Whether no sample was added.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn add(&mut self, name: &str, help: &str, kind: MetricKind, labels: &[(&str, &str)], value: Value) {
        if !valid_metric_name(name) || !labels.iter().all(|(k, _)| valid_label_name(k)) {
            return;
        }
        let labels: Labels = labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let i = match self.index.get(name) {
            Some(i) => *i,
            None => {
                self.families.push(Family {
                    name: name.to_string(),
                    help: help.to_string(),
                    kind,
                    series: Vec::new(),
                });
                self.index.insert(name.to_string(), self.families.len() - 1);
                self.families.len() - 1
            }
        };
        let family = &mut self.families[i];
        if family.kind != kind {
            return;
        }
        match family.series.iter_mut().find(|(l, _)| *l == labels) {
            Some((_, v)) => {
                v.add(&value);
            }
            None => family.series.push((labels, value)),
        }
    }

    /// Writes every family through `prometheus-client`'s encoder.
    pub(super) fn encode(&self, mut out: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for f in self.families.iter().filter(|f| !f.series.is_empty()) {
            let (family, ty) = match f.kind {
                MetricKind::Counter => (f.name.strip_suffix("_total").unwrap_or(&f.name), MetricType::Counter),
                MetricKind::Gauge => (f.name.as_str(), MetricType::Gauge),
                MetricKind::Histogram => (f.name.as_str(), MetricType::Histogram),
                MetricKind::Info => (f.name.strip_suffix("_info").unwrap_or(&f.name), MetricType::Info),
            };
            let help = escape_help(&f.help);
            let mut desc = out.encode_descriptor(family, &help, None, ty)?;
            for (labels, value) in &f.series {
                if let Value::One = value {
                    desc.encode_info(labels)?;
                    continue;
                }
                let mut series = desc.encode_family(labels)?;
                match (f.kind, value) {
                    (MetricKind::Counter, Value::Int(v)) => series.encode_counter::<NoLabelSet, _, f64>(v, None)?,
                    (MetricKind::Counter, Value::Float(v)) => series.encode_counter::<NoLabelSet, _, f64>(v, None)?,
                    (_, Value::Int(v)) => series.encode_gauge(v)?,
                    (_, Value::Float(v)) => series.encode_gauge(v)?,
                    (_, Value::Histogram(h)) => {
                        series.encode_histogram::<NoLabelSet>(h.sum, h.count, &h.per_bucket(), None)?
                    }
                    (_, Value::One) => {}
                }
            }
        }
        Ok(())
    }
}

/// Help text on one line (the encoder writes it as given).
fn escape_help(v: &str) -> String {
    v.replace('\\', "\\\\").replace('\n', "\\n")
}

/// `[a-zA-Z_:][a-zA-Z0-9_:]*`.
pub fn valid_metric_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// `[a-zA-Z_][a-zA-Z0-9_]*`, not starting with `__` (reserved).
pub fn valid_label_name(name: &str) -> bool {
    let mut chars = name.chars();
    !name.starts_with("__")
        && matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::metrics::render;
    use crate::stats::Histogram;

    #[test]
    fn families_are_written_once_with_help_type_and_labels() {
        let mut s = Samples::new();
        s.counter("kvferry_bytes_total", "Bytes moved.", &[("direction", "sent")], 10);
        s.gauge("kvferry_copy_queue_depth", "Slices queued.", &[], 3);
        s.counter("kvferry_bytes_total", "ignored", &[("direction", "received")], 7);
        s.gauge_f64("x_ratio", "A ratio.", &[], 0.5);
        s.info("x_build_info", "Build.", &[("version", "1.2")]);
        assert_eq!(
            render(s),
            "# HELP kvferry_bytes Bytes moved.\n\
             # TYPE kvferry_bytes counter\n\
             kvferry_bytes_total{direction=\"sent\"} 10\n\
             kvferry_bytes_total{direction=\"received\"} 7\n\
             # HELP kvferry_copy_queue_depth Slices queued.\n\
             # TYPE kvferry_copy_queue_depth gauge\n\
             kvferry_copy_queue_depth 3\n\
             # HELP x_ratio A ratio.\n\
             # TYPE x_ratio gauge\n\
             x_ratio 0.5\n\
             # HELP x_build Build.\n\
             # TYPE x_build info\n\
             x_build_info{version=\"1.2\"} 1\n\
             # EOF\n"
        );
    }

    #[test]
    fn label_values_and_help_are_escaped() {
        let mut s = Samples::new();
        s.counter("m_total", "line one\nback\\slash", &[("peer", "a\"b\\c\nd")], 1);
        let out = render(s);
        assert!(out.contains("# HELP m line one\\nback\\\\slash\n"), "{out}");
        assert!(out.contains("m_total{peer=\"a\\\"b\\\\c\\nd\"} 1\n"), "{out}");
        assert_eq!(out.lines().count(), 4, "no raw newline leaks: {out}");
    }

    #[test]
    fn histograms_are_cumulative_with_inf_sum_and_count() {
        let h = Histogram::with_bounds(&[Duration::from_millis(1), Duration::from_millis(10)]).unwrap();
        h.observe(Duration::from_micros(500));
        h.observe(Duration::from_millis(5));
        h.observe(Duration::from_secs(1));
        let mut s = Samples::new();
        s.histogram("lat_seconds", "Latency.", &[("outcome", "ok")], &h.snapshot());
        let out = render(s);
        for line in [
            "# TYPE lat_seconds histogram\n",
            "lat_seconds_bucket{le=\"0.001\",outcome=\"ok\"} 1\n",
            "lat_seconds_bucket{le=\"0.01\",outcome=\"ok\"} 2\n",
            "lat_seconds_bucket{le=\"+Inf\",outcome=\"ok\"} 3\n",
            "lat_seconds_sum{outcome=\"ok\"} 1.0055\n",
            "lat_seconds_count{outcome=\"ok\"} 3\n",
        ] {
            assert!(out.contains(line), "missing {line:?} in\n{out}");
        }
    }

    #[test]
    fn duplicate_series_are_added_and_clashes_dropped() {
        let h = Histogram::with_bounds(&[Duration::from_millis(1)]).unwrap();
        h.observe(Duration::ZERO);
        let mut s = Samples::new();
        s.counter("c_total", "C.", &[("a", "1")], 2);
        s.counter("c_total", "C.", &[("a", "1")], 3);
        s.gauge("c_total", "clash", &[("a", "2")], 9);
        s.histogram("h", "H.", &[], &h.snapshot());
        s.histogram("h", "H.", &[], &h.snapshot());
        let out = render(s);
        assert!(out.contains("c_total{a=\"1\"} 5\n"), "{out}");
        assert!(!out.contains("a=\"2\""), "{out}");
        assert!(out.contains("h_bucket{le=\"+Inf\"} 2\n"), "{out}");
        assert_eq!(out.matches("# TYPE").count(), 2, "each family once: {out}");
    }

    #[test]
    fn invalid_names_are_dropped() {
        let mut s = Samples::new();
        s.counter("1bad_total", "x", &[], 1);
        s.counter("bad-name_total", "x", &[], 1);
        s.counter("no_suffix", "x", &[], 1);
        s.counter("ok_total", "x", &[("__reserved", "v")], 1);
        s.counter("ok_total", "x", &[("bad label", "v")], 1);
        s.histogram("h2", "x", &[("le", "1")], &Histogram::latency().snapshot());
        s.info("no_info_suffix", "x", &[]);
        assert!(s.is_empty());
        assert_eq!(render(s), "# EOF\n");
        assert!(valid_metric_name("a:b_c9") && !valid_metric_name(""));
        assert!(valid_label_name("_x") && !valid_label_name("9x"));
    }
}
