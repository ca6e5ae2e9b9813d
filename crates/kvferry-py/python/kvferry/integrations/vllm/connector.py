"""``KvferryConnector``: the facade vLLM loads, delegating to the scheduler side
(:mod:`.scheduler`) or the worker side (:mod:`.worker`) by role."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.logger import init_logger

from .config import VLLM_VERSION
from .metadata import KvferryConnectorMetadata
from .scheduler import KvferryConnectorScheduler
from .stats import KvferryConnectorStats, KvferryPromMetrics
from .worker import KvferryConnectorWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats, PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


class KvferryConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM V1 KV connector moving prefill KV to decode instances with kvferry.

    One class, two roles (vLLM creates it once in the scheduler and once per worker);
    each role delegates to :class:`KvferryConnectorScheduler` or
    :class:`KvferryConnectorWorker`. Configuration: see this module's docstring.
    """

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """``LBHNC`` (heads outside tokens) for MHA/GQA caches: a head slice of a
        block — what a decode of another TP size reads — is then one run of
        ``block_size`` cells per head instead of one run per token, which cuts a
        heterogeneous read's byte ranges ``block_size``-fold; it is also the only
        layout vLLM's CPU backend reads. vLLM uses it wherever every backend supports
        it, and otherwise warns and picks another: ``layout`` maps ``LBNHC`` too
        and refuses the rest by name. None for MLA (one head slot: both orders are
        the same bytes)."""
        mc = vllm_config.model_config
        if mc is not None and bool(getattr(mc, "use_mla", False)):
            return None
        return "LBHNC"

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        try:
            import vllm

            if vllm.__version__ != VLLM_VERSION:
                logger.warning("KvferryConnector is pinned to vllm==%s; this is %s", VLLM_VERSION, vllm.__version__)
        except Exception:  # pragma: no cover
            pass
        self.connector_scheduler: KvferryConnectorScheduler | None = None
        self.connector_worker: KvferryConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KvferryConnectorScheduler(vllm_config, kv_cache_config)
        else:
            self.connector_worker = KvferryConnectorWorker(vllm_config, kv_cache_config)

    def _s(self) -> KvferryConnectorScheduler:
        assert self.connector_scheduler is not None, "scheduler-side method called on a worker connector"
        return self.connector_scheduler

    def _w(self) -> KvferryConnectorWorker:
        assert self.connector_worker is not None, "worker-side method called on a scheduler connector"
        return self.connector_worker

    # scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._s().get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # The request's own blocks are transferred: every transfer group is restored.
        return tuple(self._kv_cache_config.transfer_group_ids)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._s().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._s().build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._s().request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        # Hybrid allocator: one block list per KV cache group (vllm_hetero.py).
        return self._s().request_finished(request, [list(g) for g in block_ids])

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._s().update_connector_output(connector_output)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self._s().set_xfer_handshake_metadata(metadata)

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._w().register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._w().get_handshake_metadata() if self.connector_worker is not None else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvferryConnectorMetadata)
        self._w().start_step(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Pulls land between steps (asynchronous loads): nothing to wait for per layer.
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        # Nothing is copied while computing: finished requests' blocks are published
        # zero copy (request_finished), and peers read them in place.
        return

    def wait_for_save(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.mark_step_computed()
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, KvferryConnectorMetadata):
                self._w().start_step(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._w().transfer_results(finished_req_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self._w().transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._w().take_load_errors()

    # metrics (stats.py): taken after every step, combined across workers
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        w = self.connector_worker
        if w is None or w.stats.is_empty():
            return None
        return w.stats.clone_and_reset()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvferryConnectorStats(data=data) if data is not None else KvferryConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvferryPromMetrics:
        return KvferryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
