//! Which stats become which metrics: the one place that names them (the list is in
//! `README-notes.md`). Each function renders one stats snapshot; the
//! [`MetricsSource`] impls read the live snapshots at scrape time.
//!
//! Producer and consumer metrics carry `role="producer"` or `role="consumer"`, so one
//! process that is both (and has an arena and a copy engine on each side) exposes
//! distinct series.

use super::{Encoder, HistogramSnapshot, MetricsSource};
use crate::cluster::Leader;
use crate::copy::CopyStats;
use crate::mem::ArenaStats;
use crate::net::ServerStats;
use crate::peer::{Consumer, ConsumerStats, Producer, ProducerStats};

/// One rank's step outcomes, as counted by the cluster leader.
///
/// `success` and `failure` count the rank's answers (including answers that arrive
/// after their step was already resolved); `timeout` counts steps that timed out with
/// this rank silent; `died` counts steps failed because this rank's worker died.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct StepOutcomeCounts {
    /// Answered SUCCESS.
    pub success: u64,
    /// Answered FAILURE.
    pub failure: u64,
    /// Silent when its step's deadline passed.
    pub timeout: u64,
    /// Its worker died before it answered.
    pub died: u64,
}

/// Renders a staging arena's pages, leases and waiters.
pub fn arena_metrics(out: &mut Encoder, role: &str, s: &ArenaStats) {
    const PAGES: &str = "Staging arena pages by state (free + leased + quarantined = total).";
    for (state, n) in [
        ("free", s.free_pages),
        ("leased", s.leased_pages),
        ("quarantined", s.quarantined_pages),
    ] {
        out.gauge(
            "kvferry_arena_pages",
            PAGES,
            &[("role", role), ("state", state)],
            n as u64,
        );
    }
    let r = &[("role", role)];
    out.gauge(
        "kvferry_arena_page_bytes",
        "Bytes per staging page.",
        r,
        s.page_size as u64,
    );
    out.gauge(
        "kvferry_arena_leases",
        "Live staging leases.",
        r,
        s.outstanding_leases as u64,
    );
    out.gauge(
        "kvferry_arena_waiters",
        "Allocations waiting for staging pages.",
        r,
        s.waiters as u64,
    );
}

/// Renders a copy engine's queue and totals.
pub fn copy_metrics(out: &mut Encoder, role: &str, s: &CopyStats) {
    let r = &[("role", role)];
    out.gauge(
        "kvferry_copy_queue_depth",
        "Copy slices waiting for a copy thread.",
        r,
        s.queued_slices as u64,
    );
    out.gauge(
        "kvferry_copy_jobs_in_flight",
        "Copy jobs submitted and not yet drained.",
        r,
        s.jobs_in_flight as u64,
    );
    out.gauge("kvferry_copy_threads", "Copy threads.", r, s.threads as u64);
    out.counter("kvferry_copy_bytes_total", "Bytes copied.", r, s.bytes_copied);
    const JOBS: &str = "Copy jobs ended, by outcome (failed includes cancelled and shut down).";
    for (outcome, n) in [("completed", s.jobs_completed), ("failed", s.jobs_failed)] {
        out.counter(
            "kvferry_copy_jobs_total",
            JOBS,
            &[("role", role), ("outcome", outcome)],
            n,
        );
    }
}

/// Renders a transport server's connection counters.
pub fn server_metrics(out: &mut Encoder, s: &ServerStats) {
    out.gauge(
        "kvferry_peer_connections",
        "Peer connections open now (server side).",
        &[],
        s.active as u64,
    );
    for (name, help, v) in [
        (
            "kvferry_connections_accepted_total",
            "Peer connections accepted.",
            s.accepted,
        ),
        (
            "kvferry_connections_refused_total",
            "Peer connections refused at the connection limit.",
            s.refused,
        ),
        (
            "kvferry_handshake_failures_total",
            "Handshakes that failed (including authentication).",
            s.handshake_failures,
        ),
        (
            "kvferry_auth_failures_total",
            "Handshakes that failed authentication.",
            s.auth_failures,
        ),
        (
            "kvferry_protocol_errors_total",
            "Connections closed for a protocol or frame error.",
            s.protocol_errors,
        ),
        ("kvferry_requests_total", "Peer requests handled.", s.requests),
    ] {
        out.counter(name, help, &[], v);
    }
}

const BYTES: &str = "Bytes moved, by direction: sent (producer to socket), received (socket to staging), \
                     landed (staging to the consumer's region).";
const CHUNKS: &str = "Chunks moved, by direction (as kvferry_bytes_total).";

/// Renders a producer's counters (not its arena or copy engine).
pub fn producer_metrics(out: &mut Encoder, s: &ProducerStats) {
    const ROLE: (&str, &str) = ("role", "producer");
    out.counter(
        "kvferry_bytes_total",
        BYTES,
        &[ROLE, ("direction", "sent")],
        s.bytes_sent,
    );
    out.counter(
        "kvferry_bytes_total",
        BYTES,
        &[ROLE, ("direction", "received")],
        s.bytes_received,
    );
    out.counter(
        "kvferry_chunks_total",
        CHUNKS,
        &[ROLE, ("direction", "sent")],
        s.chunks_sent,
    );
    out.counter(
        "kvferry_chunks_total",
        CHUNKS,
        &[ROLE, ("direction", "received")],
        s.pushed,
    );
    out.gauge(
        "kvferry_staged_leases",
        "Staged leases waiting for a pull or Done.",
        &[ROLE],
        s.staged_now as u64,
    );
    for (name, help, v) in [
        ("kvferry_leases_staged_total", "Leases staged.", s.staged),
        ("kvferry_leases_done_total", "Leases released by Done.", s.done),
        (
            "kvferry_leases_expired_total",
            "Leases released by TTL expiry.",
            s.expired,
        ),
        (
            "kvferry_busy_total",
            "Requests refused as busy (staging cap or arena full).",
            s.busy,
        ),
    ] {
        out.counter(name, help, &[ROLE], v);
    }
}

/// Renders a consumer's counters and its transfer latency histograms
/// (`(outcome, snapshot)` pairs, as [`Consumer::transfer_latency`] returns them).
pub fn consumer_metrics(out: &mut Encoder, s: &ConsumerStats, latency: &[(&str, HistogramSnapshot)]) {
    const ROLE: (&str, &str) = ("role", "consumer");
    for (dir, bytes, chunks) in [
        ("received", s.bytes_received, s.chunks_received),
        ("landed", s.bytes, s.chunks_landed),
    ] {
        out.counter("kvferry_bytes_total", BYTES, &[ROLE, ("direction", dir)], bytes);
        out.counter("kvferry_chunks_total", CHUNKS, &[ROLE, ("direction", dir)], chunks);
    }
    const TRANSFERS: &str = "Transfers (get, pull) ended, by outcome.";
    for (outcome, v) in [
        ("completed", s.completed),
        ("failed", s.failed),
        ("cancelled", s.cancelled),
    ] {
        out.counter("kvferry_transfers_total", TRANSFERS, &[ROLE, ("outcome", outcome)], v);
    }
    out.gauge(
        "kvferry_transfers_draining",
        "Transfers whose work is still running or draining.",
        &[ROLE],
        s.draining,
    );
    for (name, help, v) in [
        (
            "kvferry_timeouts_total",
            "Transfers answered with Timeout (their work is then cancelled and drained).",
            s.timeouts,
        ),
        (
            "kvferry_cancellations_total",
            "Transfers cancelled and drained because the caller stopped waiting (drop, or its deadline passed first).",
            s.cancelled,
        ),
        (
            "kvferry_checksum_failures_total",
            "Chunks refused for a checksum mismatch (never landed).",
            s.checksum_failures,
        ),
    ] {
        out.counter(name, help, &[ROLE], v);
    }
    for (outcome, snap) in latency {
        out.histogram(
            "kvferry_transfer_seconds",
            "Transfer latency from start to landed or failed, by outcome.",
            &[ROLE, ("outcome", outcome)],
            snap,
        );
    }
}

/// Renders per-rank step outcomes (index = rank).
pub fn step_outcome_metrics(out: &mut Encoder, ranks: &[StepOutcomeCounts]) {
    const HELP: &str = "Step outcomes per rank: success and failure answers, timeouts (silent at the deadline), \
                        deaths.";
    for (rank, c) in ranks.iter().enumerate() {
        let rank = rank.to_string();
        for (outcome, v) in [
            ("success", c.success),
            ("failure", c.failure),
            ("timeout", c.timeout),
            ("died", c.died),
        ] {
            out.counter(
                "kvferry_step_outcomes_total",
                HELP,
                &[("rank", &rank), ("outcome", outcome)],
                v,
            );
        }
    }
}

impl MetricsSource for Producer {
    /// Producer counters, its staging arena and its copy engine.
    fn collect(&self, out: &mut Encoder) {
        producer_metrics(out, &self.stats());
        arena_metrics(out, "producer", &self.arena().stats());
        copy_metrics(out, "producer", &self.engine().stats());
    }
}

impl MetricsSource for Consumer {
    /// Consumer counters, latency histograms, its receive arena and its copy engine.
    fn collect(&self, out: &mut Encoder) {
        consumer_metrics(out, &self.stats(), &self.transfer_latency());
        arena_metrics(out, "consumer", &self.arena().stats());
        copy_metrics(out, "consumer", &self.engine().stats());
    }
}

impl MetricsSource for Leader {
    /// Per-rank step outcomes.
    fn collect(&self, out: &mut Encoder) {
        step_outcome_metrics(out, &self.step_outcomes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::BackingKind;

    #[test]
    fn step_outcomes_render_per_rank() {
        let ranks = [
            StepOutcomeCounts {
                success: 3,
                ..Default::default()
            },
            StepOutcomeCounts {
                success: 2,
                failure: 1,
                timeout: 4,
                died: 1,
            },
        ];
        let mut e = Encoder::new();
        step_outcome_metrics(&mut e, &ranks);
        let out = e.finish();
        assert_eq!(out.matches("# TYPE kvferry_step_outcomes_total counter\n").count(), 1);
        for line in [
            "kvferry_step_outcomes_total{rank=\"0\",outcome=\"success\"} 3\n",
            "kvferry_step_outcomes_total{rank=\"0\",outcome=\"died\"} 0\n",
            "kvferry_step_outcomes_total{rank=\"1\",outcome=\"failure\"} 1\n",
            "kvferry_step_outcomes_total{rank=\"1\",outcome=\"timeout\"} 4\n",
            "kvferry_step_outcomes_total{rank=\"1\",outcome=\"died\"} 1\n",
        ] {
            assert!(out.contains(line), "missing {line:?} in\n{out}");
        }
        assert_eq!(out.lines().filter(|l| !l.starts_with('#')).count(), 8);
    }

    #[test]
    fn arena_pages_by_state() {
        let s = ArenaStats {
            total_pages: 10,
            free_pages: 6,
            leased_pages: 3,
            quarantined_pages: 1,
            outstanding_leases: 2,
            waiters: 0,
            page_size: 4096,
            backing: BackingKind::Unlocked,
            closed: false,
        };
        let mut e = Encoder::new();
        arena_metrics(&mut e, "producer", &s);
        let out = e.finish();
        assert!(
            out.contains("kvferry_arena_pages{role=\"producer\",state=\"free\"} 6\n"),
            "{out}"
        );
        assert!(out.contains("kvferry_arena_pages{role=\"producer\",state=\"leased\"} 3\n"));
        assert!(out.contains("kvferry_arena_pages{role=\"producer\",state=\"quarantined\"} 1\n"));
        assert!(out.contains("kvferry_arena_page_bytes{role=\"producer\"} 4096\n"));
    }
}
