"""The shared harness of the vLLM connector tests: a vLLM instance minus the model.

An :class:`Instance` is one real vLLM ``Scheduler`` (0.34.0 or 0.33.0, whichever is
installed) plus one worker-side ``KvferryConnector`` per tensor-parallel rank (each its
own kvferry engine, address and KV shard), made by vLLM's ``KVConnectorFactory`` and
driven the way that vLLM's model runner drives its connector
(:class:`kvferry.integrations.vllm.runner.ConnectorDriver` around a "forward": 0.33's
``KVConnectorModelRunnerMixin``, 0.34's ``ActiveKVConnector``); the ranks' outputs are combined by vLLM's ``KVOutputAggregator``. The
"forward" writes, into every rank's cache, bytes that depend only on (token, position,
layer, K/V, *global* KV head, salt): a decode rank's reference is assembled from its own
heads, in its own layout and block size, so a read from the wrong rank, head, token
range or layout cannot pass. The prefill writes salt 1 and the decode salt 2, so a
position the decode computed itself never passes for one that was pulled.

KV tensors are allocated by vLLM's own code (:func:`allocate`: ``resolve_kv_cache_layout``,
``get_kv_cache_configs``, ``allocate_kv_cache``) for an attention backend's real layers,
and written and read through that backend's own K/V views (:func:`kv_views`).

Variants: attention backend (``BACKENDS``), KV cache layout ``LBHNC``/``LBNHC``, any block size,
replicated heads (TP > KV heads), MLA (:class:`Instance` with ``mla=True``: one latent
cache per layer, the same on every rank) and the hybrid allocator
(:class:`HybridInstance`: a full-attention and a sliding-window group).

:class:`RemoteInstance` (:mod:`vllm_process`) runs an instance in a spawned process (its
own engine loop, answering commands between steps), so a test can SIGKILL it.
:func:`one_rank` and :func:`prefill_process` make the lifecycle suites' instance: one
rank of tiny-llama with the connector's own option defaults.

The pytest fixtures (``need_vllm``, ``made``, ``kv_device``, ``prefill``, ``decode``) live
in ``conftest.py``; a test file imports what it calls from here and never another test
file. Needs vLLM: without it ``need_vllm`` skips, unless ``KVFERRY_REQUIRE_VLLM=1`` (then
it fails).
"""

from __future__ import annotations

import contextlib
import copy
import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

SUITE_VERSIONS = ("0.34.0", "0.33.0")  # this suite runs on either (versions.py: the CPU build is real_serving's)
_HOW = (
    "install one with scripts/install-vllm.sh [--version 0.34.0] (a venv with vllm 0.33.0 or 0.34.0 and kvferry "
    "built in) and run pytest from that venv"
)


def _find_vllm() -> str | None:
    """Why the vLLM tests cannot run here, or None."""
    try:
        import vllm
    except ImportError as e:
        return f"vLLM is not installed ({e}); {_HOW}"
    version = getattr(vllm, "__version__", None)
    if version is None:
        # Without vLLM, `import vllm` can find this very test folder as a namespace
        # package (pytest puts tests/ on sys.path): that is "not installed".
        return f"vLLM is not installed; {_HOW}"
    if version not in SUITE_VERSIONS:
        return f"this suite runs on vllm {' or '.join(SUITE_VERSIONS)}, found {version}; {_HOW}"
    return None


WHY_NOT = _find_vllm()
REQUIRED = os.environ.get("KVFERRY_REQUIRE_VLLM") == "1"


def need_vllm() -> None:
    """Skips (or, with KVFERRY_REQUIRE_VLLM=1, fails) the calling test when neither vLLM
    0.34.0 nor 0.33.0 is installed: the body of conftest.py's fixture of the same name."""
    if WHY_NOT is not None:
        if REQUIRED:
            pytest.fail(f"KVFERRY_REQUIRE_VLLM=1 but {WHY_NOT}", pytrace=False)
        pytest.skip(WHY_NOT)


HERE = Path(__file__).parent
MODEL_DIR = str(HERE / "tiny-llama")  # 2 KV heads (4 query heads), head size 16, 2 layers
KV4 = str(HERE / "tiny-llama-kv4")  # 4 KV heads (8 query heads)
KV2 = MODEL_DIR
HEAD32 = str(HERE / "head32" / "tiny-llama")  # as tiny-llama, head size 32
MLA_MODEL = str(HERE / "tiny-deepseek")  # MLA: latent 32 + rope 16 = head size 48
NUM_LAYERS = 2
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
HEAD_SIZE = 16
PREFILL_SALT = 1
DECODE_SALT = 2


def prompts(n: int, seed: int, lo: int = 20, hi: int = 120) -> list[tuple[str, list[int]]]:
    """``n`` requests ``(req_id, prompt)`` of ``lo..hi`` random tokens."""
    rng = random.Random(seed)
    return [(f"req-{seed}-{i}", [rng.randrange(3, 1000) for _ in range(rng.randrange(lo, hi))]) for i in range(n)]


def pattern(token: int, pos: int, layer: int, kv: int, head: int, nbytes: int, salt: int = 0) -> Any:
    """The bytes a "forward" writes for one token's K or V of one global head in one
    layer (a ``uint8`` tensor of ``nbytes``)."""
    import torch

    base = (token * 7 + pos * 13 + layer * 29 + kv * 101 + head * 57 + salt * 53) % 256
    return (torch.arange(nbytes, dtype=torch.int32) * 3 + base).remainder(256).to(torch.uint8)


def heads_of(rank: int, tp: int, heads: int) -> tuple[int, int]:
    """The global KV heads ``[a, b)`` rank ``rank`` of ``tp`` holds (replicated when
    ``tp > heads``)."""
    if tp <= heads:
        return rank * heads // tp, (rank + 1) * heads // tp
    h = rank * heads // tp
    return h, h + 1


def scheduler_leaks(scheduler: Any) -> list[str]:
    """What vLLM's own ``assert_scheduler_empty`` (tests/v1/kv_connector/unit/utils.py)
    checks, as a list of what is left over (empty: no leak): no request, nothing waiting
    or running, no finished ids pending, the encoder cache empty, no request holding
    blocks in any KV cache group, every block but the null block free, and every
    block's ref_cnt 0."""
    left = []
    for name in ("requests", "waiting", "kv_holding_waiting", "running", "finished_req_ids", "finished_recving_kv_req_ids"):
        n = len(getattr(scheduler, name))
        if n:
            left.append(f"{name}: {n}")
    ecm = scheduler.encoder_cache_manager
    for name in ("freed", "cached"):
        if len(getattr(ecm, name)):
            left.append(f"encoder_cache_manager.{name}: {len(getattr(ecm, name))}")
    for gi, mgr in enumerate(scheduler.kv_cache_manager.coordinator.single_type_managers):
        if mgr.req_to_blocks:
            left.append(f"group {gi} req_to_blocks: {sorted(mgr.req_to_blocks)}")
        if mgr.num_cached_block:
            left.append(f"group {gi} num_cached_block: {sorted(mgr.num_cached_block)}")
    pool = scheduler.kv_cache_manager.block_pool
    if pool.free_block_queue.num_free_blocks != pool.num_gpu_blocks - 1:
        left.append(f"free blocks {pool.free_block_queue.num_free_blocks} != {pool.num_gpu_blocks - 1}")
    held = [b.block_id for b in pool.blocks if b.ref_cnt != 0]
    if held:
        left.append(f"blocks with ref_cnt != 0: {held[:10]}")
    return left


# -- KV caches as vLLM allocates them: kvferry.integrations.vllm.alloc ------------------

from kvferry.integrations.vllm.alloc import (  # noqa: E402 - after the environment defaults above
    BACKENDS,
    allocate,
    attention_layers,
    backend_class,
    kv_views,
)
from kvferry.integrations.vllm.runner import ConnectorDriver, model_runner_output  # noqa: E402
from vllm_process import RemoteInstance  # noqa: E402 - re-exported: the harness's instance in a process

# The socket mover unless KVFERRY_TEST_TRANSPORT says otherwise: the suites inject
# socket send delays and count bytes on the wire; test_connector_same_host.py runs the
# connector with the same-host mover its users get by default.
TRANSPORT = os.environ.get("KVFERRY_TEST_TRANSPORT", "tcp")
# ``kv_connector_extra_config`` an :class:`Instance` starts from, unless told otherwise.
EXTRA_DEFAULTS: dict[str, Any] = {"timeout": 10.0, "lease_ttl": 30.0, "arena_bytes": 4 << 20}


def on_backend(kw: dict[str, Any], backend: str) -> dict[str, Any]:
    """A case's instance arguments on ``backend``: ``layout`` HND/NHD as vLLM's
    ``LBHNC``/``LBNHC``; on the CPU backend (LBHNC only, blocks of multiples of 32)
    block sizes doubled and no layout forced. A case naming its backend keeps it."""
    out = dict(kw)
    if "backend" in out:
        lay = out.pop("layout", None)
        if lay:
            out["kv_layout"] = {"HND": "LBHNC", "NHD": "LBNHC"}[lay]
        return out
    out["backend"] = backend
    lay = out.pop("layout", None)
    if backend == "CPU_ATTN":
        out["block_size"] = 2 * out.get("block_size", 16)
    elif lay:
        out["kv_layout"] = {"HND": "LBHNC", "NHD": "LBNHC"}[lay]
    return out



class Instance:
    """A real scheduler plus one worker-side connector per TP rank (module docs).

    ``backend``: the attention backend whose KV cache the ranks hold (``BACKENDS``;
    ``CPU_ATTN`` needs a block size that is a multiple of 32). ``kv_layout``: a
    ``KVCacheLayout`` name forced on the cache config (default: what vLLM resolves,
    honouring the connector's request); ``layout`` ``HND``/``NHD`` says the same as
    ``LBHNC``/``LBNHC``. Every rank's KV tensors are allocated by vLLM's
    own code (:func:`allocate`) and written and read through the backend's own K/V
    views (:func:`kv_views`). ``mla``: one latent cache per layer, identical on every
    rank. ``extra``: ``kv_connector_extra_config`` over ``extra_defaults`` (default
    :data:`EXTRA_DEFAULTS`: ``timeout`` 10 s, ``lease_ttl`` 30 s and a 4 MiB arena; ``{}``:
    the connector's own defaults). ``log_stats``: vLLM's ``SchedulerStats`` per step in
    :attr:`scheduler_stats`; ``kv_events``: a ``vllm.config.KVEventsConfig``.

    What a test reads after steps: ``final`` (rid -> the output that finished it),
    ``tokens`` (rid -> tokens sampled), ``finished_sending``/``finished_recving`` (rid ->
    when it was first reported, monotonic), ``failed_recving``, ``invalid_blocks``,
    ``landed`` (rid -> rank -> prompt position -> the slot's bytes when it landed),
    ``stats`` (the combined connector stats of every step, as dicts) and ``kv_stats``
    (the same, aggregated by the connector's stats class), ``last_output`` (the last
    ``SchedulerOutput``). :attr:`worker`/:attr:`connector`: rank 0's."""

    def __init__(
        self,
        role: str,
        *,
        tp: int = 1,
        model: str = KV4,
        kv_heads: int = 4,
        block_size: int = 16,
        backend: str = "FLASH_ATTN",
        kv_layout: str | None = None,
        layout: str | None = None,
        head_size: int = HEAD_SIZE,
        mla: bool = False,
        extra: dict[str, Any] | None = None,
        num_blocks: int = 96,
        policy: str = "recompute",
        salt: int | None = None,
        tag: str = "",
        windows: dict[str, int] | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 4096,
        log_stats: bool = False,
        kv_events: Any = None,
        extra_defaults: dict[str, Any] | None = None,
        pp: int = 1,
        dp_rank: int = 0,
        dp_size: int = 1,
        dp_moe: bool = False,
        engine_id: str | None = None,
    ) -> None:
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        if layout is not None:  # the per-piece names: heads outside tokens (HND) or inside (NHD)
            kv_layout = {"HND": "LBHNC", "NHD": "LBNHC"}[layout]
        self.role = role
        self.tp, self.bs, self.hs, self.mla = tp, block_size, head_size, mla
        self.pp = pp  # pipeline stages: worker w is stage w // tp, TP rank w % tp (see the end)
        self.backend = "MLA" if mla else backend
        self.kv_heads = 1 if mla else kv_heads
        self.hpr = 1 if mla else max(1, kv_heads // tp)
        self.kvs = (0,) if mla else (0, 1)  # K and V per layer (MLA: one latent)
        self.salt = salt if salt is not None else (PREFILL_SALT if role == "kv_producer" else DECODE_SALT)
        defaults = EXTRA_DEFAULTS if extra_defaults is None else extra_defaults
        extra = {**defaults, "transport": TRANSPORT, **(extra or {})}
        engine_id = engine_id or f"h-{role}-{tp}-{block_size}-{backend}-{kv_layout}-{tag}-{os.getpid()}-{id(self)}"

        def config(rank: int) -> VllmConfig:
            cfg = VllmConfig(
                model_config=ModelConfig(model=model, skip_tokenizer_init=True, dtype="float16", max_model_len=1024, seed=0),
                cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
                scheduler_config=SchedulerConfig(
                    max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens,
                    max_model_len=1024,
                    is_encoder_decoder=False,
                ),
                parallel_config=ParallelConfig(
                    tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp_size, data_parallel_rank=dp_rank
                ),
                device_config=DeviceConfig("cpu"),
                kv_transfer_config=KVTransferConfig(
                    kv_connector="KvferryConnector",
                    kv_connector_module_path="kvferry.integrations.vllm",
                    kv_role=role,
                    kv_connector_extra_config=extra,
                    kv_load_failure_policy=policy,
                    engine_id=engine_id,
                ),
                kv_events_config=kv_events,
            )
            cfg.parallel_config.rank = rank  # as vLLM sets it in each worker process
            if dp_size > 1:
                as_dp_engine_core(cfg, dp_rank, dp_moe)
            if windows:
                # vLLM keeps its hybrid allocator on for a connector that supports it
                # on the CPU and CUDA platforms; this CUDA wheel without a GPU is the
                # "unspecified" platform, which turns it off: decide as those do.
                cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
            return cfg

        # One config per rank process; the scheduler's is rank 0's.
        configs = [config(r) for r in range(tp * pp)]
        self.vllm_config = configs[0]
        if mla:
            assert self.vllm_config.model_config.use_mla, "the MLA model config did not turn MLA on"
        if pp > 1:  # each stage's workers hold only that stage's layers
            self.kv_cache_config, self.worker_kv_cache_configs, caches, self.kv_layout = stage_caches(self, configs, num_blocks, kv_layout)
        else:
            specs, backends = self.specs(configs, windows)
            self.kv_cache_config, caches, self.kv_layout = allocate(configs, specs, backends, num_blocks, kv_layout)
            self.worker_kv_cache_configs = [self.kv_cache_config] * tp
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=block_size,
            log_stats=log_stats,
        )
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(block_size, sha256)
        self.ranks: list[Any] = []
        self.drivers: list[Any] = []  # each rank's connector driven as the installed vLLM's model runner drives it
        self.kv: list[dict[str, Any]] = []
        self.kvv: list[dict[str, tuple[Any, ...]]] = []  # rank -> layer -> (K, V) [blocks, tokens, heads, hs]
        for r in range(tp * pp):
            c = KVConnectorFactory.create_connector(configs[r], KVConnectorRole.WORKER, self.worker_kv_cache_configs[r])
            kv = caches[r]
            c.register_kv_caches(kv)
            assert c.connector_worker.tp_rank == r % tp
            self.ranks.append(c)
            self.drivers.append(ConnectorDriver(c, configs[r], kv))
            self.kv.append(kv)
            self.kvv.append({n: kv_views(self.backend, t, head_size, mla) for n, t in kv.items()})
        hs = {(r // tp, r % tp): c.get_handshake_metadata() for r, c in enumerate(self.ranks)}
        self.scheduler.get_kv_connector().set_xfer_handshake_metadata_pp_aware(hs)
        self.aggregator = KVOutputAggregator(expected_finished_count=tp * pp)
        self.free_at_start = self.free_blocks()
        self.final: dict[str, Any] = {}
        self.tokens: dict[str, list[int]] = {}
        self.finished_sending: dict[str, float] = {}
        self.finished_recving: dict[str, float] = {}
        self.failed_recving: set[str] = set()
        # Per rank, before vLLM's aggregator: when each rank reported a request failed.
        self.rank_failed: list[dict[str, float]] = [{} for _ in range(tp * pp)]
        self.rank_stats: list[list[dict[str, Any]]] = [[] for _ in range(tp * pp)]  # per rank, per step
        self.invalid_blocks: set[int] = set()
        self.landed: dict[str, list[list[list[bytes]]]] = {}  # rid -> rank -> pos -> per (layer, kv, head)
        self.landed_groups: dict[str, list[list[int]]] = {}  # rid -> its blocks per group when it landed
        # rid -> [rank][layer][pos] -> that slot's bytes when it landed (several groups)
        self.landed_layers: dict[str, list[list[list[list[bytes] | None]]]] = {}
        self.stats: list[dict[str, Any]] = []
        self.kv_stats = type(self.ranks[0]).build_kv_connector_stats()
        self.scheduler_stats: list[Any] = []  # vLLM's SchedulerStats per step (log_stats)
        self.last_output: Any = None

    # -- what a subclass may change -----------------------------------------------------

    def specs(self, configs: list[Any], windows: dict[str, int] | None) -> tuple[dict[str, Any], list[Any]]:
        """Every layer's KV cache spec and the attention backend classes: from vLLM's
        real ``Attention`` layers, made in every rank's config (MLA: the spec an MLA
        layer reports — its layer class needs a TP group to construct — and Triton
        MLA's backend class)."""
        import torch
        from vllm.v1.kv_cache_interface import MLAAttentionSpec

        if self.mla:
            from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend

            spec = MLAAttentionSpec(block_size=self.bs, num_kv_heads=1, head_size=self.hs, dtype=torch.float16)
            return {n: spec for n in LAYERS}, [TritonMLABackend]
        mc, pc = configs[0].model_config, configs[0].parallel_config
        q_heads = int(mc.get_num_attention_heads(pc))
        layers = {}
        for cfg in configs:
            layers = attention_layers(cfg, self.backend, q_heads, self.hpr, self.hs, windows, LAYERS)
        return {n: layer.get_kv_cache_spec(configs[0]) for n, layer in layers.items()}, [backend_class(self.backend)]

    def layer_group(self, layer: int, ngroups: int) -> int:
        """The KV cache group of layer ``layer``."""
        return layer if ngroups > 1 else 0

    # -- driving it ---------------------------------------------------------------------

    def free_blocks(self) -> int:
        return int(self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    def leaks(self) -> list[str]:
        """:func:`scheduler_leaks` after one more step (which hands the last finished
        ids to the workers, as vLLM's tests step before ``assert_scheduler_empty``)."""
        self.step()
        return scheduler_leaks(self.scheduler)

    def add(
        self, req_id: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None, **sampling: Any
    ) -> None:
        """Adds a request (``sampling``: more ``SamplingParams``)."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, extra_args={"kv_transfer_params": params} if params else None, **sampling
        )
        self.scheduler.add_request(Request(req_id, list(prompt), sp, None, block_hasher=self.hasher))

    def status(self, req_id: str) -> Any:
        """The request's ``RequestStatus``, or None once the scheduler dropped it."""
        r = self.scheduler.requests.get(req_id)
        return None if r is None else r.status

    @property
    def connector(self) -> Any:
        """Rank 0's worker-side connector (the only one at ``tp=1``)."""
        return self.ranks[0]

    @property
    def worker(self) -> Any:
        """Rank 0's connector worker (the only one at ``tp=1``)."""
        return self.ranks[0].connector_worker

    def abort(self, req_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    def raw(self, rank: int, layer: str, kvi: int, block: int, off: int, head: int) -> Any:
        """The bytes of one token's K (``kvi`` 0) or V (1) vector of one rank-local
        head (MLA: the latent), as the backend reads them."""
        import torch

        return self.kvv[rank][layer][kvi][block, off, head].view(torch.uint8)

    def first_head(self, rank: int) -> int:
        return 0 if self.mla else heads_of(rank % self.tp, self.tp, self.kv_heads)[0]

    def step(self) -> None:
        so = self.scheduler.schedule()
        self.last_output = so
        req_ids = list(so.num_scheduled_tokens)
        outs = []
        now = time.monotonic()
        for rank, driver in enumerate(self.drivers):
            sampled: list[list[int]] = []
            a = self.first_head(rank)
            # This "process"'s worker, as the model runner drives it (preemptions
            # handled before the forward).
            with driver.step(so) as kvo:
                for rid in req_ids:  # the "forward": KV for every scheduled token
                    req = self.scheduler.requests[rid]
                    n = so.num_scheduled_tokens[rid]
                    end = req.num_computed_tokens  # already advanced by schedule()
                    groups = self.scheduler.kv_cache_manager.get_block_ids(rid)
                    toks = req.all_token_ids
                    for pos in range(end - n, end):
                        for li, name in enumerate(LAYERS):
                            if name not in self.kvv[rank]:  # another pipeline stage's layer
                                continue
                            blocks = groups[self.layer_group(li, len(groups))]
                            b, off = blocks[pos // self.bs], pos % self.bs
                            for kvi in self.kvs:
                                for hh in range(self.hpr):
                                    self.raw(rank, name, kvi, b, off, hh).view(-1)[:] = pattern(
                                        toks[pos], pos, li, kvi, a + hh, self.hs * 2, self.salt
                                    )
                    sampled.append([3 + (end * 17) % 1000] if end >= req.num_tokens else [])
            for rid in kvo.failed_recving or ():
                self.rank_failed[rank].setdefault(rid, now)
            if kvo.kv_connector_stats is not None:
                # A copy: vLLM's aggregator adds the other ranks' into rank 0's in place.
                self.rank_stats[rank].append(copy.deepcopy(kvo.kv_connector_stats.to_dict()))
            outs.append(model_runner_output(req_ids, sampled, kvo))
        mro = self.aggregator.aggregate(outs)
        kvo = mro.kv_connector_output
        if kvo.kv_connector_stats is not None:  # every rank's stats, combined by vLLM
            self.stats.append(kvo.kv_connector_stats.to_dict())
            self.kv_stats.aggregate(kvo.kv_connector_stats)
        now = time.monotonic()
        for rid in kvo.finished_sending or ():
            self.finished_sending[rid] = now
        for rid in kvo.finished_recving or ():
            self.finished_recving[rid] = now
        self.failed_recving |= kvo.failed_recving or set()
        self.invalid_blocks |= kvo.invalid_block_ids or set()
        for outs_ in self.scheduler.update_from_output(so, mro).values():
            if outs_.scheduler_stats is not None:  # log_stats: what vLLM's stat loggers get
                self.scheduler_stats.append(outs_.scheduler_stats)
            for o in outs_.outputs:
                self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.final[o.request_id] = o
        for rid in kvo.finished_recving or ():
            req = self.scheduler.requests.get(rid)
            if req is not None and not req.is_finished() and rid not in (kvo.failed_recving or ()):
                # Snapshot before the next step's forward touches the request.
                groups = self.scheduler.kv_cache_manager.get_block_ids(rid)
                self.landed_groups[rid] = [list(g) for g in groups]
                if len(groups) > 1:
                    # Per rank, layer and prompt position: the slot's bytes, or None
                    # where the layer's group holds no block (a sliding window's
                    # null block 0). A later forward recomputes the last token and a
                    # sliding group frees and reuses blocks, so read them now.
                    per_layer = [groups[self.layer_group(li, len(groups))] for li in range(len(LAYERS))]
                    self.landed_layers[rid] = [
                        [
                            [self.layer_slot(rank, li, per_layer[li], pos) for pos in range(req.num_prompt_tokens)]
                            for li in range(len(LAYERS))
                        ]
                        for rank in range(self.tp)
                    ]
                    continue
                (blocks,) = groups
                self.landed[rid] = [
                    [self.slot(rank, blocks, pos) for pos in range(req.num_prompt_tokens)] for rank in range(len(self.ranks))
                ]

    def slot(self, rank: int, blocks: list[int], pos: int) -> list[bytes]:
        b, off = blocks[pos // self.bs], pos % self.bs
        return [
            bytes(self.raw(rank, n, kvi, b, off, hh).reshape(-1).numpy())
            for n in LAYERS
            if n in self.kvv[rank]  # a pipeline stage's worker: its layers only
            for kvi in self.kvs
            for hh in range(self.hpr)
        ]

    def layer_slot(self, rank: int, li: int, blocks: list[int], pos: int) -> list[bytes] | None:
        """One layer's slot at ``pos`` (per K/V, per rank-local head), or None where the
        group holds no block for it."""
        i = pos // self.bs
        if i >= len(blocks) or blocks[i] == 0:
            return None
        return [
            bytes(self.raw(rank, LAYERS[li], kvi, blocks[i], pos % self.bs, hh).reshape(-1).numpy())
            for kvi in self.kvs
            for hh in range(self.hpr)
        ]

    def expected(self, prompt: list[int], rank: int, pos: int, salt: int = PREFILL_SALT) -> list[bytes]:
        """What rank ``rank`` holds at ``pos`` once the prefill's bytes landed."""
        a = self.first_head(rank)
        return [
            bytes(pattern(prompt[pos], pos, li, kvi, a + hh, self.hs * 2, salt).numpy())
            for li in range(len(LAYERS))
            if LAYERS[li] in self.kvv[rank]  # a pipeline stage's worker: its layers only
            for kvi in self.kvs
            for hh in range(self.hpr)
        ]

    def run_until(self, pred: Callable[[], bool], timeout: float, what: str) -> float:
        t0 = time.monotonic()
        while not pred():
            if time.monotonic() - t0 > timeout:
                pulls = [{r: (p.attempts, p.transfer, p.error) for r, p in w._pulls.items()} for w in self.workers()]
                raise AssertionError(
                    f"timed out after {timeout}s waiting for {what}; pulls in flight per rank: {pulls}; "
                    f"received: {sorted(self.finished_recving)}; failed: {sorted(self.failed_recving)}"
                )
            self.step()
            time.sleep(0.002)
        return time.monotonic() - t0

    def held(self) -> set[str]:
        return set(self.scheduler.requests)

    def workers(self) -> list[Any]:
        return [c.connector_worker for c in self.ranks]

    def close(self) -> None:
        for c in self.ranks:
            c.shutdown()


class HybridInstance(Instance):
    """An :class:`Instance` whose layer 1 is a sliding window of ``window`` tokens and
    layer 0 full attention: vLLM groups them in two KV cache groups, whose pages its
    allocator overlays (the hybrid allocator)."""

    def __init__(self, role: str, *, window: int = 32, **kw: Any) -> None:
        self.window = window
        kw.setdefault("model", KV4)
        kw.setdefault("kv_heads", 4)
        kw["windows"] = {LAYERS[1]: window}
        # Two groups share the pool: vLLM admits a 1,024-token model only with enough
        # blocks for both.
        kw.setdefault("num_blocks", 192)
        super().__init__(role, **kw)


@contextlib.contextmanager
def made() -> Iterator[list[Any]]:
    """A list to append instances to; on exit each is closed (a :class:`RemoteInstance`
    stopped): the body of conftest.py's fixture of the same name."""
    out: list[Any] = []
    try:
        yield out
    finally:
        for i in out:
            if isinstance(i, RemoteInstance):
                i.stop()
            else:
                i.close()


# -- one rank of tiny-llama, the instance of the lifecycle suites -------------------------

BLOCK_SIZE = 16
# test_connector.py, test_connector_drain.py, test_connector_hooks.py and
# test_vllm_lifecycle.py: one rank of tiny-llama (2 KV heads), room for many requests,
# and the connector's own option defaults.
ONE_RANK: dict[str, Any] = {
    "model": KV2,
    "kv_heads": 2,
    "block_size": BLOCK_SIZE,
    "num_blocks": 512,
    "max_num_seqs": 128,
    "max_num_batched_tokens": 8192,
    "extra_defaults": {},
}


def one_rank(role: str, extra: dict[str, Any], **kw: Any) -> Instance:
    """A :data:`ONE_RANK` instance in this process (``kw``: any other
    :class:`Instance` argument)."""
    return Instance(role, extra=extra, **{**ONE_RANK, **kw})


def prefill_process(extra: dict[str, Any], num_blocks: int = 1024) -> RemoteInstance:
    """A :data:`ONE_RANK` prefill instance in a process of its own."""
    return RemoteInstance("kv_producer", extra=extra, **{**ONE_RANK, "num_blocks": num_blocks})


def with_device(extra: dict[str, Any], kv_device: str) -> dict[str, Any]:
    """``extra`` with ``device="sim"`` when ``kv_device`` is ``sim`` (KV in host
    memory, adopted as kvferry's sim device memory)."""
    return {**extra, "device": "sim"} if kv_device == "sim" else dict(extra)


def check_landed(d: Instance, rid: str, prompt: list[int]) -> None:
    """When the pull landed, every prompt position of every rank held the prefill's
    bytes (salt 1; the decode writes salt 2, so nothing it computed itself can pass)."""
    for rank, slots in enumerate(d.landed[rid]):
        assert len(slots) == len(prompt)
        for pos in range(len(prompt)):
            assert slots[pos] == d.expected(prompt, rank, pos), f"{rid}: rank {rank}, position {pos} differs"


def prefill(p: Instance, reqs: list[tuple[str, list[int]]]) -> dict[str, dict[str, Any]]:
    """Runs ``reqs``' prefill on ``p`` and the step after (the workers publish);
    returns their kv_transfer_params."""
    for rid, prompt in reqs:
        p.add(rid, prompt, 1, {"do_remote_decode": True})
    p.run_until(lambda: all(r in p.final for r, _ in reqs), 30, "the prefills")
    p.step()  # the step after: the workers publish
    return {r: p.final[r].kv_transfer_params for r, _ in reqs}


def pulled(d: Instance) -> tuple[int, int]:
    """(bytes, blocks) the decode's ranks report pulled, over every step."""
    return (
        sum(sum(s.get("pull_bytes", [])) for s in d.stats),
        sum(sum(s.get("pull_blocks", [])) for s in d.stats),
    )


def released_by_rank(p: Instance) -> list[dict[str, int]]:
    """Per prefill rank: its publications (reader slots) released, by reason."""
    out: list[dict[str, int]] = []
    for steps in p.rank_stats:
        acc: dict[str, int] = {}
        for s in steps:
            for reason, n in (s.get("published_released") or {}).items():
                acc[reason] = acc.get(reason, 0) + int(n)
        out.append(acc)
    return out


def wire(d: Instance) -> int:
    """Payload bytes every decode rank's engine received."""
    return sum(int(w.engine.stats()["consumer"]["bytes_received"]) for w in d.workers())


def needed(p_bs: int, d: Instance, ntok: int, skip_tokens: int = 0) -> int:
    """Bytes the decode needs for one prompt: every token slot of the finer block grid
    from ``skip_tokens`` to the prompt's end, K and V (MLA: the latent) of every layer,
    each rank's heads."""
    g = min(p_bs, d.bs)
    slots = (-(-ntok // g) - skip_tokens // g) * g
    return d.tp * slots * len(d.kvs) * len(LAYERS) * d.hpr * d.hs * 2


# -- data and pipeline parallel (test_connector_parallel.py) ------------------------------
#
# ``Instance(..., pp=P)``: one scheduler and ``tp * P`` workers, worker ``w`` being pipeline
# stage ``w // tp``, TP rank ``w % tp`` (``parallel_config.rank`` ``w``, as vLLM numbers
# the workers of one engine core); each stage's workers hold only that stage's layers
# (:func:`stage_caches`), and vLLM's aggregator waits for every worker, as its executor's
# does (``world_size``). ``Instance(..., dp_rank=d, dp_size=n)``: the engine core of DP
# rank ``d`` (:func:`as_dp_engine_core`); ``engine_id``: the deployment's engine id (vLLM
# suffixes ``_dp<d>`` per DP rank).


def as_dp_engine_core(cfg: Any, dp_rank: int, moe: bool = False) -> None:
    """What vLLM 0.33's ``run_engine_core`` does to the config of DP rank ``dp_rank``'s
    engine core (its workers get that config): ``data_parallel_index`` is the rank; a
    dense model's rank becomes an independent DP-1 engine
    (``reconfigure_for_independent_dp_rank``), a MoE model's keeps its DP group
    (``moe``); ``engine_id`` gains ``_dp<rank>``."""
    pc = cfg.parallel_config
    pc.data_parallel_index = dp_rank
    if moe:
        pc.data_parallel_rank = dp_rank
    else:
        pc.reconfigure_for_independent_dp_rank()
    cfg.kv_transfer_config.engine_id = f"{cfg.kv_transfer_config.engine_id}_dp{dp_rank}"


def stage_caches(inst: Instance, configs: list[Any], num_blocks: int, kv_layout: str | None) -> tuple[Any, list[Any], list[dict[str, Any]], str]:
    """Pipeline stages' KV caches as vLLM 0.33 makes them: worker ``w`` of stage
    ``w // tp`` gets vLLM's real ``Attention`` layers of its stage's layers only
    (:func:`kvferry.integrations.vllm.alloc.stage_layers`, vLLM's ``get_pp_indices``),
    made in its own config; :func:`kvferry.integrations.vllm.alloc.allocate_workers`
    plans and allocates every worker's cache from its own specs. Returns ``(scheduler
    kv_cache_config, [per worker], [caches per worker], layout)``."""
    from kvferry.integrations.vllm.alloc import allocate_workers, stage_layers

    assert not inst.mla, "pipeline stages: MHA caches only"
    specs = []
    for w, cfg in enumerate(configs):
        names = stage_layers(LAYERS, w // inst.tp, inst.pp)
        q_heads = int(cfg.model_config.get_num_attention_heads(cfg.parallel_config))
        layers = attention_layers(cfg, inst.backend, q_heads, inst.hpr, inst.hs, None, names)
        specs.append({n: layer.get_kv_cache_spec(cfg) for n, layer in layers.items()})
    return allocate_workers(configs, specs, [backend_class(inst.backend)], num_blocks, kv_layout)


def stage_of(inst: Instance, worker: int) -> int:
    """The pipeline stage of worker ``worker``."""
    return worker // inst.tp


def stage_wire(d: Instance) -> list[int]:
    """Per pipeline stage: payload bytes its decode workers' engines received."""
    out = [0] * d.pp
    for w, c in enumerate(d.ranks):
        out[stage_of(d, w)] += int(c.connector_worker.engine.stats()["consumer"]["bytes_received"])
    return out
