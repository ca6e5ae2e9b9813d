"""``KvferryConnector``'s metrics inside vLLM: what each worker moved and what went
wrong, reported through vLLM's own connector-stats path.

Each worker's connector fills a :class:`KvferryConnectorStats` between two engine
steps; vLLM takes it with ``get_kv_connector_stats()`` after every step, combines the
workers' with :meth:`KvferryConnectorStats.aggregate` (``KVOutputAggregator``), ships
the plain ``data`` dict to the front end, rebuilds it there with
``KvferryConnector.build_kv_connector_stats`` and then

- logs :meth:`KvferryConnectorStats.reduce` every logging interval
  (``KVConnectorLogging``: "KV Transfer metrics: pulls=…, gbps=…, …"), and
- records it in Prometheus through :class:`KvferryPromMetrics`
  (``KvferryConnector.build_prom_metrics``), per engine label:

  ``vllm:kvferry_pull_seconds`` (histogram: one observation per landed pull, from its
  first attempt to the bytes landing), ``vllm:kvferry_pull_bytes`` (histogram),
  ``vllm:kvferry_bytes_total``, ``vllm:kvferry_blocks_total``,
  ``vllm:kvferry_failed_pulls_total{kind=…}`` (``miss``, ``timeout``, ``peer_lost``,
  ``restarted``, ``checksum``, ``device``, ``lease_expired``, ``wrong_prompt`` — the
  params named KV not bound to the request's prompt (:mod:`.prompt`), refused unread
  —, ``other``),
  ``vllm:kvferry_releases_total`` (prefill instances told to free blocks a decode
  will not pull: aborts, give-ups, 0 external tokens),
  ``vllm:kvferry_publications_released_total{reason=…}`` (prefill side: ``done`` —
  pulled —, ``declined`` — the decode said it will not pull —, ``expired`` — the lease
  ran out: the decode never came or never said —, ``released``, ``shutdown``).

``data`` also counts, per prefill data-parallel rank (the ``remote_dp_rank`` the
prefill's params name), the bytes landed (``pulled_by_dp``) and the failed pulls
(``failed_by_dp``); the log line shows them (``mb_from_dp<d>``,
``failed_from_dp<d>``) once a rank other than 0 appears.

Everything in ``data`` is plain lists and ints, so it pickles and serializes as vLLM
needs between processes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from ... import errors
from .prompt import WrongPromptError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

FAILURE_KINDS = ("miss", "timeout", "peer_lost", "restarted", "checksum", "device", "lease_expired", "wrong_prompt", "other")
RELEASE_REASONS = ("done", "declined", "expired", "released", "shutdown")


def failure_kind(error: BaseException | None) -> str:
    """The metric label of a failed pull's last error."""
    table: list[tuple[type[BaseException], str]] = [
        (errors.NotFoundError, "miss"),
        (errors.TimeoutError, "timeout"),
        (errors.PeerLostError, "peer_lost"),
        (errors.PeerRestartedError, "restarted"),
        (errors.ChecksumError, "checksum"),
        (errors.DeviceError, "device"),
        (errors.LeaseExpiredError, "lease_expired"),
        (WrongPromptError, "wrong_prompt"),
    ]
    for cls, kind in table:
        if isinstance(error, cls):
            return kind
    return "other"


def _empty() -> dict[str, Any]:
    return {
        "pull_seconds": [],
        "pull_bytes": [],
        "pull_blocks": [],
        "failed": {k: 0 for k in FAILURE_KINDS},
        "releases": 0,
        "published_released": {r: 0 for r in RELEASE_REASONS},
        # Per prefill data-parallel rank (``remote_dp_rank`` of the params, as a
        # string): bytes landed and failed pulls. Pulls whose params name no DP rank
        # are not counted here.
        "pulled_by_dp": {},
        "failed_by_dp": {},
    }


@dataclass
class KvferryConnectorStats(KVConnectorStats):
    """One interval's observations of one worker (or, after :meth:`aggregate`, of
    several)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()
        else:
            # Rebuilt from a shipped dict: a copy (aggregating into it must never change
            # the caller's dict), with any field an older sender lacked.
            base = _empty()
            base.update(copy.deepcopy(self.data))
            self.data = base

    def reset(self) -> None:
        self.data = _empty()

    # recording (worker side)
    def record_pull(self, seconds: float, nbytes: int, blocks: int, dp_rank: int | None = None) -> None:
        self.data["pull_seconds"].append(float(seconds))
        self.data["pull_bytes"].append(int(nbytes))
        self.data["pull_blocks"].append(int(blocks))
        if dp_rank is not None:
            by = self.data["pulled_by_dp"]
            by[str(dp_rank)] = by.get(str(dp_rank), 0) + int(nbytes)

    def record_failure(self, error: BaseException | None, dp_rank: int | None = None) -> None:
        self.data["failed"][failure_kind(error)] += 1
        if dp_rank is not None:
            by = self.data["failed_by_dp"]
            by[str(dp_rank)] = by.get(str(dp_rank), 0) + 1

    def record_release(self) -> None:
        self.data["releases"] += 1

    def record_publication_released(self, reason: str) -> None:
        if reason in self.data["published_released"]:
            self.data["published_released"][reason] += 1

    def clone_and_reset(self) -> KvferryConnectorStats:
        """This interval's observations; the object starts a new interval."""
        old = copy.copy(self)
        self.reset()
        return old

    # vLLM's protocol
    def is_empty(self) -> bool:
        d = self.data
        return (
            not d["pull_seconds"]
            and not any(d["failed"].values())
            and not d["releases"]
            and not any(d["published_released"].values())
        )

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other.is_empty():
            return self
        o = other.data
        for k in ("pull_seconds", "pull_bytes", "pull_blocks"):
            self.data[k].extend(o.get(k, []))
        for k, v in o.get("failed", {}).items():
            self.data["failed"][k] = self.data["failed"].get(k, 0) + int(v)
        self.data["releases"] += int(o.get("releases", 0))
        for k, v in o.get("published_released", {}).items():
            self.data["published_released"][k] = self.data["published_released"].get(k, 0) + int(v)
        for field in ("pulled_by_dp", "failed_by_dp"):
            for k, v in o.get(field, {}).items():
                self.data[field][k] = self.data[field].get(k, 0) + int(v)
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        secs = sorted(d["pull_seconds"])
        total_bytes = sum(d["pull_bytes"])
        busy = sum(secs)

        def pct(p: float) -> float:
            return round(secs[min(len(secs) - 1, int(p * len(secs)))] * 1e3, 3) if secs else 0.0

        out: dict[str, int | float] = {
            "pulls": len(secs),
            "blocks": sum(d["pull_blocks"]),
            "mb": round(total_bytes / 1e6, 3),
            "pull_ms_p50": pct(0.5),
            "pull_ms_p99": pct(0.99),
            # Bytes over the summed pull time: the rate one pull sees, not wall-clock.
            "gbps_per_pull": round(total_bytes / busy / 1e9, 3) if busy > 0 else 0.0,
            "failed": sum(d["failed"].values()),
            "releases": d["releases"],
        }
        for k, v in d["failed"].items():
            if v:
                out[f"failed_{k}"] = v
        for k, v in d["published_released"].items():
            if v:
                out[f"published_{k}"] = v
        # Which prefill DP ranks the bytes came from, once there is more than rank 0.
        if (set(d["pulled_by_dp"]) | set(d["failed_by_dp"])) - {"0"}:
            for k, v in sorted(d["pulled_by_dp"].items()):
                out[f"mb_from_dp{k}"] = round(v / 1e6, 3)
            for k, v in sorted(d["failed_by_dp"].items()):
                if v:
                    out[f"failed_from_dp{k}"] = v
        return out


class KvferryPromMetrics(KVConnectorPromMetrics):
    """The Prometheus side (names in the module docstring), one child per engine."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        histogram: Any = self._histogram_cls  # vLLM types it as any of its metric classes

        def per_engine(metric: Any) -> dict[int, Any]:
            return {i: metric.labels(*values) for i, values in per_engine_labelvalues.items()}

        self.pull_seconds = per_engine(
            histogram(
                name="vllm:kvferry_pull_seconds",
                documentation="Time from a pull's first attempt until its bytes landed (kvferry).",
                buckets=[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0],
                labelnames=labelnames,
            )
        )
        self.pull_bytes = per_engine(
            histogram(
                name="vllm:kvferry_pull_bytes",
                documentation="Bytes landed per pull (kvferry).",
                buckets=[2 ** (12 + 2 * i) for i in range(12)],
                labelnames=labelnames,
            )
        )
        self.bytes_total = per_engine(
            self._counter_cls(name="vllm:kvferry_bytes", documentation="Bytes landed by pulls (kvferry).", labelnames=labelnames)
        )
        self.blocks_total = per_engine(
            self._counter_cls(name="vllm:kvferry_blocks", documentation="KV blocks landed by pulls (kvferry).", labelnames=labelnames)
        )
        self.releases_total = per_engine(
            self._counter_cls(
                name="vllm:kvferry_releases",
                documentation="Prefill instances told to free blocks a decode will not pull (kvferry).",
                labelnames=labelnames,
            )
        )
        failed = self._counter_cls(
            name="vllm:kvferry_failed_pulls",
            documentation="Pulls that became load errors, by the kind of their last error (kvferry).",
            labelnames=[*labelnames, "kind"],
        )
        self.failed = {kind: per_engine_kind(failed, per_engine_labelvalues, kind) for kind in FAILURE_KINDS}
        released = self._counter_cls(
            name="vllm:kvferry_publications_released",
            documentation="Prefill publications released, by reason (done: pulled; expired: the lease ran out) (kvferry).",
            labelnames=[*labelnames, "reason"],
        )
        self.released = {r: per_engine_kind(released, per_engine_labelvalues, r) for r in RELEASE_REASONS}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = KvferryConnectorStats(data=transfer_stats_data).data
        for s in d["pull_seconds"]:
            self.pull_seconds[engine_idx].observe(s)
        for b in d["pull_bytes"]:
            self.pull_bytes[engine_idx].observe(b)
        self.bytes_total[engine_idx].inc(sum(d["pull_bytes"]))
        self.blocks_total[engine_idx].inc(sum(d["pull_blocks"]))
        self.releases_total[engine_idx].inc(d["releases"])
        for kind, n in d["failed"].items():
            if n and kind in self.failed:
                self.failed[kind][engine_idx].inc(n)
        for reason, n in d["published_released"].items():
            if n and reason in self.released:
                self.released[reason][engine_idx].inc(n)


def per_engine_kind(metric: Any, per_engine_labelvalues: dict[int, list[object]], extra: str) -> dict[int, Any]:
    """Children of a metric with one extra label after the engine's labels."""
    return {i: metric.labels(*values, extra) for i, values in per_engine_labelvalues.items()}


__all__ = ["KvferryConnectorStats", "KvferryPromMetrics", "failure_kind", "FAILURE_KINDS", "RELEASE_REASONS"]
