//! A fixed-bucket latency histogram, lock-free: one atomic counter per bucket plus an
//! atomic sum, so observing never blocks and never allocates (the transfer and request
//! paths observe into it; `prometheus-client`'s own histogram takes a mutex per
//! observation, so the exporter encodes snapshots of this one instead).
//!
//! Buckets are upper bounds (`le`, inclusive, as in Prometheus): an observation `d`
//! lands in the first bucket whose bound is `>= d`, or in the implicit `+Inf` bucket.
//! A [`HistogramSnapshot`] holds *cumulative* counts, ready to render; its `count` is
//! derived from the buckets, so `count` always equals the `+Inf` bucket even while
//! other threads observe (the `sum` may lag or lead by the observations in flight).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::StatsError;

/// Default bounds for transfer latencies: 100 µs to 10 s, roughly 1-2.5-5 per decade.
pub const LATENCY_BUCKETS: &[Duration] = &[
    Duration::from_micros(100),
    Duration::from_micros(250),
    Duration::from_micros(500),
    Duration::from_millis(1),
    Duration::from_micros(2_500),
    Duration::from_millis(5),
    Duration::from_millis(10),
    Duration::from_millis(25),
    Duration::from_millis(50),
    Duration::from_millis(100),
    Duration::from_millis(250),
    Duration::from_millis(500),
    Duration::from_secs(1),
    Duration::from_millis(2_500),
    Duration::from_secs(5),
    Duration::from_secs(10),
];

/// A histogram of durations over fixed bucket bounds. Share it by reference or `Arc`.
#[derive(Debug)]
pub struct Histogram {
    /// Upper bounds in nanoseconds, strictly increasing.
    bounds: Box<[u64]>,
    /// Non-cumulative counts; one more than `bounds` (the `+Inf` bucket).
    counts: Box<[AtomicU64]>,
    /// Sum of observations in nanoseconds (saturating at `u64::MAX`, ~584 years).
    sum_ns: AtomicU64,
}

/// A cumulative copy of a [`Histogram`], as Prometheus renders it.
#[derive(Clone, Debug, PartialEq)]
pub struct HistogramSnapshot {
    /// `(upper bound in seconds, observations <= bound)`, increasing, without `+Inf`.
    pub buckets: Vec<(f64, u64)>,
    /// All observations (the `+Inf` bucket).
    pub count: u64,
    /// Sum of observations, in seconds.
    pub sum: f64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram::latency()
    }
}

impl Histogram {
    /// A histogram with [`LATENCY_BUCKETS`].
    pub fn latency() -> Histogram {
        Histogram::with_bounds(LATENCY_BUCKETS).expect("the default bounds are valid")
    }

    /// A histogram with these upper bounds. They must be non-empty, non-zero and
    /// strictly increasing.
    pub fn with_bounds(bounds: &[Duration]) -> Result<Histogram, StatsError> {
        if bounds.is_empty() {
            return Err(StatsError::InvalidBuckets("no bucket bounds".into()));
        }
        let ns: Vec<u64> = bounds.iter().map(|d| duration_ns(*d)).collect();
        if ns[0] == 0 {
            return Err(StatsError::InvalidBuckets("a bucket bound is zero".into()));
        }
        if let Some(w) = ns.windows(2).find(|w| w[0] >= w[1]) {
            return Err(StatsError::InvalidBuckets(format!(
                "bounds must increase strictly: {:?} then {:?}",
                Duration::from_nanos(w[0]),
                Duration::from_nanos(w[1])
            )));
        }
        let counts = (0..=ns.len()).map(|_| AtomicU64::new(0)).collect();
        Ok(Histogram {
            bounds: ns.into_boxed_slice(),
            counts,
            sum_ns: AtomicU64::new(0),
        })
    }

    /// Records one observation.
    pub fn observe(&self, d: Duration) {
        let ns = duration_ns(d);
        let i = self.bounds.partition_point(|b| *b < ns);
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        let _ = self
            .sum_ns
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |s| Some(s.saturating_add(ns)));
    }

    /// A cumulative snapshot.
    pub fn snapshot(&self) -> HistogramSnapshot {
        let mut acc = 0u64;
        let mut buckets = Vec::with_capacity(self.bounds.len());
        for (bound, c) in self.bounds.iter().zip(self.counts.iter()) {
            acc = acc.saturating_add(c.load(Ordering::Relaxed));
            buckets.push((*bound as f64 / 1e9, acc));
        }
        let inf = self.counts[self.bounds.len()].load(Ordering::Relaxed);
        HistogramSnapshot {
            buckets,
            count: acc.saturating_add(inf),
            sum: self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9,
        }
    }
}

impl HistogramSnapshot {
    /// The counts per bucket (not cumulative), `(upper bound in seconds, count)`,
    /// ending with the `+Inf` bucket: the form exposition encoders take.
    pub fn per_bucket(&self) -> Vec<(f64, u64)> {
        let mut prev = 0u64;
        let mut out = Vec::with_capacity(self.buckets.len() + 1);
        for (le, cum) in &self.buckets {
            out.push((*le, cum.saturating_sub(prev)));
            prev = *cum;
        }
        out.push((f64::INFINITY, self.count.saturating_sub(prev)));
        out
    }

    /// Adds `other`'s counts into this one (same bounds required; returns false and
    /// changes nothing otherwise).
    pub fn merge(&mut self, other: &HistogramSnapshot) -> bool {
        let same = self.buckets.len() == other.buckets.len()
            && self.buckets.iter().zip(&other.buckets).all(|(a, b)| a.0 == b.0);
        if !same {
            return false;
        }
        for (a, b) in self.buckets.iter_mut().zip(&other.buckets) {
            a.1 = a.1.saturating_add(b.1);
        }
        self.count = self.count.saturating_add(other.count);
        self.sum += other.sum;
        true
    }
}

fn duration_ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn observations_land_in_the_first_bucket_whose_bound_is_not_smaller() {
        let h = Histogram::with_bounds(&[ms(1), ms(10), ms(100)]).unwrap();
        h.observe(Duration::ZERO); // le 1ms
        h.observe(ms(1)); // le is inclusive
        h.observe(ms(1) + Duration::from_nanos(1)); // le 10ms
        h.observe(ms(100)); // le 100ms
        h.observe(ms(101)); // +Inf
        h.observe(Duration::MAX); // +Inf, sum saturates
        let s = h.snapshot();
        assert_eq!(s.buckets, vec![(0.001, 2), (0.01, 3), (0.1, 4)]);
        assert_eq!(s.count, 6);
        assert!(s.sum >= 1e9, "the saturated sum is huge: {}", s.sum);
    }

    #[test]
    fn snapshot_is_cumulative_and_sums_seconds() {
        let h = Histogram::latency();
        for _ in 0..3 {
            h.observe(ms(3));
        }
        h.observe(ms(30));
        let s = h.snapshot();
        assert_eq!(s.count, 4);
        assert!((s.sum - 0.039).abs() < 1e-9, "{}", s.sum);
        assert!(s.buckets.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1));
        let at = |le: f64| s.buckets.iter().find(|b| b.0 == le).unwrap().1;
        assert_eq!(at(0.0025), 0);
        assert_eq!(at(0.005), 3);
        assert_eq!(at(0.025), 3);
        assert_eq!(at(0.05), 4);
        assert_eq!(s.buckets.last().unwrap().1, 4);
    }

    #[test]
    fn bad_bounds_are_rejected() {
        assert!(Histogram::with_bounds(&[]).is_err());
        assert!(Histogram::with_bounds(&[Duration::ZERO, ms(1)]).is_err());
        assert!(Histogram::with_bounds(&[ms(2), ms(2)]).is_err());
        assert!(Histogram::with_bounds(&[ms(2), ms(1)]).is_err());
    }

    #[test]
    fn concurrent_observers_are_all_counted() {
        let h = std::sync::Arc::new(Histogram::latency());
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let h = h.clone();
                std::thread::spawn(move || {
                    for i in 0..1000u64 {
                        h.observe(Duration::from_micros(t * 1000 + i));
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let s = h.snapshot();
        assert_eq!(s.count, 4000);
        assert_eq!(s.buckets.last().unwrap().1, 4000, "all below 10 s");
    }

    #[test]
    fn per_bucket_counts_add_up_to_the_count() {
        let h = Histogram::with_bounds(&[ms(1), ms(10)]).unwrap();
        for d in [ms(1), ms(2), ms(3), ms(50)] {
            h.observe(d);
        }
        let s = h.snapshot();
        assert_eq!(s.per_bucket(), vec![(0.001, 1), (0.01, 2), (f64::INFINITY, 1)]);
        assert_eq!(s.per_bucket().iter().map(|b| b.1).sum::<u64>(), s.count);
    }

    #[test]
    fn merge_adds_matching_snapshots_only() {
        let a = Histogram::with_bounds(&[ms(1), ms(2)]).unwrap();
        let b = Histogram::with_bounds(&[ms(1), ms(2)]).unwrap();
        let c = Histogram::with_bounds(&[ms(1)]).unwrap();
        a.observe(ms(1));
        b.observe(ms(2));
        b.observe(ms(5));
        let mut s = a.snapshot();
        assert!(s.merge(&b.snapshot()));
        assert_eq!(s.buckets, vec![(0.001, 1), (0.002, 2)]);
        assert_eq!(s.count, 3);
        assert!(!s.merge(&c.snapshot()));
        assert_eq!(s.count, 3);
    }
}
