# mypy: disable-error-code="import-untyped,import-not-found"
"""Two real processes (prefill, decode) over kvferry: SGLang's real bootstrap server,
KVArgs over CPU tensors, one manager per rank, every page and auxiliary byte compared,
and the failure paths (abort on each side, refused pairing, a killed prefill)."""

from __future__ import annotations

import itertools
import time
from typing import Any

from .conftest import Role

FAILED, BOOTSTRAPPING, WAITING, TRANSFERRING, SUCCESS = range(5)
_ports = itertools.count(18700)
_rooms = itertools.count(1000)


def reduced(role: Role, group: str, room: int) -> int:
    """SGLang's reduction of one request's poll over the ranks (its own
    ``poll_and_all_reduce`` over a gloo group, in the role's process): every rank gets
    the same state, the minimum of the ranks' own (one rank's Failed fails the
    request; Success only when every rank succeeded)."""
    out = role("poll", group=group, room=room)
    red = set(out["reduced"].values())
    assert len(red) == 1, out
    return int(red.pop())


def wait_for(role: Role, group: str, room: int, want: set[int], timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while True:
        s = reduced(role, group, room)
        if s in want or time.monotonic() > deadline:
            return s
        time.sleep(0.02)


def pair(pre: Role, dec: Role, name: str, p_tp: int, d_tp: int, *, mla: bool = False, page_size: int = 4,
         d_page_size: int | None = None, layers: int = 3, heads: int = 4) -> dict[str, Any]:
    port = next(_ports)
    common = dict(heads=heads, head_dim=8, pages=32, layers=layers, mla=mla, seed=port, aux_rows=8, port=port)
    pre("setup", name=name, mode="prefill", tp=p_tp, ranks_here=list(range(p_tp)), page_size=page_size, **common)
    dec("setup", name=name, mode="decode", tp=d_tp, ranks_here=list(range(d_tp)), page_size=d_page_size or page_size, **common)
    return {"name": name, "p_tp": p_tp, "d_tp": d_tp, "mla": mla}


def run_transfer(pre: Role, dec: Role, g: dict[str, Any], chunks: list[list[int]], dst: list[int],
                 aux_src: dict[str, int] | None = None) -> int:
    room = next(_rooms)
    src = [p for c in chunks for p in c]
    pre("start", group=g["name"], room=room, pages=src, aux_index=2)
    dec("start", group=g["name"], room=room, pages=dst, aux_index=5)
    assert wait_for(pre, g["name"], room, {WAITING, FAILED}) == WAITING
    for c in chunks:
        pre("send", group=g["name"], room=room, pages=c)
    assert wait_for(dec, g["name"], room, {SUCCESS, FAILED}) == SUCCESS, dec("failure", group=g["name"], room=room)
    assert wait_for(pre, g["name"], room, {SUCCESS, FAILED}) == SUCCESS, pre("failure", group=g["name"], room=room)
    # The auxiliary row comes from the decode rank's first source rank.
    if aux_src is None:
        aux_src = {str(d): d % g["p_tp"] if g["mla"] else d * g["p_tp"] // g["d_tp"] for d in range(g["d_tp"])}
    out = dec("check", group=g["name"], room=room, src_pages=src, dst_pages=dst, src_aux=2, dst_aux=5, aux_src=aux_src)
    assert out["nbad"] == 0, out["bad"]
    return room


def test_tp2_to_tp2_chunked(roles: tuple[Role, Role]) -> None:
    pre, dec = roles
    g = pair(pre, dec, "tp22", 2, 2)
    room = run_transfer(pre, dec, g, [[3, 4, 5], [9, 1], [20, 21, 22, 23]], [30, 2, 7, 8, 11, 12, 13, 0, 19])
    m = pre("metric", group="tp22", room=room)["metric"]
    for rank, (latency, nbytes) in m.items():
        assert latency is not None and latency >= 0, (rank, latency)
        assert nbytes == 9 * 6 * 4 * 2 * 8 * 2, (rank, nbytes)  # pages x buffers x page bytes


def test_tp1_to_tp2(roles: tuple[Role, Role]) -> None:
    pre, dec = roles
    g = pair(pre, dec, "tp12", 1, 2)
    run_transfer(pre, dec, g, [[0, 1], [2, 3, 4]], [10, 11, 12, 13, 14])


def test_tp2_to_tp1(roles: tuple[Role, Role]) -> None:
    pre, dec = roles
    g = pair(pre, dec, "tp21", 2, 1)
    run_transfer(pre, dec, g, [[6, 7, 8]], [1, 2, 3])


def _replicated(pre: Role, dec: Role, p_tp: int, d_tp: int, aux_src: dict[str, int]) -> None:
    """Two KV heads over a TP wider than them on at least one side (SGLang replicates
    a head over ``TP / 2`` ranks there): two chunks, every byte of the destination pages
    and the auxiliary row compared with the prefill's, and every other decode page
    still zero (no rank wrote outside its pages). ``aux_src``: the prefill rank each
    decode rank reads its first head from (where a head has several replicas, decode
    rank ``r`` reads replica ``r % replicas``), whose auxiliary row it gets."""
    name = f"rep{p_tp}{d_tp}"
    g = pair(pre, dec, name, p_tp, d_tp, heads=2)
    dst = [30, 2, 7, 8, 11]
    run_transfer(pre, dec, g, [[3, 4], [9, 1, 20]], dst, aux_src=aux_src)
    others = [p for p in range(32) if p not in dst]
    left = dec("untouched", group=name, dst_pages=others, dst_aux=0)["untouched"]
    assert all(v["pages"] == others for v in left.values()), left


def test_replicated_heads_tp1_to_tp4(roles: tuple[Role, Role]) -> None:
    """Decode ranks 0, 1 hold head 0 and 2, 3 head 1; all read prefill rank 0's two."""
    pre, dec = roles
    _replicated(pre, dec, 1, 4, {"0": 0, "1": 0, "2": 0, "3": 0})


def test_replicated_heads_tp2_to_tp4(roles: tuple[Role, Role]) -> None:
    pre, dec = roles
    _replicated(pre, dec, 2, 4, {"0": 0, "1": 0, "2": 1, "3": 1})


def test_replicated_heads_tp4_to_tp1(roles: tuple[Role, Role]) -> None:
    """Prefill ranks 0, 1 hold head 0 and 2, 3 head 1: the decode reads head 0 from
    rank 0 and head 1 from rank 2; ranks 1 and 3, read by nobody, conclude too."""
    pre, dec = roles
    _replicated(pre, dec, 4, 1, {"0": 0})


def test_replicated_heads_tp4_to_tp2(roles: tuple[Role, Role]) -> None:
    """Decode rank 0 reads head 0 from prefill rank 0, decode rank 1 head 1 from
    prefill rank 3 (its replica ``1 % 2``)."""
    pre, dec = roles
    _replicated(pre, dec, 4, 2, {"0": 0, "1": 3})


def _refused_at_startup(role: Role, mode: str, **setting: int) -> str:
    port = next(_ports)
    return role.fails(
        "setup", name=f"refuse{port}", mode=mode, tp=1, ranks_here=[0], page_size=4, heads=2, head_dim=8, pages=4,
        layers=1, mla=False, seed=1, aux_rows=2, port=port, no_server=True, **setting,
    )


def test_pipeline_parallelism_refused_at_startup(roles: tuple[Role, Role]) -> None:
    pre, dec = roles
    for role, mode in ((pre, "prefill"), (dec, "decode")):
        err = _refused_at_startup(role, mode, pp_size=2)
        assert err.startswith("NotImplementedError") and "pipeline parallelism (--pp-size 2)" in err, err


def test_context_parallelism_refused_at_startup(roles: tuple[Role, Role]) -> None:
    pre, dec = roles
    for role, mode in ((pre, "prefill"), (dec, "decode")):
        err = _refused_at_startup(role, mode, attn_cp_size=2)
        assert err.startswith("NotImplementedError") and "attention context parallelism (--attn-cp-size 2)" in err, err
        err = _refused_at_startup(role, mode, dcp_size=4)
        assert "decode context parallelism (--dcp-size 4)" in err, err


def test_decode_without_head_count_and_model_config_refused_at_startup(roles: tuple[Role, Role]) -> None:
    """SGLang's decode gives the backend no KV head count without staging; the backend
    then reads the model config, and where there is none (no SGLang runtime here) it
    refuses at start-up saying so, instead of guessing a head split."""
    _, dec = roles
    err = _refused_at_startup(dec, "decode", no_heads=True)
    assert err.startswith("ValueError") and "carry no KV head count" in err and "model config" in err, err


def test_prefill_with_pipeline_parallelism_refused_at_bootstrap(roles: tuple[Role, Role]) -> None:
    """A prefill whose bootstrap server reports pp_size 2 (registered straight through
    SGLang's own /route API, as another backend's prefill would): the decode fails the
    request at bootstrap, naming the setting."""
    import requests

    pre, dec = roles
    port = next(_ports)
    common: dict[str, Any] = dict(head_dim=8, pages=8, layers=1, mla=False, seed=port, aux_rows=4, port=port, page_size=4, heads=2)
    pre("setup", name=f"pp{port}", mode="prefill", tp=1, ranks_here=[], **common)
    reg = {
        "attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0, "attn_dp_size": 1, "attn_dp_rank": 0,
        "pp_size": 2, "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "127.0.0.1", "rank_port": 1,
        "page_size": 4, "kv_cache_dtype": "int16",
    }
    deadline = time.monotonic() + 10
    for pp_rank in (0, 1):  # both stages, or the server answers "not fully registered"
        while True:
            try:
                r = requests.put(f"http://127.0.0.1:{port}/route", json={**reg, "pp_rank": pp_rank}, timeout=5)
                assert r.status_code == 200, r.text
                break
            except requests.ConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
    dec("setup", name=f"pp{port}", mode="decode", tp=1, ranks_here=[0], **common)
    room = next(_rooms)
    dec("start", group=f"pp{port}", room=room, pages=[1, 2], aux_index=0)
    assert wait_for(dec, f"pp{port}", room, {FAILED, SUCCESS}) == FAILED
    err = dec("failure", group=f"pp{port}", room=room)["errors"]["0"]
    assert "refused pairing at bootstrap" in err and "pipeline parallelism (--pp-size 2)" in err, err


def test_mla_tp2_to_tp1_and_tp1_to_tp2(roles: tuple[Role, Role]) -> None:
    pre, dec = roles
    g = pair(pre, dec, "mla21", 2, 1, mla=True)
    run_transfer(pre, dec, g, [[4, 5], [6]], [20, 21, 22])
    g = pair(pre, dec, "mla12", 1, 2, mla=True)
    run_transfer(pre, dec, g, [[1], [2, 3]], [7, 8, 9])


def test_page_size_mismatch_refused_by_name(roles: tuple[Role, Role]) -> None:
    pre, dec = roles
    g = pair(pre, dec, "pagesz", 1, 1, page_size=4, d_page_size=8)
    room = next(_rooms)
    pre("start", group="pagesz", room=room, pages=[1, 2], aux_index=0)
    dec("start", group="pagesz", room=room, pages=[3, 4], aux_index=0)
    assert wait_for(dec, "pagesz", room, {FAILED, SUCCESS}) == FAILED
    err = dec("failure", group="pagesz", room=room)["errors"]["0"]
    assert "KvferryTransferError" in err and "page size differs: prefill 4 tokens, decode 8" in err, err
    del g


def test_decode_abort_frees_prefill(roles: tuple[Role, Role]) -> None:
    pre, dec = roles
    pair(pre, dec, "dabort", 2, 2)
    # after the metadata, before any chunk
    room = next(_rooms)
    pre("start", group="dabort", room=room, pages=[1, 2, 3], aux_index=0)
    dec("start", group="dabort", room=room, pages=[4, 5, 6], aux_index=0)
    assert wait_for(pre, "dabort", room, {WAITING, FAILED}) == WAITING
    dec("abort", group="dabort", room=room)
    assert reduced(dec, "dabort", room) == FAILED
    assert wait_for(pre, "dabort", room, {FAILED}, timeout=5) == FAILED
    assert "aborted by decode" in pre("failure", group="dabort", room=room)["errors"]["0"]
    # mid-transfer: one chunk sent, the last never
    room = next(_rooms)
    pre("start", group="dabort", room=room, pages=[1, 2, 3], aux_index=0)
    dec("start", group="dabort", room=room, pages=[4, 5, 6], aux_index=0)
    assert wait_for(pre, "dabort", room, {WAITING, FAILED}) == WAITING
    pre("send", group="dabort", room=room, pages=[1])
    assert wait_for(dec, "dabort", room, {TRANSFERRING, FAILED}) == TRANSFERRING
    dec("abort", group="dabort", room=room)
    assert wait_for(dec, "dabort", room, {FAILED}, timeout=5) == FAILED
    assert wait_for(pre, "dabort", room, {FAILED}, timeout=5) == FAILED


def test_prefill_abort_fails_decode(roles: tuple[Role, Role]) -> None:
    pre, dec = roles
    pair(pre, dec, "pabort", 2, 2)
    for sent in ([], [[1, 2]]):
        room = next(_rooms)
        pre("start", group="pabort", room=room, pages=[1, 2, 3, 4], aux_index=0)
        dec("start", group="pabort", room=room, pages=[5, 6, 7, 8], aux_index=0)
        assert wait_for(pre, "pabort", room, {WAITING, FAILED}) == WAITING
        for c in sent:
            pre("send", group="pabort", room=room, pages=c)
        pre("abort", group="pabort", room=room)
        assert reduced(pre, "pabort", room) == FAILED
        assert wait_for(dec, "pabort", room, {FAILED}, timeout=5) == FAILED
        err = dec("failure", group="pabort", room=room)["errors"]
        assert all("aborted by prefill" in e for e in err.values()), err


def test_unanswering_bootstrap_fails_within_timeout(roles: tuple[Role, Role]) -> None:
    _, dec = roles
    port = next(_ports)
    dec("setup", name="nobs", mode="decode", tp=1, ranks_here=[0], page_size=4, heads=4, head_dim=8, pages=8,
        layers=1, mla=False, seed=1, aux_rows=2, port=port)
    room = next(_rooms)
    t0 = time.monotonic()
    dec("start", group="nobs", room=room, pages=[1], aux_index=0)  # nothing listens on the port
    assert wait_for(dec, "nobs", room, {FAILED, SUCCESS}, timeout=30) == FAILED
    assert time.monotonic() - t0 < 25
    assert "did not answer within 10 s" in dec("failure", group="nobs", room=room)["errors"]["0"]


def test_prefill_sigkill_mid_transfer(roles: tuple[Role, Role]) -> None:
    _, dec = roles
    victim = Role()
    try:
        g = pair(victim, dec, "kill", 2, 2)
        room = next(_rooms)
        victim("start", group="kill", room=room, pages=[1, 2, 3, 4], aux_index=0)
        dec("start", group="kill", room=room, pages=[5, 6, 7, 8], aux_index=0)
        assert wait_for(victim, "kill", room, {WAITING, FAILED}) == WAITING
        victim("send", group="kill", room=room, pages=[1, 2])
        assert wait_for(dec, "kill", room, {TRANSFERRING, FAILED}) == TRANSFERRING
        victim.p.kill()
        t0 = time.monotonic()
        assert wait_for(dec, "kill", room, {FAILED, SUCCESS}, timeout=20) == FAILED
        took = time.monotonic() - t0
        assert took < 12, took  # KVFERRY_SGLANG_TIMEOUT=10; the liveness probe is faster
        err = dec("failure", group="kill", room=room)["errors"]
        assert err and all("KvferryTransferError" in e for e in err.values()), err
        del g
    finally:
        victim.close()


def test_layout_mismatch_refused_by_the_prefill_by_name(roles: tuple[Role, Role]) -> None:
    """What the bootstrap server does not carry (heads, MLA) the prefill checks when the
    decode announces itself: both sides fail, naming the difference."""
    pre, dec = roles
    port = next(_ports)
    common: dict[str, Any] = dict(head_dim=8, pages=8, layers=2, mla=False, seed=port, aux_rows=4, port=port, page_size=4, tp=1, ranks_here=[0])
    pre("setup", name="heads", mode="prefill", heads=4, **common)
    dec("setup", name="heads", mode="decode", heads=8, **common)
    room = next(_rooms)
    pre("start", group="heads", room=room, pages=[1, 2], aux_index=0)
    dec("start", group="heads", room=room, pages=[3, 4], aux_index=0)
    assert wait_for(dec, "heads", room, {FAILED, SUCCESS}) == FAILED
    assert wait_for(pre, "heads", room, {FAILED, SUCCESS}) == FAILED
    d = dec("failure", group="heads", room=room)["errors"]["0"]
    p = pre("failure", group="heads", room=room)["errors"]["0"]
    assert "refused pairing" in d and "total KV heads differ: prefill 4, decode 8" in d, d
    assert "refused pairing with decode rank 0" in p and "total KV heads differ" in p, p
