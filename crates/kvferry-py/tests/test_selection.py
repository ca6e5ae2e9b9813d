"""Partial gets from Python (``kvferry.Selection``), without vLLM: vLLM-shaped
per-layer caches (``[2, num_blocks, ...]`` per layer), a subset of blocks, a head
slice, an HND->NHD permutation, prefill blocks of 16 tokens into decode blocks of 32
and back, on the direct and staged paths, the delayed pull and a sim device;
malformed selections raise ``SelectionError``; the byte counters show the wire
carried exactly the selected bytes; a cancelled selected get returns after its
drain. Every landed byte is compared with a reference built with numpy."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from numpy.typing import NDArray

import kvferry

D = 32  # bytes of one head of one token
LAYERS = 2

Pair = tuple[kvferry.Engine, kvferry.Engine]


@pytest.fixture
def pair() -> Iterator[Pair]:
    with kvferry.Engine(peer_id="prefill", transport="tcp") as p, kvferry.Engine(peer_id="decode") as d:
        yield p, d


def caches(shape: tuple[int, ...], seed: int | None) -> dict[str, NDArray[np.uint8]]:
    """Per-layer ``[2, num_blocks, *shape]`` uint8 caches (random, or zero)."""
    out: dict[str, NDArray[np.uint8]] = {}
    for i in range(LAYERS):
        full = (2,) + shape
        if seed is None:
            out[f"layer.{i}"] = np.zeros(full, dtype=np.uint8)
        else:
            out[f"layer.{i}"] = np.random.default_rng(seed + i).integers(0, 255, full, dtype=np.uint8)
    return out


def wire(p: kvferry.Engine, d: kvferry.Engine) -> tuple[int, int]:
    return d.stats()["consumer"]["bytes_received"], p.stats()["producer"]["bytes_sent"]


def check_wire(p: kvferry.Engine, d: kvferry.Engine, before: tuple[int, int], nbytes: int) -> None:
    rx, tx = wire(p, d)
    assert (rx - before[0], tx - before[1]) == (nbytes, nbytes), "the wire carried exactly the selected bytes"


@pytest.mark.parametrize("path", ["direct", "staged"])
def test_subset_of_blocks_and_head_slice(pair: Pair, path: str) -> None:
    p, d = pair
    assert p.address is not None
    heads, tokens, nb = 4, 16, 8
    src = caches((nb, heads, tokens, D), seed=1)  # HND
    s = p.register_kv_caches(src)
    p.publish("a", s, [1, 2, 3], once=False)
    p.publish("b", s, [6], once=False)
    # A decode rank with 2 of the 4 heads: heads 2..4 of positions 3 and 1 (blocks 6, 2).
    dst = caches((nb, 2, tokens, D), seed=None)
    t = d.register_kv_caches(dst)
    piece = heads * tokens * D
    half = piece // 2
    sel = kvferry.Selection(blocks=[3, 1], src_ranges=[(half, half)])
    before = wire(p, d)
    assert d.get(p.address, ["a", "b"], t, [[5], [0]], path=path, select=sel).wait(5) == 2
    for name in src:
        for kv in (0, 1):
            assert (dst[name][kv, 5] == src[name][kv, 6, 2:]).all()
            assert (dst[name][kv, 0] == src[name][kv, 2, 2:]).all()
            assert not dst[name][kv, [1, 2, 3, 4, 6, 7]].any()
    check_wire(p, d, before, 2 * LAYERS * 2 * half)


def test_one_selection_serves_many_gets(pair: Pair) -> None:
    """A Selection is immutable and built once: the vLLM connector reuses one per read
    shape for every request. Each get with it moves its own key's slice, and the
    selection reads back unchanged after the gets."""
    p, d = pair
    assert p.address is not None
    heads, tokens, nb = 4, 16, 8
    src = caches((nb, heads, tokens, D), seed=3)
    s = p.register_kv_caches(src)
    for b in range(nb):
        p.publish(f"k{b}", s, [b], once=False)
    dst = caches((nb, 2, tokens, D), seed=None)
    t = d.register_kv_caches(dst)
    half = heads * tokens * D // 2
    sel = kvferry.Selection(src_ranges=[(half, half)])
    before = wire(p, d)
    transfers = [d.get(p.address, f"k{b}", t, [nb - 1 - b], select=sel) for b in range(nb)]
    assert [x.wait(5) for x in transfers] == [1] * nb
    for name in src:
        for kv in (0, 1):
            for b in range(nb):
                assert (dst[name][kv, nb - 1 - b] == src[name][kv, b, 2:]).all(), f"key k{b}"
    check_wire(p, d, before, nb * LAYERS * 2 * half)
    assert sel == kvferry.Selection(src_ranges=[(half, half)]) and sel.src_ranges == ((half, half),)


def test_hnd_to_nhd_permutation_by_source_ranges(pair: Pair) -> None:
    p, d = pair
    assert p.address is not None
    heads, tokens, nb = 4, 16, 4
    src = caches((nb, heads, tokens, D), seed=2)  # HND
    s = p.register_kv_caches(src)
    p.publish("r", s, [0, 3], once=False)
    dst = caches((nb, tokens, heads, D), seed=None)  # NHD
    t = d.register_kv_caches(dst)
    nhd = [((h * tokens + tok) * D, D) for tok in range(tokens) for h in range(heads)]
    sel = kvferry.Selection(src_ranges=nhd)
    assert d.get_blocking(p.address, "r", t, [2, 1], select=sel) == 1
    for name in src:
        for kv in (0, 1):
            assert (dst[name][kv, 2] == src[name][kv, 0].transpose(1, 0, 2)).all()
            assert (dst[name][kv, 1] == src[name][kv, 3].transpose(1, 0, 2)).all()


def test_block_16_to_32_and_32_to_16(pair: Pair) -> None:
    p, d = pair
    assert p.address is not None
    heads = 2
    small = 16 * heads * D
    src16 = caches((8, 16, heads, D), seed=3)  # NHD, 16 tokens per block
    s16 = p.register_kv_caches(src16, name="p16")
    p.publish("r16", s16, [4, 5], once=False)
    dst32 = caches((4, 32, heads, D), seed=None)
    t32 = d.register_kv_caches(dst32, name="d32")
    for pos in (0, 1):
        sel = kvferry.Selection(blocks=[pos], dst_ranges=[(pos * small, small)])
        assert d.get_blocking(p.address, "r16", t32, [3], select=sel) == 1
    for name in src16:
        for kv in (0, 1):
            assert (dst32[name][kv, 3] == np.concatenate([src16[name][kv, 4], src16[name][kv, 5]])).all()
    src32 = caches((4, 32, heads, D), seed=4)
    s32 = p.register_kv_caches(src32, name="p32")
    p.publish("r32", s32, [2], once=False)
    dst16 = caches((8, 16, heads, D), seed=None)
    t16 = d.register_kv_caches(dst16, name="d16")
    for half, block, path in ((0, 6, "direct"), (1, 1, "staged")):
        sel = kvferry.Selection(src_ranges=[(half * small, small)])
        assert d.get_blocking(p.address, "r32", t16, [block], select=sel, path=path) == 1
    for name in src32:
        for kv in (0, 1):
            assert (dst16[name][kv, 6] == src32[name][kv, 2, :16]).all()
            assert (dst16[name][kv, 1] == src32[name][kv, 2, 16:]).all()


def test_pull_and_stage_resolve_move_only_the_selection(pair: Pair) -> None:
    p, d = pair
    assert p.address is not None
    nb, piece = 8, 1024
    src = caches((nb, piece), seed=5)
    s = p.register_kv_caches(src)
    p.publish("r", s, [0, 1, 2, 3], once=False)
    dst = caches((nb, 256), seed=None)
    t = d.register_kv_caches(dst)
    sel = kvferry.Selection(blocks=[2, 3], src_ranges=[(512, 256)])
    before = wire(p, d)
    assert d.pull(p.address, "r", t, [0, 1], select=sel) == 1
    for name in src:
        assert (dst[name][:, [0, 1]] == src[name][:, [2, 3], 512:768]).all()
    check_wire(p, d, before, 2 * LAYERS * 2 * 256)
    staged = d.stage(p.address, "r", select=sel)
    assert staged.chunks == 1 and staged.selected_bytes == 2 * LAYERS * 2 * 256
    # Resolve with its own landing: the two 128-byte halves swapped.
    swap = kvferry.Selection(blocks=[2, 3], src_ranges=[(512, 256)], dst_ranges=[(128, 128), (0, 128)])
    assert d.resolve(staged, t, [4, 5], select=swap) == 1
    for name in src:
        want = src[name][:, [2, 3], 512:768]
        assert (dst[name][:, [4, 5], 128:] == want[..., :128]).all()
        assert (dst[name][:, [4, 5], :128] == want[..., 128:]).all()
    staged = d.stage(p.address, "r", select=sel)
    with pytest.raises(kvferry.SelectionError, match="other blocks or source ranges"):
        d.resolve(staged, t, [4, 5], select=kvferry.Selection(blocks=[0, 1], src_ranges=[(512, 256)]))


def test_sim_device_selection() -> None:
    # The socket mover: the test counts the selected bytes on the wire.
    with kvferry.Engine(device="sim", device_latency_us=100, transport="tcp") as p, kvferry.Engine(
        device="sim"
    ) as d:
        assert p.address is not None
        nb, piece = 8, 2048
        raw = {}
        layers = {}
        for i in range(LAYERS):
            arr = np.random.default_rng(20 + i).integers(0, 255, (2, nb, piece), dtype=np.uint8)
            mem = p.alloc_device(arr.nbytes, shape=arr.shape)
            mem.write(arr.data)  # its buffer: numpy types an array as a Buffer only on Python >= 3.12
            layers[f"l{i}"], raw[f"l{i}"] = mem, arr
        src = p.register_kv_caches(layers)
        p.publish("r", src, [1, 4, 6], once=False)
        half = piece // 2
        dl = {f"l{i}": d.alloc_device(2 * nb * half, shape=(2, nb, half)) for i in range(LAYERS)}
        dst = d.register_kv_caches(dl)
        sel = kvferry.Selection(blocks=[2, 0], src_ranges=[(0, half)])
        before = wire(p, d)
        assert d.get_blocking(p.address, "r", dst, [3, 7], select=sel) == 1
        for name, mem in dl.items():
            got = np.frombuffer(mem.read(), dtype=np.uint8).reshape(2, nb, half)
            assert (got[:, 3] == raw[name][:, 6, :half]).all()
            assert (got[:, 7] == raw[name][:, 1, :half]).all()
            assert not got[:, [0, 1, 2, 4, 5, 6]].any()
        check_wire(p, d, before, 2 * LAYERS * 2 * half)


def test_malformed_selections_raise_selection_error(pair: Pair) -> None:
    p, d = pair
    assert p.address is not None
    nb, piece = 8, 512
    src = caches((nb, piece), seed=6)
    s = p.register_kv_caches(src)
    p.publish("r", s, [0, 1, 2, 3], once=False)
    dst = caches((nb, piece), seed=None)
    t = d.register_kv_caches(dst)
    assert issubclass(kvferry.SelectionError, kvferry.InvalidArgumentError)
    # The API refuses what it can tell at once.
    with pytest.raises(kvferry.SelectionError, match="overlap"):
        kvferry.Selection(dst_ranges=[(0, 64), (32, 64)])
    with pytest.raises(kvferry.SelectionError, match="empty or overflows"):
        kvferry.Selection(src_ranges=[(8, 0)])
    with pytest.raises(kvferry.SelectionError):
        kvferry.Selection(blocks=[-1])
    with pytest.raises(kvferry.SelectionError, match="totals differ"):
        kvferry.Selection(src_ranges=[(0, 64)], dst_ranges=[(0, 32)])
    with pytest.raises(kvferry.SelectionError):
        d.get(p.address, "r", t, [1], select="everything")  # type: ignore[arg-type]  # wrong on purpose
    sel = kvferry.Selection(blocks=[0])
    with pytest.raises(AttributeError):
        sel.blocks = (1,)  # type: ignore[misc]
    # The consumer refuses a mismatch with its destination before sending.
    with pytest.raises(kvferry.SelectionError, match="2 blocks selected but 1 destination blocks"):
        d.get_blocking(p.address, "r", t, [1], select=kvferry.Selection(blocks=[0, 1]))
    with pytest.raises(kvferry.SelectionError, match=f"exceeds piece 0 of {piece} bytes"):
        d.get_blocking(p.address, "r", t, [1], select=kvferry.Selection(dst_ranges=[(piece - 8, 16)]))
    with pytest.raises(kvferry.SelectionError, match="totals differ"):
        d.get_blocking(p.address, "r", t, [1], select=kvferry.Selection(src_ranges=[(0, 64)]))
    # The producer refuses what only it can tell.
    with pytest.raises(kvferry.SelectionError, match="block position 9 of 4"):
        d.get_blocking(p.address, "r", t, [1], select=kvferry.Selection(blocks=[9]))
    with pytest.raises(kvferry.SelectionError, match=f"exceeds piece 0 of {piece} bytes"):
        d.get_blocking(
            p.address, "r", t, [1], select=kvferry.Selection(src_ranges=[(piece - 4, 8)], dst_ranges=[(0, 8)])
        )
    with pytest.raises(kvferry.NotFoundError):
        d.get_blocking(p.address, ["r", "unpublished"], t, [1], select=kvferry.Selection(blocks=[0]))
    # Nothing leaked; the next selected get lands.
    assert d.get_blocking(p.address, "r", t, [2], select=kvferry.Selection(blocks=[3])) == 1
    for name in src:
        assert (dst[name][:, 2] == src[name][:, 3]).all()
    assert d.stats()["arena"]["leased_pages"] == 0
    assert p.stats()["producer"]["staged_now"] == 0


def test_cancelled_selected_get_returns_after_the_drain(pair: Pair) -> None:
    p, d = pair
    assert p.address is not None
    nb, piece = 16, 4096
    src = caches((nb, piece), seed=7)
    s = p.register_kv_caches(src)
    p.publish("r", s, list(range(nb)), once=False)
    dst = caches((nb, piece // 2), seed=None)
    t = d.register_kv_caches(dst)
    p._e._inject_faults(send_delay_us=300_000)
    for path in ("direct", "staged"):
        tr = d.get(p.address, "r", t, list(range(nb)), path=path, select=kvferry.Selection(src_ranges=[(0, piece // 2)]))
        assert tr.cancel() is True
        assert isinstance(tr.error, kvferry.CancelledError)
        stats = d.stats()
        assert stats["consumer"]["draining"] == 0 and stats["arena"]["leased_pages"] == 0
    p._e._inject_faults(send_delay_us=0)
    assert d.get_blocking(p.address, "r", t, [0], select=kvferry.Selection(blocks=[5], src_ranges=[(piece // 2, piece // 2)])) == 1
    for name in src:
        assert (dst[name][:, 0] == src[name][:, 5, piece // 2 :]).all()
