//! Requests a server handled: a count per (kind, outcome) and a latency histogram per
//! kind, all lock-free.
//!
//! The producer records one entry per request it handles (see
//! [`Producer::request_stats`](crate::peer::Producer::request_stats)); exporters read
//! [`RequestStats::counts`] and [`RequestStats::latency`] at scrape time. Counting is a
//! relaxed atomic increment plus one histogram observation, so it never blocks a request.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::{Histogram, HistogramSnapshot};

/// What a request asked for (the request message's kind).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RequestKind {
    /// `Ping`, and a mover's offer asked for (`MoverHello`, `DeviceIpcHello`): a
    /// question about the peer, not about data.
    Ping,
    /// `Lookup`: how many of these keys are stored (and `AwaitPublished`: whether a
    /// key arrived within a wait).
    Lookup,
    /// `Stage`: stage chunks for a later pull.
    Stage,
    /// `Get`: stage and send at once (eager get).
    Get,
    /// `Pull`: send a staged lease.
    Pull,
    /// `Done`: release a lease.
    Done,
    /// `Put`: push a chunk into the store.
    Put,
    /// Anything else (refused as unexpected).
    Other,
}

impl RequestKind {
    /// Every kind, in label order.
    pub const ALL: [RequestKind; 8] = [
        RequestKind::Ping,
        RequestKind::Lookup,
        RequestKind::Stage,
        RequestKind::Get,
        RequestKind::Pull,
        RequestKind::Done,
        RequestKind::Put,
        RequestKind::Other,
    ];

    /// The label value (`ping`, `lookup`, `stage`, `get`, `pull`, `done`, `put`, `other`).
    pub fn as_str(self) -> &'static str {
        match self {
            RequestKind::Ping => "ping",
            RequestKind::Lookup => "lookup",
            RequestKind::Stage => "stage",
            RequestKind::Get => "get",
            RequestKind::Pull => "pull",
            RequestKind::Done => "done",
            RequestKind::Put => "put",
            RequestKind::Other => "other",
        }
    }
}

/// How a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RequestOutcome {
    /// Answered as asked (ping, pull, done, put).
    Ok,
    /// A stage, get or lookup that found at least one of its keys.
    Hit,
    /// A stage, get or lookup that found none of its keys.
    Miss,
    /// Refused for lack of capacity (concurrent gets, staging pages, store blocks,
    /// quota): the client may retry.
    Busy,
    /// Refused for any other reason (bad request, unknown or foreign lease, stale
    /// incarnation, too large).
    Refused,
    /// The request ended its connection (a malformed frame, a failed write, the peer
    /// gone).
    Error,
}

impl RequestOutcome {
    /// Every outcome, in label order.
    pub const ALL: [RequestOutcome; 6] = [
        RequestOutcome::Ok,
        RequestOutcome::Hit,
        RequestOutcome::Miss,
        RequestOutcome::Busy,
        RequestOutcome::Refused,
        RequestOutcome::Error,
    ];

    /// The label value (`ok`, `hit`, `miss`, `busy`, `refused`, `error`).
    pub fn as_str(self) -> &'static str {
        match self {
            RequestOutcome::Ok => "ok",
            RequestOutcome::Hit => "hit",
            RequestOutcome::Miss => "miss",
            RequestOutcome::Busy => "busy",
            RequestOutcome::Refused => "refused",
            RequestOutcome::Error => "error",
        }
    }
}

const KINDS: usize = RequestKind::ALL.len();
const OUTCOMES: usize = RequestOutcome::ALL.len();

/// Request counts by kind and outcome, and handling latency by kind.
#[derive(Debug, Default)]
pub struct RequestStats {
    counts: [[AtomicU64; OUTCOMES]; KINDS],
    latency: [Histogram; KINDS],
}

/// One request count: kind, outcome, requests.
pub type RequestCount = (RequestKind, RequestOutcome, u64);

impl RequestStats {
    /// Records one handled request that took `elapsed` (from its message read to its
    /// last reply written).
    pub fn record(&self, kind: RequestKind, outcome: RequestOutcome, elapsed: Duration) {
        let (k, o) = (kind_index(kind), outcome_index(outcome));
        self.counts[k][o].fetch_add(1, Ordering::Relaxed);
        self.latency[k].observe(elapsed);
    }

    /// Every (kind, outcome) count, zeros included, in label order.
    pub fn counts(&self) -> Vec<RequestCount> {
        let mut out = Vec::with_capacity(KINDS * OUTCOMES);
        for (k, kind) in RequestKind::ALL.iter().enumerate() {
            for (o, outcome) in RequestOutcome::ALL.iter().enumerate() {
                out.push((*kind, *outcome, self.counts[k][o].load(Ordering::Relaxed)));
            }
        }
        out
    }

    /// All requests counted.
    pub fn total(&self) -> u64 {
        self.counts.iter().flatten().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    /// The latency histogram of each kind.
    pub fn latency(&self) -> Vec<(RequestKind, HistogramSnapshot)> {
        RequestKind::ALL
            .iter()
            .zip(&self.latency)
            .map(|(k, h)| (*k, h.snapshot()))
            .collect()
    }
}

fn kind_index(kind: RequestKind) -> usize {
    RequestKind::ALL.iter().position(|k| *k == kind).unwrap_or(KINDS - 1)
}

fn outcome_index(outcome: RequestOutcome) -> usize {
    RequestOutcome::ALL
        .iter()
        .position(|o| *o == outcome)
        .unwrap_or(OUTCOMES - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_by_kind_and_outcome() {
        let s = RequestStats::default();
        s.record(RequestKind::Get, RequestOutcome::Hit, Duration::from_millis(2));
        s.record(RequestKind::Get, RequestOutcome::Busy, Duration::from_micros(50));
        s.record(RequestKind::Put, RequestOutcome::Ok, Duration::from_millis(1));
        assert_eq!(s.total(), 3);
        let counts = s.counts();
        assert_eq!(counts.len(), 8 * 6);
        let n = |k, o| counts.iter().find(|c| c.0 == k && c.1 == o).unwrap().2;
        assert_eq!(n(RequestKind::Get, RequestOutcome::Hit), 1);
        assert_eq!(n(RequestKind::Get, RequestOutcome::Busy), 1);
        assert_eq!(n(RequestKind::Get, RequestOutcome::Miss), 0);
        assert_eq!(n(RequestKind::Put, RequestOutcome::Ok), 1);
        let lat = s.latency();
        let get = &lat.iter().find(|l| l.0 == RequestKind::Get).unwrap().1;
        assert_eq!(get.count, 2);
        assert!((get.sum - 0.00205).abs() < 1e-9, "{}", get.sum);
        assert_eq!(lat.iter().find(|l| l.0 == RequestKind::Ping).unwrap().1.count, 0);
    }
}
