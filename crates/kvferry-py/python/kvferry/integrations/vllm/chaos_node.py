"""One vLLM instance for the chaos soak (:mod:`.chaos`): vLLM 0.33's or 0.34's real
``Scheduler`` with ``KvferryConnector`` in both roles, minus the model.

A :class:`Node` is a scheduler plus one worker-side connector per tensor-parallel
rank, each made by vLLM's ``KVConnectorFactory`` over KV tensors allocated by vLLM's
own allocation path (:mod:`.alloc`: real ``Attention`` layers, the resolved layout,
``get_kv_cache_configs``, ``allocate_kv_cache``), driven as vLLM's model runner
drives its connector (:class:`.runner.ConnectorDriver` around a "forward"), the ranks'
outputs combined by vLLM's ``KVOutputAggregator``. The "forward" writes into every
scheduled token's slots a pattern that depends only on (token, position, layer, K/V,
global KV head), written and read through the backend's own K/V views: a decode checks
every landed token's every head against it, so a read from the wrong rank, head,
token or block cannot pass.

:class:`RemoteNode` runs a prefill :class:`Node` in a spawned process (its own engine
loop, answering commands between steps), which the soak SIGKILLs and restarts.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any, Literal

from .runner import ConnectorDriver, model_runner_output

__all__ = ["Node", "RemoteNode", "LAYERS"]

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
BACKEND = "FLASH_ATTN"


def pattern(tokens: Any, positions: Any, layer: int, kv: int, heads: Any, hs: int) -> Any:
    """int16 ``[n, len(heads), hs]``: each slot's expected bits."""
    import torch

    base = (tokens.to(torch.int32) * 1009 + positions.to(torch.int32) * 31 + layer * 7 + kv * 3) % 30011
    v = base[:, None, None] + heads.to(torch.int32)[None, :, None] * 101 + torch.arange(hs, dtype=torch.int32)[None, None, :]
    return (v % 32749).to(torch.int16)


class Node:
    """A scheduler and its TP ranks' connectors (module docs). ``extra``:
    ``kv_connector_extra_config``."""

    def __init__(self, role: Literal["kv_producer", "kv_consumer"], model: str, *, tp: int, kv_heads: int, head_size: int, block_size: int, num_blocks: int, extra: dict[str, Any], tag: str) -> None:
        from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        from .alloc import allocate, attention_layers, backend_class, kv_views

        self.tp, self.bs, self.hs = tp, block_size, head_size
        self.hpr = max(1, kv_heads // tp)
        engine_id = f"chaos-{role}-{tag}-{os.getpid()}-{id(self)}"

        def config(rank: int) -> Any:
            cfg = VllmConfig(
                model_config=ModelConfig(model=model, skip_tokenizer_init=True, dtype="float16", max_model_len=1024, seed=0),
                cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
                scheduler_config=SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=8192, max_model_len=1024, is_encoder_decoder=False),
                parallel_config=ParallelConfig(tensor_parallel_size=tp),
                device_config=DeviceConfig("cpu"),
                kv_transfer_config=KVTransferConfig(
                    kv_connector="KvferryConnector",
                    kv_connector_module_path="kvferry.integrations.vllm",
                    kv_role=role,
                    kv_connector_extra_config=extra,
                    kv_load_failure_policy="recompute",
                    engine_id=engine_id,
                ),
            )
            cfg.parallel_config.rank = rank
            return cfg

        configs = [config(r) for r in range(tp)]
        self.vllm_config = configs[0]
        q_heads = int(configs[0].model_config.get_num_attention_heads(configs[0].parallel_config))
        layers: dict[str, Any] = {}
        for cfg in configs:
            layers = attention_layers(cfg, BACKEND, q_heads, self.hpr, head_size, None, LAYERS)
        specs = {n: layer.get_kv_cache_spec(configs[0]) for n, layer in layers.items()}
        self.kv_cache_config, caches, _ = allocate(configs, specs, [backend_class(BACKEND)], num_blocks)
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=block_size,
            log_stats=False,
        )
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(block_size, sha256)
        self.ranks: list[Any] = []
        self.drivers: list[ConnectorDriver] = []  # each rank's connector driven as vLLM's model runner drives it
        self.kvv: list[dict[str, tuple[Any, ...]]] = []
        for r in range(tp):
            c = KVConnectorFactory.create_connector(configs[r], KVConnectorRole.WORKER, self.kv_cache_config)
            c.register_kv_caches(caches[r])
            self.ranks.append(c)
            self.drivers.append(ConnectorDriver(c, self.vllm_config, caches[r]))
            self.kvv.append({n: kv_views(BACKEND, t, head_size) for n, t in caches[r].items()})
        hs = {(0, r): c.get_handshake_metadata() for r, c in enumerate(self.ranks)}
        sched_conn = self.scheduler.get_kv_connector()
        assert sched_conn is not None
        sched_conn.set_xfer_handshake_metadata_pp_aware(hs)
        self.aggregator = KVOutputAggregator(expected_finished_count=tp)
        self.free_at_start = self.free_blocks()
        self.final: dict[str, Any] = {}
        self.finished_recving: dict[str, float] = {}
        self.failed_recving: set[str] = set()
        self.checked: dict[str, int] = {}  # request -> corrupted token positions when it landed

    def free_blocks(self) -> int:
        return int(self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    def workers(self) -> list[Any]:
        return [c.connector_worker for c in self.ranks]

    def add(self, req_id: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args={"kv_transfer_params": params} if params else None)
        self.scheduler.add_request(Request(req_id, list(prompt), sp, None, block_hasher=self.hasher))

    def abort(self, req_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    def _slots(self, rank: int, blocks: list[int], start: int, end: int) -> tuple[Any, Any]:
        import torch

        pos = torch.arange(start, end)
        ids = torch.tensor(blocks, dtype=torch.long)[pos // self.bs]
        return ids, pos % self.bs

    def _forward(self, so: Any) -> None:
        import torch

        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            end = int(req.num_computed_tokens)
            (blocks,) = self.scheduler.kv_cache_manager.get_block_ids(rid)
            toks = torch.tensor(req.all_token_ids[end - n : end], dtype=torch.int32)
            positions = torch.arange(end - n, end)
            for rank in range(self.tp):
                ids, off = self._slots(rank, blocks, end - n, end)
                heads = torch.arange(rank * self.hpr, (rank + 1) * self.hpr)
                for li, name in enumerate(LAYERS):
                    for kvi, view in enumerate(self.kvv[rank][name]):
                        view.view(torch.int16)[ids, off] = pattern(toks, positions, li, kvi, heads, self.hs)

    def _check(self, rid: str) -> int:
        """Token positions of ``rid``'s prompt whose bytes differ, on any rank, head,
        layer, K or V, from what the prefill wrote."""
        import torch

        req = self.scheduler.requests[rid]
        n = int(req.num_prompt_tokens)
        (blocks,) = self.scheduler.kv_cache_manager.get_block_ids(rid)
        toks = torch.tensor(req.all_token_ids[:n], dtype=torch.int32)
        positions = torch.arange(n)
        bad = torch.zeros(n, dtype=torch.bool)
        for rank in range(self.tp):
            ids, off = self._slots(rank, blocks, 0, n)
            heads = torch.arange(rank * self.hpr, (rank + 1) * self.hpr)
            for li, name in enumerate(LAYERS):
                for kvi, view in enumerate(self.kvv[rank][name]):
                    got = view.view(torch.int16)[ids, off]
                    bad |= (got != pattern(toks, positions, li, kvi, heads, self.hs)).flatten(1).any(dim=1)
        return int(bad.sum())

    def step(self) -> None:
        so = self.scheduler.schedule()
        req_ids = list(so.num_scheduled_tokens)
        self._forward(so)
        outs: list[Any] = []
        for driver in self.drivers:
            sampled = []
            with driver.step(so) as kvo:
                for rid in req_ids:
                    req = self.scheduler.requests[rid]
                    sampled.append([3 + (req.num_computed_tokens * 17) % 1000] if req.num_computed_tokens >= req.num_tokens else [])
            outs.append(model_runner_output(req_ids, sampled, kvo))
        mro = self.aggregator.aggregate(outs)
        assert mro is not None and mro.kv_connector_output is not None
        kvo = mro.kv_connector_output
        now = time.monotonic()
        failed = kvo.failed_recving or set()
        self.failed_recving |= failed
        for outs_ in self.scheduler.update_from_output(so, mro).values():
            for o in outs_.outputs:
                if o.finish_reason is not None:
                    self.final[o.request_id] = o
        for rid in kvo.finished_recving or ():
            self.finished_recving[rid] = now
            held = self.scheduler.requests.get(rid)
            if held is not None and not held.is_finished() and rid not in failed:
                self.checked[rid] = self._check(rid)  # before the next forward

    def published_now(self) -> int:
        return sum(int(w.engine.stats()["producer"]["published_now"]) for w in self.workers())

    def close(self) -> None:
        for c in self.ranks:
            c.shutdown()


def _serve(conn: Any, kw: dict[str, Any]) -> None:
    """A prefill node's engine loop in its own process (commands between steps)."""
    node = Node("kv_producer", **kw)
    conn.send(("ready", node.free_at_start))
    reported: set[str] = set()
    while True:
        busy = node.scheduler.has_requests() or node.published_now() > 0
        while conn.poll(0 if busy else 0.005):
            msg = conn.recv()
            if msg[0] == "add":
                for rid, prompt in msg[1]:
                    node.add(rid, prompt, 1, {"do_remote_decode": True})
            elif msg[0] == "abort":
                gone: dict[str, None] = {}
                for rid in msg[1]:
                    if rid in node.scheduler.requests and rid not in node.final:
                        node.abort(rid)
                        gone[rid] = None
                reported |= set(gone)
                conn.send(("finished", gone))
            elif msg[0] == "delay":
                for w in node.workers():
                    w.engine._e._inject_faults(send_delay_us=msg[1], corrupt_next_sends=None)
            elif msg[0] == "state":
                conn.send(("state", {
                    "free": node.free_blocks(),
                    "free_at_start": node.free_at_start,
                    "requests": len(node.scheduler.requests),
                    "published_now": node.published_now(),
                }))
            elif msg[0] == "stop":
                node.close()
                conn.send(("stopped",))
                return
        if node.scheduler.has_requests() or node.published_now() > 0:
            node.step()
            new = {r: o.kv_transfer_params for r, o in node.final.items() if r not in reported}
            if new:
                reported |= set(new)
                conn.send(("finished", new))
            if not node.scheduler.has_requests():
                time.sleep(0.002)


class RemoteNode:
    """A prefill :class:`Node` in a spawned process."""

    def __init__(self, **kw: Any) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, kw), daemon=True)
        self.proc.start()
        deadline = time.monotonic() + 300
        while not self.conn.poll(0.2):
            if not self.proc.is_alive() or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"prefill process did not start (exit code {self.proc.exitcode})")
        self.free_at_start = int(self.conn.recv()[1])
        self.finished: dict[str, dict[str, Any]] = {}

    def _recv(self, deadline: float) -> tuple[Any, ...]:
        while not self.conn.poll(0.05):
            if not self.proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"prefill process not answering (alive: {self.proc.is_alive()})")
        r = tuple(self.conn.recv())
        if r[0] == "finished":
            self.finished.update(r[1])
        return r

    def call(self, *msg: Any, timeout: float = 60.0) -> tuple[Any, ...]:
        self.conn.send(msg)
        deadline = time.monotonic() + timeout
        while True:
            r = self._recv(deadline)
            if r[0] != "finished":
                return r

    def send(self, *msg: Any) -> None:
        self.conn.send(msg)

    def prefill(self, reqs: list[tuple[str, list[int]]], timeout: float = 120.0, abort: set[str] | None = None) -> dict[str, Any]:
        """Runs ``reqs``' prefill; returns their kv_transfer_params (None: aborted on
        the prefill, ``abort`` asked right after they were added)."""
        self.send("add", reqs)
        if abort:
            self.send("abort", sorted(abort))
        deadline = time.monotonic() + timeout
        want = {r for r, _ in reqs}
        while not want <= set(self.finished):
            self._recv(deadline)
        return {r: self.finished.pop(r) for r in want}

    def state(self) -> dict[str, Any]:
        return dict(self.call("state")[1])

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop", timeout=30)
            except (RuntimeError, OSError, EOFError):
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.kill()
