"""Where KvferryConnector believes every K and V head vector lies, against where each
vLLM 0.33 attention backend reads it — and the caches it refuses, by name.

- For every backend and layout vLLM can allocate and kvferry maps (the CPU backend's
  LBHNC; flash-attn, Triton and FlashInfer in LBHNC and LBNHC; MLA), a cache allocated
  by vLLM's own code (``kvferry.integrations.vllm.alloc``) gets a distinct value in
  every head vector through the backend's own K/V views; the connector's geometry
  (``vllm.layout.describe``, then ``vllm.mapping``'s byte offsets) must find each one
  at the offset it computes, in the raw bytes of the registered piece.
- A cache the connector cannot map exactly is refused at ``register_kv_caches`` with
  an error naming its shape, strides, layout and backend: layouts whose blocks of one
  layer are not one run (LHBNC, BHLNC) or interleave layers (BLHNC), a hand-built
  tensor of another shape (vLLM < 0.33's ``[2, blocks, ...]``), padded pages, kernel
  blocks that split a block, an unknown backend, strides that contradict the layout.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm_harness import KV4, LAYERS, MLA_MODEL

HS = 16


def _config(model: str = KV4, block_size: int = 16) -> Any:
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig

    return VllmConfig(
        # A short model length: vLLM admits it with the few blocks these tests allocate.
        model_config=ModelConfig(model=model, skip_tokenizer_init=True, dtype="float16", max_model_len=64, seed=0),
        cache_config=CacheConfig(block_size=block_size),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvferryConnector", kv_connector_module_path="kvferry.integrations.vllm", kv_role="kv_consumer"
        ),
    )


def _specs(backend: str, cfg: Any, windows: dict[str, int] | None = None) -> dict[str, Any]:
    """The layers' specs: from real layers where the backend's layer constructs on CPU;
    FlashInfer's layer needs a GPU, so its spec is the one its layer reports
    (FullAttentionSpec of the rank's heads) — its allocation still vLLM's."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvferry.integrations.vllm.alloc import attention_layers

    if backend == "FLASHINFER":
        spec = FullAttentionSpec(block_size=cfg.cache_config.block_size, num_kv_heads=4, head_size=HS, dtype=torch.float16)
        return {n: spec for n in LAYERS}
    layers = attention_layers(cfg, backend, 8, 4, HS, windows, LAYERS)
    return {n: layer.get_kv_cache_spec(cfg) for n, layer in layers.items()}


def _describe(backend: str, kv: dict[str, Any], cfg: Any, nb: int, mla: bool = False) -> Any:
    from kvferry.integrations.vllm.layout import describe

    return describe(
        kv,
        num_blocks=nb,
        block_size=cfg.cache_config.block_size,
        heads=1 if mla else 4,
        head_size=48 if mla else HS,
        kv_layout=cfg.cache_config.kv_cache_layout,
        backends=[] if mla else [backend],
        mla=mla,
    )


MAPPED = [
    ("CPU_ATTN", None, 32, "HKND"),
    ("FLASH_ATTN", None, 16, "HNKD"),
    ("FLASH_ATTN", "LBNHC", 16, "NHKD"),
    ("TRITON_ATTN", "LBHNC", 16, "HNKD"),
    ("TRITON_ATTN", "LBNHC", 16, "NHKD"),
    ("FLASHINFER", "LBHNC", 16, "HNKD"),
    ("FLASHINFER", "LBNHC", 16, "NHKD"),
]


@pytest.mark.parametrize("backend,kv_layout,bs,order", MAPPED, ids=[f"{b}-{k or 'resolved'}" for b, k, _, _ in MAPPED])
def test_every_head_vector_is_where_the_connector_computes_it(need_vllm, backend, kv_layout, bs, order):
    import torch

    from kvferry.integrations.vllm.alloc import allocate, backend_class, kv_views
    from kvferry.integrations._kv_layout import KvDescriptor, _offset

    nb = 6
    cfg = _config(block_size=bs)
    specs = _specs(backend, cfg)
    _, (kv,), name = allocate([cfg], specs, [backend_class(backend)], nb, kv_layout)
    assert name == (kv_layout or "LBHNC")  # unforced: the connector's request (LBHNC) is honoured
    lay = _describe(backend, kv, cfg, nb)
    assert lay.order == order and lay.piece_bytes == 4 * bs * 2 * HS * 2
    desc = KvDescriptor(model="m", dtype="float16", attention="MHA", num_kv_heads=4, head_size=HS, block_size=bs, tp_size=1, layout=lay.order)
    for li, (n, t) in enumerate(kv.items()):
        k, v = kv_views(backend, t, HS)
        # A distinct int16 code in every element of every head vector, written as the backend writes.
        for kvi, view in enumerate((k, v)):
            b_, n_, h_, d_ = view.shape
            code = (torch.arange(b_ * n_ * h_ * d_).reshape(b_, n_, h_, d_) * 2 + kvi + 7 * li) % 30000
            view.view(torch.int16).copy_(code.to(torch.int16))
        raw = t.permute(*sorted(range(4), key=lambda i: -t.stride()[i])).contiguous().view(torch.uint8).reshape(nb, -1)
        assert raw.shape[1] == lay.piece_bytes
        for kvi, view in enumerate((k, v)):
            for b in (0, 3, nb - 1):
                for tok in range(bs):
                    for h in range(4):
                        off = _offset(desc, tok, h, kvi)
                        got = raw[b, off : off + HS * 2]
                        assert torch.equal(got, view[b, tok, h].view(torch.uint8).reshape(-1)), (n, kvi, b, tok, h)


def test_mla_latent_is_one_vector_per_token(need_vllm):
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from kvferry.integrations.vllm.alloc import allocate, kv_views
    from kvferry.integrations._kv_layout import KvDescriptor, _offset
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend

    nb = 5
    cfg = _config(model=MLA_MODEL)
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=48, dtype=torch.float16)
    _, (kv,), _ = allocate([cfg], {n: spec for n in LAYERS}, [TritonMLABackend], nb)
    lay = _describe("", kv, cfg, nb, mla=True)
    assert lay.order == "NHD" and lay.piece_bytes == 16 * 48 * 2
    desc = KvDescriptor(model="m", dtype="float16", attention="MLA", num_kv_heads=1, head_size=48, block_size=16, tp_size=1, layout=lay.order)
    for t in kv.values():
        (lat,) = kv_views("", t, 48, mla=True)
        lat.view(torch.int16).copy_(torch.arange(lat.numel()).reshape(lat.shape).to(torch.int16))
        raw = t.view(torch.uint8).reshape(nb, -1)
        for tok in range(16):
            off = _offset(desc, tok, 0)
            assert torch.equal(raw[2, off : off + 96], lat[2, tok, 0].view(torch.uint8).reshape(-1))


# -- refusals at register_kv_caches ----------------------------------------------------


def _register(cfg: Any, kv: dict[str, Any], kcc: Any) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    c = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kcc)
    try:
        c.register_kv_caches(kv)
    finally:
        c.shutdown()


def _allocated(backend: str, kv_layout: str | None, bs: int = 16, specs: dict[str, Any] | None = None) -> tuple[Any, Any, dict[str, Any]]:
    from kvferry.integrations.vllm.alloc import allocate, backend_class

    cfg = _config(block_size=bs)
    sp = specs if specs is not None else _specs(backend, cfg)
    if specs is not None:  # the layers still register their backend
        _specs(backend, cfg)
    kcc, (kv,), _ = allocate([cfg], sp, [backend_class(backend)], 8, kv_layout)
    return cfg, kcc, kv


@pytest.mark.parametrize("kv_layout", ["LHBNC", "BHLNC", "BLHNC", "BLNHC"])
def test_a_layout_whose_blocks_are_not_one_run_per_layer_is_refused_by_name(need_vllm, kv_layout):
    """flash-attn takes any layout; one forced by the operator that kvferry does not
    map is refused at registration, naming the layout, the backend, and what to set."""
    from kvferry.integrations.vllm.layout import LayoutError

    cfg, kcc, kv = _allocated("FLASH_ATTN", kv_layout)
    with pytest.raises(LayoutError) as e:
        _register(cfg, kv, kcc)
    msg = str(e.value)
    assert kv_layout in msg and "FLASH_ATTN" in msg and "LBHNC" in msg, msg


def test_a_hand_built_tensor_is_refused_naming_shape_and_strides(need_vllm):
    """vLLM < 0.33's ``[2, blocks, block_size, heads, head_size]`` per layer, built by
    hand: not what vLLM 0.33 allocates — refused, never read as something else."""
    import torch

    from kvferry.integrations.vllm.layout import LayoutError

    cfg, kcc, _ = _allocated("FLASH_ATTN", None)
    kv = {n: torch.zeros((2, 8, 16, 4, HS), dtype=torch.float16) for n in LAYERS}
    with pytest.raises(LayoutError) as e:
        _register(cfg, kv, kcc)
    msg = str(e.value)
    assert "(2, 8, 16, 4, 16)" in msg and "(8192, 1024, 64, 16, 1)" in msg and "LBHNC" in msg and "FLASH_ATTN" in msg, msg


def test_strides_that_contradict_the_layout_are_refused(need_vllm):
    """A cache allocated LBNHC while the config says LBHNC: the strides decide."""
    from kvferry.integrations.vllm.layout import LayoutError

    cfg, kcc, kv = _allocated("TRITON_ATTN", "LBNHC")
    cfg.cache_config.kv_cache_layout = "LBHNC"
    kcc.kv_cache_layout = "LBHNC"
    with pytest.raises(LayoutError, match="not those of LBHNC") as e:
        _register(cfg, kv, kcc)
    assert "strides" in str(e.value) and "TRITON_ATTN" in str(e.value)


def test_padded_pages_are_refused(need_vllm):
    import dataclasses

    from kvferry.integrations.vllm.layout import LayoutError

    cfg = _config()
    specs = _specs("FLASH_ATTN", cfg)
    padded = {n: dataclasses.replace(s, page_size_padded=s.page_size_bytes + 256) for n, s in specs.items()}
    cfg, kcc, kv = _allocated("FLASH_ATTN", None, specs=padded)
    with pytest.raises(LayoutError, match="padded pages") as e:
        _register(cfg, kv, kcc)
    assert "FLASH_ATTN" in str(e.value)


def test_kernel_blocks_that_split_a_block_are_refused(need_vllm):
    """A view whose block dimension counts kernel blocks (two per scheduler block)."""
    import torch

    from kvferry.integrations.vllm.layout import LayoutError, describe

    t = torch.zeros((16, 4, 8, 2 * HS), dtype=torch.float16)
    with pytest.raises(LayoutError, match="kernel blocks split each block"):
        describe({"l0": t}, num_blocks=8, block_size=16, heads=4, head_size=HS, kv_layout="LBHNC", backends=["FLASH_ATTN"], mla=False)


def test_an_unmapped_backend_is_refused_by_name(need_vllm):
    from kvferry.integrations.vllm.layout import LayoutError, content_of

    with pytest.raises(LayoutError, match="ROCM_ATTN"):
        content_of(["ROCM_ATTN"], mla=False)
    with pytest.raises(LayoutError, match="differently"):
        content_of(["CPU_ATTN", "FLASH_ATTN"], mla=False)
    with pytest.raises(LayoutError, match="FLASHMLA_SPARSE"):
        content_of(["FLASHMLA_SPARSE"], mla=True)
    assert content_of(["FLASH_ATTN", "TRITON_ATTN"], mla=False) == "packed"


def test_the_connector_asks_vllm_for_lbhnc(need_vllm):
    from kvferry.integrations.vllm import KvferryConnector

    assert KvferryConnector.get_required_kvcache_layout(_config()) == "LBHNC"
    assert KvferryConnector.get_required_kvcache_layout(_config(model=MLA_MODEL)) is None


def test_a_decode_with_kv_in_separate_pieces_is_refused_naming_both_layouts(need_vllm):
    """Descriptor check: a peer whose K and V are separate pieces (an older kvferry's
    ``NHD``) against one whose cells hold both: refused, naming both layouts."""
    from kvferry.integrations.vllm.mapping import IncompatibleError, KvDescriptor, check

    base = dict(model="m", dtype="float16", attention="MHA", num_kv_heads=4, head_size=HS, block_size=16, tp_size=1)
    p = KvDescriptor(**base, layout="HKND", pieces=2, cache_layout="CPU_ATTN/LBHNC (HKND)")
    d = KvDescriptor(**base, layout="NHD", pieces=4)
    with pytest.raises(IncompatibleError, match=r"CPU_ATTN/LBHNC \(HKND\).*NHD"):
        check(p, d)
