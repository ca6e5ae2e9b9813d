"""Where every K and V head vector of a vLLM 0.33 or 0.34 worker's KV cache lies in memory,
read from what vLLM says about it — never guessed from a tensor's shape.

Semantics
---------
vLLM 0.33 and 0.34 allocate every attention layer's cache the same way
(``vllm.v1.worker.utils.allocate_kv_cache``): one backing allocation, viewed per layer
as a 4-D ``[B, H, N, C]`` tensor (blocks, head slots, tokens per block, content bytes
per cell as elements of the cache dtype) whose strides follow the
:class:`~vllm.v1.kv_cache_layout.KVCacheLayout` the engine core resolved (``LBHNC``,
``LBNHC``, ...). What a cell's content *means* is the attention backend's business:

- ``packed`` — flash-attn, Triton, FlashInfer, FlexAttention: the content is the K
  head vector followed by the V head vector (``split(head_size, dim=-1)``).
- ``planes`` — the CPU backend (``CPU_ATTN``): the ``[N, C]`` interior of one (block,
  head) is read as ``[2N, head_size]``, the K vectors of its tokens, then their V
  vectors (``view(B, H, 2N, -1).chunk(2, dim=2)``); only with ``LBHNC``.
- ``latent`` — MLA: one head slot, the content is the latent vector (no K/V split).

:func:`describe` takes the registered tensors, the attention backends vLLM reports for
the worker's layers (``get_current_attn_backends``), the resolved layout and the KV
cache spec, checks that every tensor is exactly what vLLM's allocator makes of them
(shape, strides, one dense run of ``H × N × C`` bytes per layer and block), and returns
a :class:`CacheLayout`: the per-layer *piece* (one contiguous run per layer and block)
and the order of its cells, as a string over ``H`` (head), ``K`` (K or V), ``N``
(token), outermost first, ending in ``D`` (the head vector) — e.g. ``HNKD`` for a
packed ``LBHNC`` cache, ``HKND`` for the CPU backend's, ``NHD`` for MLA. The
heterogeneous-transfer planner (``mapping``) computes every byte range from that
order.

Anything else — a spec with ``kv_head_major_slots`` (vLLM 0.34: head slots grouped by
KV head, ``H2ND``), an unknown backend, a layout whose blocks of one layer are not one run
(``LHBNC``, ``BHLNC``, block-outermost packing), kernel blocks splitting a manager
block, padded pages, a content size that is not ``2 × head_size`` (``packed``,
``planes``) or ``head_size`` (``latent``) elements, separate V head size, NVFP4 head
groups — raises :class:`LayoutError` naming the tensor's shape, strides, the layout
and the backend. The connector asks vLLM for ``LBHNC``
(``get_required_kvcache_layout``), which every backend kvferry maps supports, so a
refusal means an operator forced another layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["LayoutError", "CacheLayout", "content_of", "describe", "PACKED_BACKENDS", "MAPPED_LAYOUTS"]

# Backends whose cell content is [K head vector | V head vector], read from their
# forward code in vLLM 0.33 (``split(head_size, dim=-1)`` on the content dim).
PACKED_BACKENDS = frozenset({"FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "FLEX_ATTENTION"})
# The CPU backend's planes of K then V per (block, head).
PLANES_BACKENDS = frozenset({"CPU_ATTN"})
# Layouts whose blocks of one layer are one dense run of H x N x C bytes.
MAPPED_LAYOUTS = ("LBHNC", "LBNHC")


class LayoutError(ValueError):
    """A KV cache kvferry cannot map exactly: the message names the tensor's shape and
    strides, the KV cache layout and the attention backend."""


@dataclass(frozen=True)
class CacheLayout:
    """One worker's KV cache as kvferry moves it (module docs)."""

    backend: str  # attention backend name(s), e.g. "CPU_ATTN"
    kv_layout: str  # vLLM's KVCacheLayout name, e.g. "LBHNC"
    content: str  # "packed", "planes" or "latent"
    order: str  # a piece's cells, outermost first: e.g. "HNKD"
    heads: int  # head slots per rank (H)
    block_size: int  # tokens per block (N)
    head_bytes: int  # bytes of one head vector
    elem_size: int
    dtype: str

    @property
    def kv_in_piece(self) -> bool:
        return "K" in self.order

    @property
    def piece_bytes(self) -> int:
        return self.heads * self.block_size * self.head_bytes * (2 if self.kv_in_piece else 1)

    @property
    def name(self) -> str:
        """How refusals name it: ``CPU_ATTN/LBHNC (HKND)``."""
        return f"{self.backend}/{self.kv_layout} ({self.order})"


def content_of(backend_names: list[str], mla: bool) -> str:
    """The cell content convention of these backends (module docs), or
    :class:`LayoutError` when kvferry does not know it or they disagree."""
    if mla:
        sparse = [n for n in backend_names if "SPARSE" in n.upper()]
        if sparse:
            raise LayoutError(f"KvferryConnector: sparse MLA backends ({', '.join(sparse)}) store an indexed cache kvferry does not map")
        return "latent"
    kinds = set()
    for n in backend_names:
        if n in PACKED_BACKENDS:
            kinds.add("packed")
        elif n in PLANES_BACKENDS:
            kinds.add("planes")
        else:
            raise LayoutError(
                f"KvferryConnector: attention backend {n} stores its KV cache in a way kvferry has not mapped "
                f"(mapped: {', '.join(sorted(PACKED_BACKENDS | PLANES_BACKENDS))}, and MLA); refusing rather than guessing"
            )
    if len(kinds) != 1:
        raise LayoutError(f"KvferryConnector: the layers' attention backends ({', '.join(backend_names)}) store K and V differently")
    return kinds.pop()


def _refuse(name: str, t: Any, layout: str, backend: str, why: str) -> LayoutError:
    return LayoutError(
        f"KvferryConnector: KV cache {name} (shape {tuple(t.shape)}, strides {tuple(t.stride())}, dtype "
        f"{str(t.dtype).removeprefix('torch.')}, layout {layout}, backend {backend}) cannot be mapped exactly: {why}"
    )


def describe(
    caches: dict[str, Any],
    *,
    num_blocks: int,
    block_size: int,
    heads: int,
    head_size: int,
    kv_layout: str,
    backends: list[str],
    mla: bool,
    head_size_v: int | None = None,
    head_major_slots: bool = False,
) -> CacheLayout:
    """The :class:`CacheLayout` of ``caches`` (``{layer: tensor}`` as vLLM registers
    them, shared tensors already dropped), or :class:`LayoutError`.

    ``heads``: the rank's KV heads (1 for MLA); ``head_size``: elements of one head
    vector (MLA: the latent); ``kv_layout``: the resolved ``KVCacheLayout`` name;
    ``backends``: the attention backend names of the layers; ``head_major_slots``:
    the spec's ``kv_head_major_slots`` (vLLM 0.34), refused by name."""
    backend = ",".join(backends) or "unknown"
    if head_major_slots:
        raise LayoutError(
            f"KvferryConnector: the KV cache spec sets kv_head_major_slots (backend {backend}): its head slots are "
            "grouped by KV head (H2ND, a packed page whose K and V slots of one head are adjacent), a layout kvferry "
            "has not mapped; refusing rather than guessing (kvferry maps one slot per KV head: packed, planes, latent)"
        )
    content = content_of(backends, mla)
    if head_size_v is not None and not mla and head_size_v != head_size:
        raise LayoutError(f"KvferryConnector: V head size {head_size_v} differs from K head size {head_size} (backend {backend})")
    if kv_layout not in MAPPED_LAYOUTS:
        raise LayoutError(
            f"KvferryConnector: KV cache layout {kv_layout} (backend {backend}) puts a layer's block in several runs or "
            f"interleaves layers within blocks; kvferry maps {' and '.join(MAPPED_LAYOUTS)} (it asks vLLM for LBHNC: "
            "unset VLLM_KV_CACHE_LAYOUT or set it to LBHNC)"
        )
    if content == "planes" and kv_layout != "LBHNC":
        raise LayoutError(f"KvferryConnector: backend {backend} reads K and V planes of a head-major block; layout {kv_layout} is not LBHNC")
    cells = 1 if mla else 2  # head vectors per (block, head, token) cell
    out: CacheLayout | None = None
    for name, t in caches.items():
        elem = int(t.element_size())
        want_c = cells * head_size
        if t.dim() != 4:
            raise _refuse(name, t, kv_layout, backend, "vLLM 0.33 allocates a 4-D [blocks, heads, tokens, content] view per layer")
        B, H, N, C = (int(x) for x in t.shape)
        if B != num_blocks:
            why = (
                f"{B} kernel blocks for {num_blocks} blocks: kernel blocks split each block (use a block size the backend "
                "supports directly)"
                if B % max(1, num_blocks) == 0 and B > num_blocks
                else f"{B} blocks, the KV cache config has {num_blocks}"
            )
            raise _refuse(name, t, kv_layout, backend, why)
        if N != block_size:
            raise _refuse(name, t, kv_layout, backend, f"{N} tokens per block, the scheduler's block size is {block_size}")
        if H != heads:
            raise _refuse(name, t, kv_layout, backend, f"{H} head slots, the rank holds {heads} KV heads (NVFP4 head groups and padded slots are not mapped)")
        if C != want_c:
            raise _refuse(
                name, t, kv_layout, backend, f"{C} content elements per cell, expected {want_c} ({content}: {cells} x head size {head_size})"
            )
        sB, sH, sN, sC = (int(x) for x in t.stride())
        if sC != 1 and C > 1:
            raise _refuse(name, t, kv_layout, backend, "the content dimension is not contiguous")
        hnc = (sH, sN) == (N * C, C)
        nhc = (sH, sN) == (C, H * C)
        if kv_layout == "LBHNC" and not (hnc or H == 1 and sN == C):
            raise _refuse(name, t, kv_layout, backend, "the strides are not those of LBHNC (heads outside tokens, dense)")
        if kv_layout == "LBNHC" and not (nhc or H == 1 and sN == C):
            raise _refuse(name, t, kv_layout, backend, "the strides are not those of LBNHC (tokens outside heads, dense)")
        if sB != H * N * C:
            raise _refuse(
                name,
                t,
                kv_layout,
                backend,
                f"a block's stride is {sB} elements, not its {H * N * C}: padded pages or other layers between blocks",
            )
        if mla:
            order = "NHD"
        elif content == "planes":
            order = "HKND"
        else:
            order = "HNKD" if kv_layout == "LBHNC" else "NHKD"
        cur = CacheLayout(
            backend=backend,
            kv_layout=kv_layout,
            content=content,
            order=order,
            heads=H,
            block_size=N,
            head_bytes=head_size * elem,
            elem_size=elem,
            dtype=str(t.dtype).removeprefix("torch."),
        )
        if out is not None and cur != out:
            raise _refuse(name, t, kv_layout, backend, f"it differs from the other layers ({out} vs {cur})")
        out = cur
    if out is None:
        raise LayoutError("KvferryConnector: no KV caches to describe")
    return out
