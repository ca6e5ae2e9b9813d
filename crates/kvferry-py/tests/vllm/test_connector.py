"""KvferryConnector against vLLM 0.33.0's real scheduler, on CPU.

Each instance is a real ``vllm.v1.core.sched.scheduler.Scheduler`` driving a worker-side
connector (created by vLLM's ``KVConnectorFactory`` from the module path, called through
vLLM's own model-runner connector lifecycle) over torch CPU KV tensors. The "forward"
writes known bytes for every computed token; the model is a tiny config.json only (no
weights: nothing runs a model). The prefill instance runs in a spawned process (its own
vLLM engine loop, killable); the decode instance runs in the test process.

Needs vLLM: ``scripts/install-vllm.sh`` (or ``pip install vllm==0.33.0``), then
``$KVFERRY_VLLM_VENV/bin/python -m pytest crates/kvferry-py/tests/vllm``. Without vLLM
the module is skipped, unless ``KVFERRY_REQUIRE_VLLM=1`` (then it fails).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import torch

from vllm_harness import (  # noqa: F401 - shared with the other vLLM tests; need_vllm is a fixture
    LAYERS,
    allocate,
    attention_layers,
    backend_class,
    kv_views,
    MODEL_DIR,
    NUM_LAYERS,
    PINNED,
    REQUIRED,
    WHY_NOT,
    need_vllm,
    prompts,
    scheduler_leaks,
)

BLOCK_SIZE = 16
BACKEND = "FLASH_ATTN"  # its layout, allocated on CPU by vLLM (block size 16: the CPU backend takes multiples of 32)
KV_HEADS = 2
HEAD_SIZE = 16
SLOT_BYTES = KV_HEADS * HEAD_SIZE * 2  # float16


# -- one vLLM instance: real scheduler + worker-side connector -----------------------


def _pattern(token: int, pos: int, layer: int, kv: int, salt: int) -> torch.Tensor:
    """The bytes a "forward" writes for one token's K or V in one layer."""
    import torch

    base = (token * 7 + pos * 13 + layer * 29 + kv * 101 + salt * 53) % 256
    return (torch.arange(SLOT_BYTES, dtype=torch.int32) * 3 + base).remainder(256).to(torch.uint8)


class Instance:
    """A vLLM instance minus the model: the real Scheduler, and the connector's worker
    half called the way vLLM's model runner calls it."""

    def __init__(
        self,
        role: str,
        extra: dict[str, Any],
        num_blocks: int = 512,
        salt: int = 0,
        policy: str = "recompute",
        log_stats: bool = False,
        kv_events: Any = None,
    ) -> None:
        import torch

        # The socket mover (send delays and wire counts below), unless a test says.
        extra = {"transport": os.environ.get("KVFERRY_TEST_TRANSPORT", "tcp"), **extra}
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.utils.hashing import sha256

        model = ModelConfig(model=MODEL_DIR, skip_tokenizer_init=True, dtype="float16", max_model_len=1024, seed=0)
        self.vllm_config = VllmConfig(
            model_config=model,
            cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(
                max_num_seqs=128, max_num_batched_tokens=8192, max_model_len=1024, is_encoder_decoder=False
            ),
            device_config=DeviceConfig("cpu"),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KvferryConnector",
                kv_connector_module_path="kvferry.integrations.vllm",
                kv_role=role,
                kv_connector_extra_config=extra,
                kv_load_failure_policy=policy,
            ),
            kv_events_config=kv_events,  # a vllm.config.KVEventsConfig, or None
        )
        # The KV cache as vLLM makes it: flash-attn's real layers, the layout vLLM
        # resolves (the connector asks for LBHNC), allocated by allocate_kv_cache.
        layers = attention_layers(self.vllm_config, BACKEND, 2 * KV_HEADS, KV_HEADS, HEAD_SIZE)
        specs = {n: layer.get_kv_cache_spec(self.vllm_config) for n, layer in layers.items()}
        self.kv_cache_config, (self.kv,), _ = allocate([self.vllm_config], specs, [backend_class(BACKEND)], num_blocks)
        self.kvv = {n: kv_views(BACKEND, t, HEAD_SIZE) for n, t in self.kv.items()}  # (K, V) [blocks, tokens, heads, hs]
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=BLOCK_SIZE,
            log_stats=log_stats,
        )
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        # The worker half, as vLLM's worker makes it (ensure_kv_transfer_initialized).
        self.connector = KVConnectorFactory.create_connector(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
        kv_transfer_state._KV_CONNECTOR_AGENT = self.connector
        self.connector.register_kv_caches(self.kv)
        # EngineCore._set_kv_connector_handshake_metadata
        hs = self.connector.get_handshake_metadata()
        self.scheduler.get_kv_connector().set_xfer_handshake_metadata_pp_aware({(0, 0): hs})
        self.salt = salt
        self.free_at_start = self.free_blocks()
        self.final: dict[str, Any] = {}  # req_id -> EngineCoreOutput that finished it
        self.tokens: dict[str, list[int]] = {}
        self.finished_sending: dict[str, float] = {}
        self.finished_recving: dict[str, float] = {}
        self.failed_recving: set[str] = set()
        self.invalid_blocks: set[int] = set()
        self.landed: dict[str, list[list[bytes]]] = {}  # req_id -> prompt slots when it landed
        self.stats = type(self.connector).build_kv_connector_stats()  # every step's, combined
        self.scheduler_stats: list[Any] = []  # vLLM's SchedulerStats per step (log_stats)

    @property
    def worker(self):
        return self.connector.connector_worker

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def add(self, req_id: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None, **sampling: Any) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, extra_args={"kv_transfer_params": params} if params else None, **sampling
        )
        req = Request(req_id, list(prompt), sp, None, block_hasher=self.hasher)
        self.scheduler.add_request(req)

    def abort(self, req_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    def status(self, req_id: str):
        r = self.scheduler.requests.get(req_id)
        return None if r is None else r.status

    def step(self) -> None:
        import torch
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.forward_context import set_forward_context
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

        kv_transfer_state._KV_CONNECTOR_AGENT = self.connector  # this process's worker
        so = self.scheduler.schedule()
        self.last_output = so
        # GPUModelRunner.execute_model (and MRV2's pre_forward): before the forward.
        self.connector.handle_preemptions(so.kv_connector_metadata)
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        with (
            set_forward_context(None, self.vllm_config),
            KVConnectorModelRunnerMixin._get_kv_connector_output(so) as kvo,
        ):
            for rid in req_ids:  # the "forward": KV for every scheduled token
                req = self.scheduler.requests[rid]
                n = so.num_scheduled_tokens[rid]
                end = req.num_computed_tokens  # already advanced by schedule()
                (blocks,) = self.scheduler.kv_cache_manager.get_block_ids(rid)
                toks = req.all_token_ids
                for pos in range(end - n, end):
                    b, off = blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE
                    for li, name in enumerate(LAYERS):
                        for kvi in (0, 1):  # every head's K (or V) of the token, as the backend reads it
                            self.kvv[name][kvi][b, off].view(torch.uint8)[:] = _pattern(toks[pos], pos, li, kvi, self.salt).view(KV_HEADS, -1)
                sampled.append([3 + (end * 17) % 1000] if end >= req.num_tokens else [])
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kvo,
        )
        now = time.monotonic()
        for rid in kvo.finished_sending or ():
            self.finished_sending[rid] = now
        for rid in kvo.finished_recving or ():
            self.finished_recving[rid] = now
        self.failed_recving |= kvo.failed_recving
        self.invalid_blocks |= kvo.invalid_block_ids
        if kvo.kv_connector_stats is not None:
            self.stats.aggregate(kvo.kv_connector_stats)
        for outs in self.scheduler.update_from_output(so, mro).values():
            if outs.scheduler_stats is not None:  # log_stats: what vLLM's stat loggers get
                self.scheduler_stats.append(outs.scheduler_stats)
            for o in outs.outputs:
                self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.final[o.request_id] = o
        for rid in kvo.finished_recving or ():
            req = self.scheduler.requests.get(rid)
            if req is not None and not req.is_finished() and rid not in kvo.failed_recving:
                # Snapshot before the next step's forward touches the request.
                (blocks,) = self.scheduler.kv_cache_manager.get_block_ids(rid)
                self.landed[rid] = [self.slot_bytes(blocks, pos) for pos in range(req.num_prompt_tokens)]

    def run_until(self, pred, timeout: float, what: str) -> float:
        t0 = time.monotonic()
        while not pred():
            if time.monotonic() - t0 > timeout:
                pulls = {r: (p.attempts, p.transfer, p.error) for r, p in self.worker._pulls.items()}
                raise AssertionError(
                    f"timed out after {timeout}s waiting for {what}; pulls in flight: {pulls}; "
                    f"received: {sorted(self.finished_recving)}; failed: {sorted(self.failed_recving)}"
                )
            self.step()
            time.sleep(0.002)
        return time.monotonic() - t0

    def slot_bytes(self, req_id_blocks: list[int], pos: int) -> list[bytes]:
        import torch

        b, off = req_id_blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE
        return [bytes(self.kvv[n][kvi][b, off].view(torch.uint8).reshape(-1).numpy()) for n in LAYERS for kvi in (0, 1)]

    def close(self) -> None:
        from vllm.distributed.kv_transfer import kv_transfer_state

        self.connector.shutdown()
        if kv_transfer_state._KV_CONNECTOR_AGENT is self.connector:
            kv_transfer_state._KV_CONNECTOR_AGENT = None


def expected_bytes(prompt: list[int], pos: int, salt: int) -> list[bytes]:
    return [bytes(_pattern(prompt[pos], pos, li, kvi, salt).numpy()) for li in range(NUM_LAYERS) for kvi in (0, 1)]


# -- the prefill instance, in its own process ------------------------------------------


def prefill_main(conn, extra: dict[str, Any], num_blocks: int) -> None:
    """A prefill engine loop: steps whenever the scheduler has work (as EngineCore
    does), answering commands between steps."""
    inst = Instance("kv_producer", extra, num_blocks=num_blocks, salt=1)
    conn.send(("ready", inst.worker.engine.address, inst.worker.engine.incarnation, inst.free_at_start))
    reported: set[str] = set()
    hold_after_finish = 0.0  # seconds the loop pauses after a step that finished requests
    hold_until = 0.0
    while True:
        held = time.monotonic() < hold_until
        busy = inst.scheduler.has_requests() and not held
        while conn.poll(0 if busy else 0.005):
            msg = conn.recv()
            cmd = msg[0]
            if cmd == "add":
                for rid, prompt in msg[1]:
                    inst.add(rid, prompt, 1, {"do_remote_decode": True})
                conn.send(("ok",))
            elif cmd == "faults":
                inst.worker.engine._e._inject_faults(send_delay_us=msg[1])
                conn.send(("ok",))
            elif cmd == "hold_after_finish":
                # A slow prefill: the next step that finishes requests is followed by
                # this long a pause, so their publication comes late.
                hold_after_finish = float(msg[1])
                conn.send(("ok",))
            elif cmd == "device_fault":
                inst.worker.engine._e._inject_device_fault(msg[1], msg[2])
                conn.send(("ok",))
            elif cmd == "corrupt":
                inst.worker.engine._e._inject_faults(corrupt_next_sends=msg[1])
                conn.send(("ok",))
            elif cmd == "device_release":
                inst.worker.engine._e._release_device()
                conn.send(("ok",))
            elif cmd == "device_stats":
                conn.send(("device_stats", inst.worker.engine.stats().get("device", {})))
            elif cmd == "leaks":
                conn.send(("leaks", scheduler_leaks(inst.scheduler)))
            elif cmd == "blocks":
                mgr = inst.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
                conn.send(("blocks", {r: [b.ref_cnt for b in bl] for r, bl in mgr.req_to_blocks.items()}))
            elif cmd == "state":
                conn.send(
                    (
                        "state",
                        {
                            "held": sorted(inst.scheduler.requests),
                            "free": inst.free_blocks(),
                            "free_at_start": inst.free_at_start,
                            "finished_sending": dict(inst.finished_sending),
                            "publishing": sorted(inst.worker._sending),
                            "now": time.monotonic(),
                        },
                    )
                )
            elif cmd == "stop":
                inst.close()
                conn.send(("stopped",))
                return
        if busy:
            inst.step()
            new = {r: o for r, o in inst.final.items() if r not in reported}
            if new:
                if hold_after_finish:
                    hold_until, hold_after_finish = time.monotonic() + hold_after_finish, 0.0
                reported |= set(new)
                conn.send(("finished", {r: (str(o.finish_reason), o.kv_transfer_params) for r, o in new.items()}))


class Prefill:
    """Handle on a prefill instance in a spawned process."""

    def __init__(self, extra: dict[str, Any], num_blocks: int = 1024) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=prefill_main, args=(child, extra, num_blocks), daemon=True)
        self.proc.start()
        deadline = time.monotonic() + 300
        while not self.conn.poll(0.2):
            if not self.proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"prefill process did not start (exit code {self.proc.exitcode})")
        _, self.address, self.incarnation, self.free_at_start = self.conn.recv()
        self.finished: dict[str, tuple[str, dict[str, Any]]] = {}
        self._stash: list[tuple] = []

    def _call(self, *msg: Any, timeout: float = 60.0) -> tuple:
        self.conn.send(msg)
        deadline = time.monotonic() + timeout
        while True:
            if not self._poll(deadline):
                raise AssertionError(f"prefill did not answer {msg[0]!r}")
            r = self.conn.recv()
            if r[0] == "finished":
                self.finished.update(r[1])
                continue
            return r

    def _poll(self, deadline: float) -> bool:
        while not self.conn.poll(0.1):
            if not self.proc.is_alive() or time.monotonic() > deadline:
                return False
        return True

    def prefill(self, reqs: list[tuple[str, list[int]]], timeout: float = 120.0) -> dict[str, dict[str, Any]]:
        """Runs these requests' prefill; returns their kv_transfer_params."""
        self._call("add", reqs)
        deadline = time.monotonic() + timeout
        want = {r for r, _ in reqs}
        while not want <= set(self.finished):
            if not self._poll(deadline):
                raise AssertionError(f"prefill of {sorted(want - set(self.finished))} did not finish")
            r = self.conn.recv()
            assert r[0] == "finished", r
            self.finished.update(r[1])
        return {r: self.finished[r][1] for r in want}

    def state(self) -> dict[str, Any]:
        return self._call("state")[1]

    def faults(self, send_delay_us: int) -> None:
        self._call("faults", send_delay_us)

    def hold_after_finish(self, seconds: float) -> None:
        """The next prefill step that finishes requests is followed by a pause of
        ``seconds``: their blocks are published that much later."""
        self._call("hold_after_finish", seconds)

    def device_fault(self, fault: str, trigger: str = "next") -> None:
        """Arms a sim device fault in the prefill's engine (a ``device="sim"`` prefill)."""
        self._call("device_fault", fault, trigger)

    def device_stats(self) -> dict[str, Any]:
        return self._call("device_stats")[1]

    def leaks(self) -> list[str]:
        """:func:`scheduler_leaks` of the prefill instance's scheduler."""
        return self._call("leaks")[1]

    def block_refs(self) -> dict[str, list[int]]:
        """Per request the prefill scheduler holds blocks for: their ref counts."""
        return self._call("blocks")[1]

    def wait_freed(self, req_ids: set[str], timeout: float) -> dict[str, Any]:
        """Waits until the prefill instance freed these requests' blocks; returns its
        state (``free == free_at_start`` once it holds no request at all)."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.state()
            if not req_ids & set(st["held"]):
                return st
            if time.monotonic() > deadline:
                raise AssertionError(f"prefill still holds {sorted(req_ids & set(st['held']))}")
            time.sleep(0.02)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self._call("stop", timeout=30)
            except (AssertionError, OSError, EOFError):
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.kill()


LEASE_TTL = 8.0
TIMEOUT = 10.0


@pytest.fixture(scope="module", params=["host", "sim"])
def kv_device(request) -> str:
    """Every test below runs twice: KV in CPU memory moved zero copy (``host``), and
    the same CPU tensors adopted as kvferry's sim device memory on both instances
    (``sim``: connector option ``device="sim"``), so the whole device path — staging,
    device-to-host and host-to-device copies, events — runs under vLLM's scheduler."""
    return str(request.param)


def with_device(extra: dict[str, Any], kv_device: str) -> dict[str, Any]:
    return {**extra, "device": "sim"} if kv_device == "sim" else dict(extra)


@pytest.fixture(scope="module")
def prefill(need_vllm, kv_device):
    p = Prefill(with_device({"lease_ttl": LEASE_TTL, "timeout": TIMEOUT}, kv_device))
    yield p
    p.stop()


@pytest.fixture
def decode(need_vllm, kv_device):
    made: list[Instance] = []

    def make(**kw) -> Instance:
        kw["extra"] = with_device(kw.get("extra", {"timeout": TIMEOUT}), kv_device)
        d = Instance("kv_consumer", num_blocks=kw.pop("num_blocks", 1024), salt=2, **kw)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


def check_landed(d: Instance, rid: str, prompt: list[int]) -> None:
    """When the pull landed, every prompt position held the prefill's bytes (salt 1;
    the decode writes salt 2, so nothing it computed itself can pass)."""
    slots = d.landed[rid]
    assert len(slots) == len(prompt)
    for pos in range(len(prompt)):
        assert slots[pos] == expected_bytes(prompt, pos, salt=1), f"{rid}: position {pos} differs"


# -- tests ------------------------------------------------------------------------------


def test_lifecycle_prefill_to_decode(prefill, decode, kv_device):
    d = decode()  # made first: building a vLLM config takes seconds on a busy machine
    (rid, prompt), = prompts(1, seed=1, lo=50, hi=51)
    params = prefill.prefill([(rid, prompt)])[rid]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_request_id"] == rid
    assert len(params["remote_block_ids"]) == 4  # 50 tokens, 16 per block
    host, port = prefill.address.rsplit(":", 1)
    assert params["remote_host"] == host and params["remote_port"] == int(port)
    assert params["kvferry_incarnation"] == prefill.incarnation and params["kvferry_peer_id"]
    assert params["remote_engine_id"]
    assert rid in prefill.state()["held"], "prefill frees blocks before the decode pulled"

    d.add(rid, prompt, max_tokens=3, params=params)
    d.step()
    from vllm.v1.request import RequestStatus

    assert d.status(rid) == RequestStatus.WAITING_FOR_REMOTE_KVS
    d.run_until(lambda: rid in d.finished_recving, 10, "the pull")
    assert not d.failed_recving and not d.invalid_blocks
    check_landed(d, rid, prompt)
    d.run_until(lambda: rid in d.final, 10, "decode to finish")
    assert len(d.tokens[rid]) == 3
    st = prefill.wait_freed({rid}, timeout=5)
    assert rid in st["finished_sending"]
    assert st["free"] == st["free_at_start"], "prefill leaked blocks"
    assert d.free_blocks() == d.free_at_start
    if kv_device == "sim":  # the bytes went through device copies on both sides
        assert d.worker.engine.stats()["device"]["operations"] >= 1
        assert prefill.device_stats()["operations"] >= 1


@pytest.mark.parametrize("kv_device", ["sim"], indirect=True)  # faults need the sim device
def test_device_faults_fail_only_their_requests(prefill, decode, kv_device):
    """Sim device on both sides. Decode side: of 48 pulls in flight, the one whose
    host-to-device copy never completes fails within ``device_timeout`` (+ slack), its
    staging pages quarantined; the 47 others land. Its blocks go back to vLLM (the load
    error) only once the device confirmed the copy (here: the sim device released).
    Prefill side: a device-to-host gather that fails becomes a load error for its
    request only, and the prefill's blocks are freed within a round trip (the decode
    releases them)."""
    bound = 2.0
    d = decode(extra={"timeout": TIMEOUT, "device_timeout": bound})
    reqs = prompts(48, seed=30, lo=20, hi=100)
    params = prefill.prefill(reqs)
    d.worker.engine._e._inject_device_fault("never_complete", "5")  # the 5th device op
    for rid, prompt in reqs:
        d.add(rid, prompt, max_tokens=2, params=params[rid])
    t0 = time.monotonic()
    d.run_until(lambda: sum(r in d.finished_recving for r, _ in reqs) == 47, TIMEOUT, "47 pulls")
    (stuck,) = [r for r, _ in reqs if r not in d.finished_recving]
    t = d.worker._pulls[stuck].transfer
    d.run_until(t.done, bound + 2.0 - (time.monotonic() - t0), "the stuck pull to fail")
    assert isinstance(t.error, Exception) and not t.drained()
    for rid, prompt in reqs:
        if rid != stuck:
            check_landed(d, rid, prompt)
    assert d.worker.engine.stats()["arena"]["quarantined_pages"] > 0, "the stuck copy's pages stay out of use"
    for _ in range(10):
        d.step()
    assert not d.failed_recving and stuck not in d.finished_recving, "blocks handed back before the device confirmed"
    d.worker.engine._e._release_device()
    d.run_until(lambda: stuck in d.finished_recving, 5, "the stuck pull, drained")
    assert d.failed_recving == {stuck}
    assert d.stats.data["failed"]["device"] == 1
    d.run_until(lambda: all(r in d.final for r, _ in reqs), 30, "the decodes (the stuck one recomputed)")
    prefill.wait_freed({r for r, _ in reqs}, timeout=5)
    assert d.free_blocks() == d.free_at_start

    # The prefill's gather fails for one request.
    (rid, prompt), = prompts(1, seed=31, lo=40, hi=41)
    params = prefill.prefill([(rid, prompt)])
    prefill.device_fault("fail_copy", "next")
    d2 = decode(extra={"timeout": TIMEOUT})
    d2.add(rid, prompt, max_tokens=2, params=params[rid])
    d2.run_until(lambda: rid in d2.finished_recving, TIMEOUT, "the failed pull")
    assert d2.failed_recving == {rid}
    prefill.wait_freed({rid}, timeout=3.0)
    d2.run_until(lambda: rid in d2.final, 10, "the request, recomputed")
    assert d2.free_blocks() == d2.free_at_start


def test_concurrent_requests(prefill, decode):
    d = decode()
    reqs = prompts(48, seed=2, lo=1, hi=200)
    params = prefill.prefill(reqs)
    for rid, prompt in reqs:
        d.add(rid, prompt, max_tokens=2, params=params[rid])
    d.step()
    d.run_until(lambda: all(r in d.finished_recving for r, _ in reqs), 30, "48 pulls")
    assert not d.failed_recving and not d.invalid_blocks
    for rid, prompt in reqs:
        check_landed(d, rid, prompt)
    d.run_until(lambda: all(r in d.final for r, _ in reqs), 30, "48 decodes")
    st = prefill.wait_freed({r for r, _ in reqs}, timeout=10)
    assert st["free"] == st["free_at_start"]
    assert d.free_blocks() == d.free_at_start


def test_local_prefix_hit_pulls_only_the_rest(prefill, decode):
    rng = random.Random(5)
    shared = [rng.randrange(3, 1000) for _ in range(40)]  # 2 full blocks shared
    a = ("prefix-a", shared + [rng.randrange(3, 1000) for _ in range(30)])
    b = ("prefix-b", shared + [rng.randrange(3, 1000) for _ in range(25)])
    d = decode()
    params = prefill.prefill([a, b])
    d.add(a[0], a[1], max_tokens=1, params=params[a[0]])
    d.run_until(lambda: a[0] in d.final, 10, "first request")
    started = []
    real = d.worker._start_pull
    d.worker._start_pull = lambda rid, spec, exp: (started.append((rid, spec)), real(rid, spec, exp))
    d.add(b[0], b[1], max_tokens=1, params=params[b[0]])
    d.run_until(lambda: b[0] in d.finished_recving, 10, "second pull")
    (rid, spec), = started
    assert rid == b[0] and spec.skip_blocks == 2 and len(spec.remote_block_ids) == 5
    assert len(spec.load_block_ids) == 3  # only the blocks the local cache lacks
    assert not d.failed_recving
    check_landed(d, b[0], b[1])
    d.run_until(lambda: b[0] in d.final, 10, "second request")
    prefill.wait_freed({a[0], b[0]}, timeout=5)


def test_decode_abort_mid_pull(prefill, decode):
    d = decode()
    reqs = prompts(2, seed=3, lo=64, hi=65)
    params = prefill.prefill(reqs)
    prefill.faults(send_delay_us=300_000)  # 300 ms per chunk sent
    try:
        for rid, prompt in reqs:
            d.add(rid, prompt, max_tokens=2, params=params[rid])
        d.step()
        time.sleep(0.1)
        (gone, _), (kept, kept_prompt) = reqs
        d.abort(gone)
        t = d.run_until(lambda: gone in d.finished_recving, 5, "the aborted pull to drain")
        assert t < 2.0
        assert gone not in d.scheduler.requests  # blocks back in decode's pool
        assert gone not in d.failed_recving
        d.run_until(lambda: kept in d.finished_recving, 15, "the other pull")
        assert not d.failed_recving
        check_landed(d, kept, kept_prompt)
        d.run_until(lambda: kept in d.final, 5, "the other request")
        prefill.wait_freed({kept}, timeout=2.0)  # the decode's Done released it
        # The abort told the prefill instance (release through kvferry): it frees the
        # aborted request's blocks at once, long before the lease would expire.
        st = prefill.wait_freed({gone}, timeout=3.0)
        assert gone in st["finished_sending"]
        assert not prefill.state()["publishing"]
        assert d.free_blocks() == d.free_at_start
        assert not d.worker._releases, "every release finished"
    finally:
        prefill.faults(send_delay_us=0)


def test_decode_abort_before_pull_releases_at_once(prefill, decode):
    d = decode()
    reqs = prompts(3, seed=10, lo=30, hi=90)
    params = prefill.prefill(reqs)
    t0 = time.monotonic()
    for rid, prompt in reqs:
        d.add(rid, prompt, max_tokens=2, params=params[rid])
    # Aborted while still waiting: the decode scheduler never allocated or pulled.
    for rid, _ in reqs:
        d.abort(rid)
    d.step()  # the next step's metadata carries the releases to the worker
    st = prefill.wait_freed({r for r, _ in reqs}, timeout=3.0)
    assert time.monotonic() - t0 < LEASE_TTL / 2, "freed by the release, not the lease"
    assert {r for r, _ in reqs} <= set(st["finished_sending"])
    assert not d.finished_recving and not d.failed_recving, "nothing was pulled"
    d.run_until(lambda: not d.worker._releases, 5, "the releases to finish")
    assert d.free_blocks() == d.free_at_start
    assert d.worker.engine.stats()["consumer"]["draining"] == 0


def test_never_pulled_frees_at_lease_expiry(prefill):
    (rid, prompt), = prompts(1, seed=4)
    t0 = time.monotonic()
    prefill.prefill([(rid, prompt)])
    time.sleep(LEASE_TTL / 2)
    assert rid in prefill.state()["held"]
    st = prefill.wait_freed({rid}, timeout=LEASE_TTL + 5)
    assert time.monotonic() - t0 >= LEASE_TTL * 0.9
    assert rid in st["finished_sending"]
    assert st["free"] == st["free_at_start"] or st["held"], "prefill leaked blocks"


def test_pull_after_lease_expiry_is_a_load_error(prefill, decode):
    recompute = decode(policy="recompute")
    fail = decode(policy="fail")  # vLLM's default kv_load_failure_policy
    (r1, p1), (r2, p2) = prompts(2, seed=6)
    params = prefill.prefill([(r1, p1), (r2, p2)])
    prefill.wait_freed({r1, r2}, timeout=LEASE_TTL + 5)
    recompute.add(r1, p1, max_tokens=2, params=params[r1])
    fail.add(r2, p2, max_tokens=2, params=params[r2])
    for d, rid in ((recompute, r1), (fail, r2)):
        d.run_until(lambda: rid in d.finished_recving, 10, "the failed pull")
        assert d.failed_recving == {rid} and d.invalid_blocks
        d.run_until(lambda: rid in d.final, 10, "the request to finish")
        assert d.free_blocks() == d.free_at_start
    assert len(recompute.tokens[r1]) == 2  # computed locally
    assert str(fail.final[r2].finish_reason) == "error" and not fail.tokens.get(r2)


def test_prefill_killed_mid_pull_then_restarted(need_vllm):
    timeout = 5.0
    p = Prefill({"lease_ttl": 30.0, "timeout": timeout})
    d = again = None
    try:
        d = Instance("kv_consumer", {"timeout": timeout}, num_blocks=1024, salt=2, policy="recompute")
        reqs = prompts(8, seed=7, lo=40, hi=100)
        params = p.prefill(reqs)
        p.faults(send_delay_us=500_000)
        for rid, prompt in reqs:
            d.add(rid, prompt, max_tokens=2, params=params[rid])
        # Requests that do not involve the dead instance: plain prompts.
        local = prompts(2, seed=8)
        for rid, prompt in local:
            d.add(rid, prompt, max_tokens=2, params=None)
        d.step()
        time.sleep(0.2)
        assert all(r in d.worker._pulls for r, _ in reqs), "every pull is in flight"
        loading = {b for r, _ in reqs for b in d.worker._pulls[r].spec.load_block_ids}
        killed = time.monotonic()
        p.kill()
        d.run_until(lambda: all(r in d.finished_recving for r, _ in reqs), timeout, "load errors")
        took = time.monotonic() - killed
        assert took < timeout, took
        assert d.failed_recving == {r for r, _ in reqs}, "exactly the dead instance's requests fail"
        assert d.invalid_blocks == loading, "exactly the blocks they were loading"
        # Recompute policy: every request still completes, computed locally.
        d.run_until(lambda: all(r in d.final for r, _ in reqs + local), 30, "recompute")
        assert d.worker.engine.stats()["consumer"]["draining"] == 0
        assert d.free_blocks() == d.free_at_start

        # Restarted on the same port: a new incarnation that holds none of the dead
        # one's blocks. A request still carrying the dead instance's params becomes a
        # load error within the timeout; the new instance's params work.
        port = int(p.address.rsplit(":", 1)[1])
        again = Prefill({"lease_ttl": 30.0, "timeout": timeout, "port": port})
        assert again.address == p.address and again.incarnation != p.incarnation
        (late, late_prompt), (fresh, fresh_prompt) = prompts(2, seed=9, lo=30, hi=60)
        stale = dict(params[reqs[0][0]], do_remote_prefill=True, kvferry_expires_at=time.time() + 30.0)
        d.failed_recving.clear()
        d.invalid_blocks.clear()
        fresh_params = again.prefill([(fresh, fresh_prompt)])[fresh]
        assert fresh_params["kvferry_incarnation"] == again.incarnation
        d.add(late, late_prompt, max_tokens=1, params=stale)
        d.add(fresh, fresh_prompt, max_tokens=1, params=fresh_params)
        t = d.run_until(lambda: {late, fresh} <= set(d.finished_recving), timeout + 2, "both pulls")
        assert t < timeout + 2
        assert d.failed_recving == {late}
        d.run_until(lambda: {late, fresh} <= set(d.final), 10, "both requests")
        again.wait_freed({fresh}, timeout=5)
    finally:
        if d is not None:
            d.close()
        p.stop()
        if again is not None:
            again.stop()


def test_import_kvferry_without_vllm():
    """``import kvferry`` never needs vLLM, nor do the connector package's pure modules;
    the connector itself says how to get vLLM."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import kvferry, kvferry.integrations\n"
        "import kvferry.integrations.vllm.mapping, kvferry.integrations.vllm.layout\n"
        "try:\n"
        "    from kvferry.integrations.vllm import KvferryConnector\n"
        "except ImportError as e:\n"
        "    assert 'vllm==0.33.0' in str(e), e\n"
        "    print('clear')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "clear"


def test_the_package_keeps_its_public_names_and_former_module_names(need_vllm):
    """``kvferry.integrations.vllm`` became a package: the names vLLM and users import
    from it are the modules' own, and the two former module names that configurations
    and commands use (the plugin, the bench) still work."""
    import subprocess
    import sys

    import kvferry.integrations.vllm as pkg
    import kvferry.integrations.vllm_bounded_output as former_plugin
    from kvferry.integrations.vllm import bounded_output, connector, metadata, worker

    assert pkg.KvferryConnector is connector.KvferryConnector
    assert pkg.RecvSpec is metadata.RecvSpec and pkg.KvferryConnectorWorker is worker.KvferryConnectorWorker
    assert {"KvferryConnector", "KvferryConfig", "KvferryConnectorMetadata", "VLLM_VERSION"} <= set(pkg.__all__)
    with pytest.raises(AttributeError):
        pkg.NoSuchName  # noqa: B018
    assert former_plugin is bounded_output
    out = subprocess.run([sys.executable, "-m", "kvferry.integrations.vllm_bench", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "python -m kvferry.integrations.vllm.bench" in out.stdout


@pytest.mark.parametrize("bench_device", ["host", "sim"])
def test_connector_bench_runs(need_vllm, bench_device):
    """``python -m kvferry.integrations.vllm.bench``: a short run, every block verified
    (``--device sim``: every block through the sim device path)."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "kvferry.integrations.vllm.bench", "--requests", "8", "--rounds", "2", "--json", "--rust-bench", "none", "--device", bench_device],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["corrupted_blocks"] == 0 and r["failed"] == 0
    assert r["bytes"] == 2 * 8 * 4 * r["block_bytes"] and r["block_bytes"] == 640 << 10
    assert r["gbps"] > 0 and r["blocks_per_s"] > 0
    assert r["ratio_to_rust"] is None and "none" in r["rust_note"]
    assert r["device"] == bench_device
