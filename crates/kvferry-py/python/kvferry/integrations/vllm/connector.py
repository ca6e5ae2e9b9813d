"""``KvferryConnector``: the facade vLLM loads, delegating to the scheduler side
(:mod:`.scheduler`) or the worker side (:mod:`.worker`) by role."""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from . import versions

# Refused at load, before anything of vLLM's connector API is imported: another
# version's API differs (versions.py lists the supported ones and what each gets).
SUPPORT = versions.check_installed()

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.logger import init_logger  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from . import preemption, sleep  # noqa: E402
from .metadata import KvferryConnectorMetadata  # noqa: E402
from .scheduler import KvferryConnectorScheduler  # noqa: E402
from .stats import KvferryConnectorStats, KvferryPromMetrics  # noqa: E402
from .worker import KvferryConnectorWorker  # noqa: E402

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
    from vllm.distributed.kv_transfer.kv_connector.v1.base import CopyBlocksOp, KVConnectorWorkerMetadata
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
    What each of vLLM 0.33's hooks does here, beside NixlConnector: docs/vllm.md,
    "Compatibility with vLLM 0.33's connector hooks".
    """

    # Remote hits are another instance's KV pulled over the network: vLLM's prefix
    # cache stats count them as ``p2p`` (PrefixCacheStats.hits_by_source).
    _cache_hit_source = CacheHitSource.P2P

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """True: :mod:`.sleep` drains and deregisters the KV cache, then registers it
        again on wake-up; the engine (address, incarnation) stays up."""
        return True

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """False: nothing runs inside the forward (``wait_for_layer_load`` and
        ``save_kv_layer`` do nothing; pulls land between steps and publications are
        zero copy), so full CUDA graphs capture nothing of kvferry's."""
        return False

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

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: KVTransferConfig) -> Any:
        """vLLM 0.34: ``KVCacheAccess.IN_PROCESS``. kvferry's workers reach the KV
        cache in process only: CPU caches are read and written in place, CUDA caches
        through kvferry's own device copies on its own stream (the engine checks that
        each byte is device memory, walking adjacent mappings, so a driver-mapped
        extensible cache of several physical chunks per segment is fine). Nothing is
        registered with UCX or RDMA, nothing exported to another process (a same-host
        decode reads the prefill's *host* memory, never device memory), so vLLM may
        allocate the cache any way, the extensible KV cache included."""
        access: Any = importlib.import_module("vllm.config.kv_transfer").KVCacheAccess
        return access.IN_PROCESS

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """vLLM 0.34: True. Lookahead hashes change what vLLM's block hashes cover;
        kvferry keys nothing by them (a publication's key is the request id bound to
        a digest of its prompt tokens, :mod:`.prompt`) and emits no KV cache events
        (:meth:`take_events`), so either setting moves the same blocks."""
        return True

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
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

    def may_load_async(self, request: Request) -> bool:
        """vLLM 0.34: whether ``get_num_new_matched_tokens`` may answer
        asynchronously for ``request`` — only remote prefills kvferry can pull
        (:meth:`.KvferryConnectorScheduler.may_load_async`; cheap, no side effects)."""
        return self._s().may_load_async(request)

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

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]) -> None:
        """Every worker's handshake by ``(pp_rank, tp_rank)``, as vLLM 0.33's engine
        core collects them: pipeline parallel is supported (:mod:`.parallel`: each
        stage publishes, and each decode stage pulls, only that stage's layers)."""
        self._s().set_handshakes(metadata)

    def has_pending_block_frees(self) -> bool:
        """False: vLLM then preempts rather than waits. Blocks kvferry holds are
        publications (freed when a decode reads or releases them, or at lease
        expiry, up to ``lease_ttl``) and pulls (which become the request's own when
        they land): neither frees in a time the scheduler could wait for without
        stalling every request behind a decode that never comes."""
        return False

    def take_events(self) -> Iterable[KVCacheEvent]:
        """None: kvferry keeps no cache of its own. A publication is one request's
        blocks for one reader (not a prefix another request can hit), and pulled
        blocks enter vLLM's prefix cache, whose own ``BlockStored`` events announce
        them once the load completes."""
        return ()

    # worker side
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Stops every pull into, and every publication of, the step's preempted
        requests' blocks before the forward may overwrite them (:mod:`.preemption`)."""
        if self.connector_worker is not None:
            preemption.handle_preemptions(self.connector_worker, kv_connector_metadata)

    def unregister_kv_caches(self) -> None:
        """Before sleep: drain (bounded), withdraw, deregister (:mod:`.sleep`)."""
        if self.connector_worker is not None:
            sleep.unregister(self.connector_worker)

    def restore_kv_caches(self) -> None:
        """After wake-up: the KV cache registered again (:mod:`.sleep`)."""
        if self.connector_worker is not None:
            sleep.restore(self.connector_worker)

    def set_host_xfer_buffer_ops(self, copy_operation: CopyBlocksOp) -> None:
        """Unused: kvferry stages device KV through its own pinned host arena with its
        own bounded device copies (docs/vllm.md, "Host buffers")."""
        return

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """None: everything the scheduler half needs travels in the transfer results
        (finished and failed sets, load errors) and the stats."""
        return None

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        """None: no events of kvferry's own (see :meth:`take_events`)."""
        return None

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
