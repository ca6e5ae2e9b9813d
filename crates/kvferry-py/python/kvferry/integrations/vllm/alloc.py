"""KV caches exactly as vLLM 0.33 allocates them, for kvferry's vLLM benchmark and
tests: vLLM's real ``Attention`` layers for a chosen attention backend, the layout its
engine core resolves, the KV cache config its planner makes and the tensors its
``allocate_kv_cache`` makes — and each backend's own K/V views of them, read from the
backend's forward code, to write and check every head vector.

Nothing here is used by the connector itself: it derives its geometry independently,
from vLLM's description of the cache (``layout``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["BACKENDS", "backend_class", "attention_layers", "allocate", "allocate_workers", "stage_layers", "kv_views"]

# The attention backends whose KV caches the tests allocate and read: the CPU backend
# (what vLLM runs on this machine) and the GPU backends whose layer classes import and
# construct on CPU. FlashInfer stores its cache as Triton does (its layer needs a GPU to
# construct; the layout tests describe it from its backend class).
BACKENDS = ("CPU_ATTN", "FLASH_ATTN", "TRITON_ATTN")


def backend_class(name: str) -> Any:
    """vLLM's attention backend class named ``name``."""
    if name == "CPU_ATTN":
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return CPUAttentionBackend
    if name == "FLASH_ATTN":
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

        return FlashAttentionBackend
    if name == "TRITON_ATTN":
        from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

        return TritonAttentionBackend
    if name == "FLASHINFER":
        from vllm.v1.attention.backends.flashinfer import FlashInferBackend

        return FlashInferBackend
    raise ValueError(f"no backend {name}")


def attention_layers(
    cfg: Any, backend: str, heads: int, kv_heads: int, head_size: int, windows: dict[str, int] | None = None, layers: list[str] | None = None
) -> dict[str, Any]:
    """vLLM's real ``Attention`` layers named ``layers`` (default: two,
    ``model.layers.{i}.self_attn.attn``) under ``cfg``, with ``backend``
    (they register in ``cfg``'s forward context, where vLLM's connector utilities —
    ``get_current_attn_backends`` — find them, as in a loaded model). ``windows``:
    per-layer sliding windows."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention

    out = {}
    with set_current_vllm_config(cfg):
        for n in layers or [f"model.layers.{i}.self_attn.attn" for i in range(2)]:
            w = (windows or {}).get(n)
            out[n] = Attention(
                heads, head_size, head_size**-0.5, kv_heads, prefix=n, attn_backend=backend_class(backend), per_layer_sliding_window=w
            )
    return out


def allocate(
    configs: list[Any], specs: dict[str, Any], backends: list[Any], num_blocks: int, kv_layout: str | None = None, place: str = "cpu"
) -> tuple[Any, list[dict[str, Any]], str]:
    """KV caches for every rank the way vLLM 0.33's engine core and workers make them:
    the layout resolved by ``resolve_kv_cache_layout`` from the backends' supported
    layouts and the connector's ``get_required_kvcache_layout`` (``kv_layout``: set
    on the cache config first, as a user forcing one does), the groups by
    ``get_global_kv_cache_groups``, the config by ``get_kv_cache_configs`` (blocks
    fixed by ``num_gpu_blocks_override``), kernel block sizes by
    ``select_common_block_size``, and the tensors by ``allocate_kv_cache``. Returns
    ``(kv_cache_config, [caches per rank], layout name)``; the tensors live on
    ``place`` (``"cpu"``, ``"cuda:0"``)."""
    import torch
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, record_kv_cache_layout, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.kv_cache_interface import AttentionSpec
    from vllm.v1.worker.utils import allocate_kv_cache, select_common_block_size

    cfg0 = configs[0]
    if kv_layout is not None:
        cfg0.cache_config.kv_cache_layout = kv_layout
    names = [m.name for m in get_supported_kv_cache_layouts(backends)]
    layout = resolve_kv_cache_layout(cfg0, [names] * len(configs), specs.values())
    for c in configs[1:]:
        record_kv_cache_layout(c.cache_config, layout.name)
    cfg0.cache_config.num_gpu_blocks_override = num_blocks
    groups = get_global_kv_cache_groups(cfg0, [specs])
    page = max(s.page_size_bytes for s in specs.values())
    (kv_cache_config,) = get_kv_cache_configs(cfg0, [specs], [page * len(specs) * (num_blocks + 8) * 4], groups)
    kv_cache_config.kv_cache_layout = layout.name
    kernel = []
    for g in kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        kernel.append(select_common_block_size(spec.block_size, backends, [spec]) if isinstance(spec, AttentionSpec) else spec.block_size)
    caches = [allocate_kv_cache(kv_cache_config, torch.device(place), layout, kernel) for _ in configs]
    return kv_cache_config, caches, layout.name


def stage_layers(layers: list[str], pp_rank: int, pp_size: int) -> list[str]:
    """The layers pipeline stage ``pp_rank`` of ``pp_size`` holds, as vLLM 0.33 splits a
    model's layers (``vllm.distributed.utils.get_pp_indices``, which honours
    ``VLLM_PP_LAYER_PARTITION``)."""
    from vllm.distributed.utils import get_pp_indices

    start, end = get_pp_indices(len(layers), pp_rank, pp_size)
    return list(layers[start:end])


def allocate_workers(
    configs: list[Any], specs: list[dict[str, Any]], backends: list[Any], num_blocks: int, kv_layout: str | None = None, place: str = "cpu"
) -> tuple[Any, list[Any], list[dict[str, Any]], str]:
    """KV caches for workers that hold different layers — pipeline stages — the way
    vLLM 0.33's engine core makes them: ``specs[w]`` is worker ``w``'s layers' specs
    (a stage's workers hold only that stage's layers); the layout resolved from every
    worker's specs, the groups by ``get_global_kv_cache_groups`` over every worker, one
    ``KVCacheConfig`` per worker by ``get_kv_cache_configs`` (blocks fixed by
    ``num_gpu_blocks_override``), the scheduler's by
    ``generate_scheduler_kv_cache_config``, and each worker's tensors by
    ``allocate_kv_cache`` from its own config. Returns ``(scheduler kv_cache_config,
    [kv_cache_config per worker], [caches per worker], layout name)``."""
    import torch
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, record_kv_cache_layout, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
    from vllm.v1.kv_cache_interface import AttentionSpec
    from vllm.v1.worker.utils import allocate_kv_cache, select_common_block_size

    cfg0 = configs[0]
    if kv_layout is not None:
        cfg0.cache_config.kv_cache_layout = kv_layout
    names = [m.name for m in get_supported_kv_cache_layouts(backends)]
    layout = resolve_kv_cache_layout(cfg0, [names] * len(configs), [s for sp in specs for s in sp.values()])
    for c in configs[1:]:
        record_kv_cache_layout(c.cache_config, layout.name)
    cfg0.cache_config.num_gpu_blocks_override = num_blocks
    groups = get_global_kv_cache_groups(cfg0, specs)
    memory = [max(s.page_size_bytes for s in sp.values()) * len(sp) * (num_blocks + 8) * 4 for sp in specs]
    worker_cfgs = get_kv_cache_configs(cfg0, specs, memory, groups)
    for kcc in worker_cfgs:
        kcc.kv_cache_layout = layout.name
    sched_cfg = generate_scheduler_kv_cache_config(worker_cfgs)
    caches = []
    for kcc in worker_cfgs:
        kernel = []
        for g in kcc.kv_cache_groups:
            spec = g.kv_cache_spec
            kernel.append(select_common_block_size(spec.block_size, backends, [spec]) if isinstance(spec, AttentionSpec) else spec.block_size)
        caches.append(allocate_kv_cache(kcc, torch.device(place), layout, kernel))
    return sched_cfg, worker_cfgs, caches, layout.name


def kv_views(backend: str, t: Any, head_size: int, mla: bool = False) -> tuple[Any, ...]:
    """The K and V caches of one layer's tensor as ``backend``'s forward reads them
    (vLLM 0.33), each as ``[blocks, tokens, heads, head_size]``; MLA: the latent only.

    - CPU_ATTN (``cpu_attn.py``): ``view(B, H, 2N, -1)`` then ``chunk(2, dim=2)``.
    - FLASH_ATTN (``flash_attn.py``): ``transpose(1, 2).split(head_size, dim=-1)``.
    - TRITON_ATTN, FLASHINFER (``triton_attn.py``, ``flashinfer.py``):
      ``split(head_size, dim=-1)`` on ``[B, H, N, C]``."""
    if mla:
        return (t.transpose(1, 2),)
    if backend == "CPU_ATTN":
        B, H, N, _ = t.shape
        k, v = t.view((B, H, N * 2, -1)).chunk(2, dim=2)
        return k.transpose(1, 2), v.transpose(1, 2)
    if backend == "FLASH_ATTN":
        k, v = t.transpose(1, 2).split(head_size, dim=-1)
        return k, v
    if backend in ("TRITON_ATTN", "FLASHINFER"):
        k, v = t.split(head_size, dim=-1)
        return k.transpose(1, 2), v.transpose(1, 2)
    raise ValueError(f"no K/V views for backend {backend}")
