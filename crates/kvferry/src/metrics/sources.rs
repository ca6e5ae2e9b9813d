//! Which stats become which metrics: the one place that names them (the list, with
//! labels, is in `docs/metrics.md`). Each function adds one stats snapshot's samples;
//! the [`MetricsSource`] impls read the live snapshots at scrape time.
//!
//! Producer and consumer metrics carry `role="producer"` or `role="consumer"`, so one
//! process that is both (and has an arena and a copy engine on each side) exposes
//! distinct series; connection metrics carry `role="server"` (accepted by this
//! process's transport server) or `role="client"` (opened by its consumer's pools).

use super::{MetricsSource, Samples};
use crate::cluster::{Leader, StepOutcomeCounts};
use crate::copy::CopyStats;
use crate::directory::{LivePeers, RegistrationState};
use crate::mem::{ArenaStats, BackingKind};
use crate::net::{PoolStats, ServerStats};
use crate::peer::{Consumer, ConsumerStats, Producer, ProducerStats};
use crate::stats::{HistogramSnapshot, RequestStats};

/// Renders a staging arena's pages, leases and waiters.
pub fn arena_metrics(out: &mut Samples, role: &str, s: &ArenaStats) {
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
    const BACKING: &str = "Staging arena bytes by backing: pinned (page-locked: CUDA host memory or mlock) \
                           or unpinned (the fallback when locking was refused).";
    let bytes = (s.total_pages as u64).saturating_mul(s.page_size as u64);
    let pinned = matches!(s.backing, BackingKind::CudaHost | BackingKind::Mlocked);
    for (backing, n) in [
        ("pinned", if pinned { bytes } else { 0 }),
        ("unpinned", if pinned { 0 } else { bytes }),
    ] {
        out.gauge(
            "kvferry_arena_backing_bytes",
            BACKING,
            &[("role", role), ("backing", backing)],
            n,
        );
    }
}

/// Renders a copy engine's queue and totals.
pub fn copy_metrics(out: &mut Samples, role: &str, s: &CopyStats) {
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

const CONNECTIONS: &str = "Peer connections open now: accepted by this server (role=server, handshaking or \
                           authenticated) or opened by this process's consumer (role=client, in use or idle).";

/// Renders a transport server's connection counters (`role="server"`).
pub fn server_metrics(out: &mut Samples, s: &ServerStats) {
    const ROLE: (&str, &str) = ("role", "server");
    out.gauge("kvferry_peer_connections", CONNECTIONS, &[ROLE], s.active as u64);
    out.gauge(
        "kvferry_peer_connections_handshaking",
        "Accepted connections that have not completed their handshake yet.",
        &[ROLE],
        s.handshaking as u64,
    );
    for (name, help, v) in [
        (
            "kvferry_connections_accepted_total",
            "Peer connections accepted.",
            s.accepted,
        ),
        (
            "kvferry_connections_refused_total",
            "Peers refused with Busy at the connection limit after their handshake.",
            s.refused,
        ),
        (
            "kvferry_connections_rate_limited_total",
            "Connections accepted as suspect (their stale handshake places are the first closed): their source address failed authentication too often.",
            s.rate_limited,
        ),
        (
            "kvferry_connections_evicted_total",
            "Handshaking connections closed to make room for a new one.",
            s.evicted,
        ),
        (
            "kvferry_connections_evicted_silent_total",
            "Connections that had sent nothing yet, closed to make room for a new one.",
            s.evicted_silent,
        ),
        (
            "kvferry_handshake_failures_total",
            "Handshakes that failed (including authentication and evictions).",
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
    ] {
        out.counter(name, help, &[ROLE], v);
    }
}

/// Renders a consumer's client connections (`role="client"`).
pub fn client_connection_metrics(out: &mut Samples, s: &PoolStats) {
    const ROLE: (&str, &str) = ("role", "client");
    out.gauge(
        "kvferry_peer_connections",
        CONNECTIONS,
        &[ROLE],
        (s.in_use + s.idle) as u64,
    );
    out.counter(
        "kvferry_connections_opened_total",
        "Peer connections this process's consumer opened (handshake completed).",
        &[ROLE],
        s.opened,
    );
}

/// Renders the requests a server handled: `kvferry_requests_total{kind,outcome}` and
/// the handling latency `kvferry_serve_request_seconds{kind}`.
pub fn request_metrics(out: &mut Samples, s: &RequestStats) {
    const COUNT: &str = "Peer requests handled, by kind (ping, lookup, stage, get, pull, done, put, other) and \
                         outcome (ok, hit, miss, busy, refused, error).";
    for (kind, outcome, n) in s.counts() {
        out.counter(
            "kvferry_requests_total",
            COUNT,
            &[("kind", kind.as_str()), ("outcome", outcome.as_str())],
            n,
        );
    }
    const LATENCY: &str = "Time this server took to handle a request, from its message read to its last \
                           reply (bulk bytes included) written, by kind.";
    for (kind, snap) in s.latency() {
        out.histogram(
            "kvferry_serve_request_seconds",
            LATENCY,
            &[("kind", kind.as_str())],
            &snap,
        );
    }
}

const BYTES: &str = "Bytes moved, by direction: sent (producer to socket), received (socket to staging), \
                     landed (staging to the consumer's region).";
const CHUNKS: &str = "Chunks moved, by direction (as kvferry_bytes_total).";

/// Renders a producer's counters (not its arena or copy engine).
pub fn producer_metrics(out: &mut Samples, s: &ProducerStats) {
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
    out.gauge(
        "kvferry_quota_pages_charged",
        "Staging pages charged to peers' quotas (staged leases, sends, puts being received).",
        &[ROLE],
        s.quota_pages_charged as u64,
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
pub fn consumer_metrics(out: &mut Samples, s: &ConsumerStats, latency: &[(&str, HistogramSnapshot)]) {
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
pub fn step_outcome_metrics(out: &mut Samples, ranks: &[StepOutcomeCounts]) {
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

/// Renders the peer directory as this process sees it: live peers, whether that view
/// is stale (the backend could not confirm it lately: the last one known is in use),
/// whether this process is registered (`None`: it does not register), and how often it
/// took its record back from a holder that did not prove itself.
pub fn directory_metrics(
    out: &mut Samples,
    live: &LivePeers,
    registration: Option<&RegistrationState>,
    taken_back: u64,
) {
    out.gauge(
        "kvferry_directory_peers",
        "Live peers in this process's directory view (itself included when registered).",
        &[],
        live.peers.len() as u64,
    );
    out.gauge(
        "kvferry_directory_stale",
        "1 while the directory backend (etcd) cannot confirm the view: lookups use the last one known.",
        &[],
        live.stale as u64,
    );
    if let Some(state) = registration {
        out.gauge(
            "kvferry_directory_registered",
            "1 while this process is registered in the directory; 0 while its registration is lost or absent.",
            &[],
            matches!(state, RegistrationState::Registered(_)) as u64,
        );
        out.counter(
            "kvferry_directory_records_taken_back_total",
            "Times this process put its record back after a writer that did not prove itself (the shared secret, or the record's identity, at its address) took it.",
            &[],
            taken_back,
        );
    }
}

impl MetricsSource for Producer {
    /// Producer counters, the requests it handled, its staging arena and its copy engine.
    fn collect(&self, out: &mut Samples) {
        producer_metrics(out, &self.stats());
        request_metrics(out, self.request_stats());
        arena_metrics(out, "producer", &self.arena().stats());
        copy_metrics(out, "producer", &self.engine().stats());
    }
}

impl MetricsSource for Consumer {
    /// Consumer counters, latency histograms, its client connections, its receive arena
    /// and its copy engine.
    fn collect(&self, out: &mut Samples) {
        consumer_metrics(out, &self.stats(), &self.transfer_latency());
        client_connection_metrics(out, &self.connection_stats());
        arena_metrics(out, "consumer", &self.arena().stats());
        copy_metrics(out, "consumer", &self.engine().stats());
    }
}

impl MetricsSource for Leader {
    /// Per-rank step outcomes.
    fn collect(&self, out: &mut Samples) {
        step_outcome_metrics(out, &self.step_outcomes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let mut e = Samples::new();
        step_outcome_metrics(&mut e, &ranks);
        let out = crate::metrics::render(e);
        assert_eq!(out.matches("# TYPE kvferry_step_outcomes counter\n").count(), 1);
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
        assert!(out.ends_with("# EOF\n"), "{out}");
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
        let mut e = Samples::new();
        arena_metrics(&mut e, "producer", &s);
        let out = crate::metrics::render(e);
        assert!(
            out.contains("kvferry_arena_pages{role=\"producer\",state=\"free\"} 6\n"),
            "{out}"
        );
        assert!(out.contains("kvferry_arena_pages{role=\"producer\",state=\"leased\"} 3\n"));
        assert!(out.contains("kvferry_arena_pages{role=\"producer\",state=\"quarantined\"} 1\n"));
        assert!(out.contains("kvferry_arena_page_bytes{role=\"producer\"} 4096\n"));
        assert!(out.contains("kvferry_arena_backing_bytes{role=\"producer\",backing=\"pinned\"} 0\n"));
        assert!(out.contains("kvferry_arena_backing_bytes{role=\"producer\",backing=\"unpinned\"} 40960\n"));
    }
}
