//! The Prometheus text exposition format, version 0.0.4, written by hand.
//!
//! An [`Encoder`] collects samples grouped by metric family (in the order families are
//! first seen) and [`Encoder::finish`] writes each family once: `# HELP`, `# TYPE`,
//! then its series. The output is always valid, whatever the sources do:
//!
//! - label values are escaped (`\\`, `\"`, `\n`); help text escapes `\\` and `\n`;
//! - a sample with an invalid metric or label name is dropped;
//! - a sample whose family was first seen with another type is dropped;
//! - two samples of the same family with the same labels are *added* (two consumers in
//!   one process, registered without distinguishing labels, show as their sum), so a
//!   series never appears twice;
//! - histograms are written as cumulative `_bucket{le="..."}` lines ending with
//!   `le="+Inf"`, then `_sum` and `_count`.

use std::collections::HashMap;
use std::fmt::Write;

use super::HistogramSnapshot;

/// The `Content-Type` of the text format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The type of a metric family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricKind {
    /// Only goes up (resets on restart).
    Counter,
    /// Goes up and down.
    Gauge,
    /// Bucketed observations with a sum and a count.
    Histogram,
}

impl MetricKind {
    fn as_str(self) -> &'static str {
        match self {
            MetricKind::Counter => "counter",
            MetricKind::Gauge => "gauge",
            MetricKind::Histogram => "histogram",
        }
    }
}

#[derive(Clone, Debug)]
enum Value {
    Int(u64),
    Float(f64),
    Histogram(HistogramSnapshot),
}

impl Value {
    /// Adds `other` to `self`; false (leaving `self`) when they cannot be added.
    fn add(&mut self, other: &Value) -> bool {
        match (self, other) {
            (Value::Int(a), Value::Int(b)) => *a = a.saturating_add(*b),
            (Value::Float(a), Value::Float(b)) => *a += b,
            (Value::Histogram(a), Value::Histogram(b)) => return a.merge(b),
            _ => return false,
        }
        true
    }
}

#[derive(Debug)]
struct Family {
    name: String,
    help: String,
    kind: MetricKind,
    series: Vec<(Vec<(String, String)>, Value)>,
}

/// Collects samples and writes them in the text format (see the module docs).
#[derive(Debug, Default)]
pub struct Encoder {
    families: Vec<Family>,
    index: HashMap<String, usize>,
}

impl Encoder {
    /// An empty encoder.
    pub fn new() -> Encoder {
        Encoder::default()
    }

    /// Adds a counter sample.
    pub fn counter(&mut self, name: &str, help: &str, labels: &[(&str, &str)], value: u64) {
        self.add(name, help, MetricKind::Counter, labels, Value::Int(value));
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
        self.add(
            name,
            help,
            MetricKind::Histogram,
            labels,
            Value::Histogram(snapshot.clone()),
        );
    }

    fn add(&mut self, name: &str, help: &str, kind: MetricKind, labels: &[(&str, &str)], value: Value) {
        if !valid_metric_name(name) || !labels.iter().all(|(k, _)| valid_label_name(k)) {
            return;
        }
        let labels: Vec<(String, String)> = labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
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

    /// Writes every family in the text format.
    pub fn finish(self) -> String {
        let mut out = String::new();
        for f in &self.families {
            if f.series.is_empty() {
                continue;
            }
            let _ = writeln!(out, "# HELP {} {}", f.name, escape_help(&f.help));
            let _ = writeln!(out, "# TYPE {} {}", f.name, f.kind.as_str());
            for (labels, value) in &f.series {
                match value {
                    Value::Int(v) => {
                        let _ = writeln!(out, "{}{} {v}", f.name, label_set(labels, None));
                    }
                    Value::Float(v) => {
                        let _ = writeln!(out, "{}{} {}", f.name, label_set(labels, None), format_f64(*v));
                    }
                    Value::Histogram(h) => {
                        for (le, n) in &h.buckets {
                            let le = format_f64(*le);
                            let _ = writeln!(out, "{}_bucket{} {n}", f.name, label_set(labels, Some(&le)));
                        }
                        let _ = writeln!(out, "{}_bucket{} {}", f.name, label_set(labels, Some("+Inf")), h.count);
                        let _ = writeln!(out, "{}_sum{} {}", f.name, label_set(labels, None), format_f64(h.sum));
                        let _ = writeln!(out, "{}_count{} {}", f.name, label_set(labels, None), h.count);
                    }
                }
            }
        }
        out
    }
}

/// `{k="v",...}` (with `le` last when given), or nothing for no labels.
fn label_set(labels: &[(String, String)], le: Option<&str>) -> String {
    if labels.is_empty() && le.is_none() {
        return String::new();
    }
    let mut s = String::from("{");
    let all = labels
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .chain(le.map(|v| ("le", v)));
    for (i, (k, v)) in all.enumerate() {
        if i > 0 {
            s.push(',');
        }
        let _ = write!(s, "{k}=\"{}\"", escape_label_value(v));
    }
    s.push('}');
    s
}

/// Escapes a label value: backslash, double quote and line feed.
pub fn escape_label_value(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

fn escape_help(v: &str) -> String {
    v.replace('\\', "\\\\").replace('\n', "\\n")
}

/// A sample value as the format spells it (`+Inf`, `-Inf`, `NaN`, or a decimal).
pub fn format_f64(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v == f64::INFINITY {
        "+Inf".into()
    } else if v == f64::NEG_INFINITY {
        "-Inf".into()
    } else {
        format!("{v}")
    }
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
    use crate::metrics::Histogram;

    #[test]
    fn counters_and_gauges_have_help_type_and_labels() {
        let mut e = Encoder::new();
        e.counter("kvferry_bytes_total", "Bytes moved.", &[("direction", "sent")], 10);
        e.gauge("kvferry_copy_queue_depth", "Slices queued.", &[], 3);
        e.counter("kvferry_bytes_total", "ignored", &[("direction", "received")], 7);
        e.gauge_f64("x_ratio", "A ratio.", &[], 0.5);
        let out = e.finish();
        assert_eq!(
            out,
            "# HELP kvferry_bytes_total Bytes moved.\n\
             # TYPE kvferry_bytes_total counter\n\
             kvferry_bytes_total{direction=\"sent\"} 10\n\
             kvferry_bytes_total{direction=\"received\"} 7\n\
             # HELP kvferry_copy_queue_depth Slices queued.\n\
             # TYPE kvferry_copy_queue_depth gauge\n\
             kvferry_copy_queue_depth 3\n\
             # HELP x_ratio A ratio.\n\
             # TYPE x_ratio gauge\n\
             x_ratio 0.5\n"
        );
    }

    #[test]
    fn label_values_and_help_are_escaped() {
        let mut e = Encoder::new();
        e.counter("m_total", "line one\nback\\slash", &[("peer", "a\"b\\c\nd")], 1);
        let out = e.finish();
        assert!(out.contains("# HELP m_total line one\\nback\\\\slash\n"), "{out}");
        assert!(out.contains("m_total{peer=\"a\\\"b\\\\c\\nd\"} 1\n"), "{out}");
        assert_eq!(out.lines().count(), 3, "no raw newline leaks: {out}");
    }

    #[test]
    fn histograms_are_cumulative_with_inf_sum_and_count() {
        let h = Histogram::with_bounds(&[Duration::from_millis(1), Duration::from_millis(10)]).unwrap();
        h.observe(Duration::from_micros(500));
        h.observe(Duration::from_millis(5));
        h.observe(Duration::from_secs(1));
        let mut e = Encoder::new();
        e.histogram("lat_seconds", "Latency.", &[("outcome", "ok")], &h.snapshot());
        let out = e.finish();
        assert_eq!(
            out,
            "# HELP lat_seconds Latency.\n\
             # TYPE lat_seconds histogram\n\
             lat_seconds_bucket{outcome=\"ok\",le=\"0.001\"} 1\n\
             lat_seconds_bucket{outcome=\"ok\",le=\"0.01\"} 2\n\
             lat_seconds_bucket{outcome=\"ok\",le=\"+Inf\"} 3\n\
             lat_seconds_sum{outcome=\"ok\"} 1.0055\n\
             lat_seconds_count{outcome=\"ok\"} 3\n"
        );
        let mut e = Encoder::new();
        e.histogram("bare", "No labels.", &[], &h.snapshot());
        let out = e.finish();
        assert!(
            out.contains("bare_bucket{le=\"+Inf\"} 3\nbare_sum 1.0055\nbare_count 3\n"),
            "{out}"
        );
    }

    #[test]
    fn duplicate_series_are_added_and_type_clashes_dropped() {
        let h = Histogram::with_bounds(&[Duration::from_millis(1)]).unwrap();
        h.observe(Duration::ZERO);
        let mut e = Encoder::new();
        e.counter("c_total", "C.", &[("a", "1")], 2);
        e.counter("c_total", "C.", &[("a", "1")], 3);
        e.gauge("c_total", "clash", &[("a", "2")], 9);
        e.histogram("h", "H.", &[], &h.snapshot());
        e.histogram("h", "H.", &[], &h.snapshot());
        let out = e.finish();
        assert!(out.contains("c_total{a=\"1\"} 5\n"), "{out}");
        assert!(!out.contains("a=\"2\""), "{out}");
        assert!(
            out.contains("h_bucket{le=\"0.001\"} 2\nh_bucket{le=\"+Inf\"} 2\n"),
            "{out}"
        );
        assert_eq!(out.matches("# TYPE").count(), 2, "each family once: {out}");
    }

    #[test]
    fn invalid_names_are_dropped_and_specials_spelled() {
        let mut e = Encoder::new();
        e.counter("1bad", "x", &[], 1);
        e.counter("bad-name", "x", &[], 1);
        e.counter("ok_total", "x", &[("__reserved", "v")], 1);
        e.counter("ok_total", "x", &[("bad label", "v")], 1);
        e.histogram("h2", "x", &[("le", "1")], &Histogram::latency().snapshot());
        assert_eq!(e.finish(), "");
        assert_eq!(format_f64(f64::NAN), "NaN");
        assert_eq!(format_f64(f64::INFINITY), "+Inf");
        assert_eq!(format_f64(f64::NEG_INFINITY), "-Inf");
        assert_eq!(format_f64(1.0), "1");
        assert_eq!(format_f64(0.0001), "0.0001");
        assert!(valid_metric_name("a:b_c9") && !valid_metric_name(""));
        assert!(valid_label_name("_x") && !valid_label_name("9x"));
    }
}
