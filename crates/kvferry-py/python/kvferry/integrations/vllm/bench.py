"""``python -m kvferry.integrations.vllm.bench``: KV throughput through the vLLM
connector, against the Rust ``kvferry bench`` in the same run.

Two ``KvferryConnector`` worker halves in this process — made by vLLM 0.33.0's own
``KVConnectorFactory`` from a real ``VllmConfig`` (a generated model ``config.json``,
no weights), over torch CPU paged KV tensors of vLLM's layout (one
``[2, num_blocks, block_size, kv_heads, head_dim]`` tensor per layer) — driven the way
vLLM's model runner drives them: ``bind_connector_metadata``, ``start_load_kv``,
``wait_for_save``, ``get_finished`` every step. Per round, the prefill side publishes
``--requests`` finished requests (``reqs_to_send``); the decode side is handed all their
pulls in one step (``reqs_to_recv``, as the scheduler does when they all arrive) and
steps until every one is reported in ``finished_recving``. Then every landed block is
compared with its source (torch, every byte), and the prefill side steps until every
request is reported ``finished_sending`` (the decode's ``Done`` released them).

Printed (``--json``: one object): ``gbps`` (KV bytes landed / time from the pulls'
metadata to the last ``finished_recving``), ``blocks_per_s``, ``requests_per_s``,
``p50_ms``/``p99_ms`` of per-round times, ``corrupted_blocks``, ``failed``,
``rust_gbps`` (``kvferry bench --path direct`` with 2.5 MiB chunks — one request's
bytes at the defaults — and 4 in flight over 4 connections, run right after) and
``ratio_to_rust``. The defaults (10 layers x 2 x 16 tokens x 8 heads x 128 x fp16)
make a block 640 KiB and a request of 4 blocks 2.5 MiB, the Rust bench's default
block and chunk.

``--prefill-tp P --decode-tp D`` (heterogeneous tensor parallelism): P prefill and D
decode worker halves (each its own engine, ``kv_heads / TP`` heads per rank, HND
layout), the decode's reads planned by ``mapping`` as the scheduler plans them;
then the same requests (the same model, the same KV bytes) between P and P ranks
(``--same-tp T``: T and T ranks).
Each run starts with one untimed warm-up round (connections, first touch of memory).
Printed: ``gbps`` (the hetero run), ``same_tp_gbps`` and ``ratio_to_same_tp`` (also
from per-round medians: ``ratio_to_same_tp_p50``), and
``wire_bytes`` / ``needed_bytes`` (payload the decode ranks received / the bytes they
need). Every decode rank's every head slice is compared with the prefill's.

``--dp N`` (data parallel): N prefill/decode pairs, each pair the engine cores of one
DP rank (its own process, its ``VllmConfig`` set as vLLM's ``run_engine_core`` sets a DP
rank's: ``data_parallel_index``, ``engine_id`` ``…_dp<r>``), running the rounds above
concurrently — every round starts on every DP rank at once (a barrier) —; then N
``kvferry bench`` runs of the same bytes, concurrently too. Printed per DP rank
(``dp_ranks``: each pair's fields above, ``gbps`` and ``ratio_to_rust``, the DP rank's
GB/s over the mean GB/s of the concurrent Rust runs, ``rust_gbps``), the DP ranks'
summed ``gbps_total``, ``rust_gbps_runs`` and ``ratio_to_rust`` (the lowest DP rank's).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any, Literal

from ...bench import _positive, _rust_binary, percentile, run_rust


KvRole = Literal["kv_producer", "kv_consumer"]


def model_dir(tmp: str, layers: int, kv_heads: int, head_dim: int) -> str:
    """A model directory holding only a llama ``config.json`` of this shape."""
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": kv_heads * head_dim,
        "intermediate_size": 2 * kv_heads * head_dim,
        "num_hidden_layers": layers,
        "num_attention_heads": kv_heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": 1024,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    d = Path(tmp) / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def _max_len(a: argparse.Namespace, num_blocks: int) -> int:
    """The model length the instance serves: what its blocks hold, at most 4096 (vLLM
    refuses a KV cache too small for one request of the model's length)."""
    bs = int(a.block_size)
    return max(bs, min(4096, (num_blocks - 1) * bs))


def _kv_caches(cfg: Any, a: argparse.Namespace, q_heads: int, kv_heads: int, num_blocks: int, layers: list[str], place: str) -> tuple[Any, dict[str, Any]]:
    """``(kv_cache_config, {layer: tensor})`` of one rank, as vLLM allocates them for
    ``a.backend``'s real attention layers (:mod:`.alloc`)."""
    from .alloc import allocate, attention_layers, backend_class

    backend = getattr(a, "backend", "FLASH_ATTN")
    made = attention_layers(cfg, backend, q_heads, kv_heads, a.head_dim, layers=layers)
    specs = {n: layer.get_kv_cache_spec(cfg) for n, layer in made.items()}
    kcc, (kv,), _ = allocate([cfg], specs, [backend_class(backend)], num_blocks, place=place)
    return kcc, kv


class ConnectorHalf:
    """One instance's worker-side connector over its own paged KV tensors, allocated
    by vLLM's own code for ``a.backend``'s real attention layers
    (:mod:`.alloc`: ``[num_blocks, kv_heads, block_size, 2 x head_dim]`` per
    layer in the layout vLLM resolves) on ``place`` (``"cpu"``, ``"cuda:0"``...), made
    by vLLM's ``KVConnectorFactory`` from a real ``VllmConfig``. ``extra``: ``kv_connector_extra_config`` (default: the benchmark's,
    per ``a.device``). Also used by ``scripts/gpu_connector_check.py``."""

    def __init__(
        self,
        a: argparse.Namespace,
        model: str,
        role: KvRole,
        num_blocks: int,
        place: str = "cpu",
        extra: dict[str, Any] | None = None,
        dp: tuple[int, int] | None = None,
    ) -> None:
        from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

        self.layers = [f"model.layers.{i}.self_attn.attn" for i in range(a.layers)]
        if extra is None:
            extra = {
                "timeout": 60.0,
                "lease_ttl": 120.0,
                # The rounds hand the decode same-shape pulls without a plan (one get
                # of ``key`` per request): one slot, as a same-shape pair reads.
                "reader_slots": 1,
                # The device path stages every byte on both sides: a round's worth of
                # staging (64 requests x 2.5 MiB by default) on each.
                **({"device": "sim", "arena_bytes": max(64 << 20, 2 * a.requests * a.blocks_per_request * 2 * a.block_size * a.kv_heads * a.head_dim * 2 * a.layers)} if a.device == "sim" else {}),
            }
        cfg = VllmConfig(
            model_config=ModelConfig(model=model, skip_tokenizer_init=True, dtype="float16", max_model_len=_max_len(a, num_blocks), seed=0),
            cache_config=CacheConfig(block_size=a.block_size),
            # ``dp``: (rank, size) of a data-parallel deployment's engine core.
            parallel_config=ParallelConfig(data_parallel_size=dp[1], data_parallel_rank=dp[0]) if dp else ParallelConfig(),
            # The connector follows the KV tensors' device, not this.
            device_config=DeviceConfig("cpu"),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KvferryConnector",
                kv_connector_module_path="kvferry.integrations.vllm",
                kv_role=role,
                kv_connector_extra_config=extra,
                engine_id=f"bench-{role}" if dp else None,
            ),
        )
        if dp:
            _as_dp_engine_core(cfg, dp[0])
        kcc, self.kv = _kv_caches(cfg, a, a.kv_heads, a.kv_heads, num_blocks, self.layers, place)
        self.connector: Any = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kcc)
        self.connector.register_kv_caches(self.kv)
        self.block_bytes = 2 * a.block_size * a.kv_heads * a.head_dim * 2 * a.layers

    @property
    def worker(self) -> Any:
        """The connector's worker half (``KvferryConnectorWorker``)."""
        return self.connector.connector_worker

    def step(self, meta: Any, finished: set[str], forward: Callable[[], None] | None = None) -> tuple[set[str], set[str]]:
        """One engine step as vLLM's model runner makes it (``forward``: the step's
        kernels, enqueued between ``start_load_kv`` and ``wait_for_save``)."""
        c = self.connector
        c.bind_connector_metadata(meta)
        c.start_load_kv(None)
        if forward is not None:
            forward()
        c.wait_for_save()
        sending, recving = c.get_finished(finished)
        c.clear_connector_metadata()
        return set(sending or ()), set(recving or ())

    def blocks(self, ids: list[int]) -> list[Any]:
        """Each layer's bytes of blocks ``ids`` (``[len(ids), ...]`` uint8 views)."""
        import torch

        first = next(iter(self.kv.values()))
        idx = torch.tensor(ids, dtype=torch.long, device=first.device)
        return [t.view(torch.uint8)[idx] for t in self.kv.values()]


def _as_dp_engine_core(cfg: Any, dp_rank: int) -> None:
    """What vLLM 0.33's ``run_engine_core`` does to a dense model's DP rank's config:
    ``data_parallel_index`` is the rank, the engine an independent DP-1 one
    (``reconfigure_for_independent_dp_rank``), ``engine_id`` suffixed ``_dp<rank>``."""
    cfg.parallel_config.data_parallel_index = dp_rank
    cfg.parallel_config.reconfigure_for_independent_dp_rank()
    cfg.kv_transfer_config.engine_id = f"{cfg.kv_transfer_config.engine_id}_dp{dp_rank}"


def run_connector(
    a: argparse.Namespace, dp: tuple[int, int] | None = None, sync: Callable[[], None] | None = None
) -> dict[str, Any]:
    """The rounds through the connector; returns the measured fields. ``dp``: the pair
    is DP rank ``dp[0]`` of ``dp[1]``; ``sync``: called before each round's timed part
    (the DP ranks' barrier)."""
    import torch

    from .metadata import KvferryConnectorMetadata, RecvSpec

    bpr, nreq = a.blocks_per_request, a.requests
    nb = nreq * bpr
    with tempfile.TemporaryDirectory(prefix="kvferry-vllm-bench-") as tmp:
        model = model_dir(tmp, a.layers, a.kv_heads, a.head_dim)
        prefill = ConnectorHalf(a, model, "kv_producer", nb, dp=dp)
        decode = ConnectorHalf(a, model, "kv_consumer", nb, dp=dp)
    gen = torch.Generator().manual_seed(0)
    for t in prefill.kv.values():
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    pw = prefill.connector.connector_worker
    peer = {"address": pw.engine.address, "peer_id": pw.engine.peer_id, "incarnation": pw.engine.incarnation}
    rng = torch.Generator().manual_seed(1)
    round_s: list[float] = []
    corrupted = failed = 0
    moved = 0
    for rnd in range(a.rounds):
        ids = {f"r{rnd}-{i}": list(range(i * bpr, (i + 1) * bpr)) for i in range(nreq)}
        perm = torch.randperm(nb, generator=rng).tolist()  # decode blocks: shuffled
        local = {r: perm[i * bpr : (i + 1) * bpr] for i, r in enumerate(ids)}
        prefill.step(KvferryConnectorMetadata(reqs_to_send=ids), set())
        prefill.step(KvferryConnectorMetadata(), set(ids))  # the scheduler reports them finished
        expires = time.time() + 60.0
        meta = KvferryConnectorMetadata(
            reqs_to_recv={r: RecvSpec(key=r, peers=[peer], remote_block_ids=ids[r], local_block_ids=local[r]) for r in ids},
            expires_at=dict.fromkeys(ids, expires),
        )
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        done: set[str] = set()
        _, got = decode.step(meta, set())
        done |= got
        while len(done) < nreq:
            # The decode instance has nothing to compute while its KV arrives: vLLM's
            # scheduler schedules no tokens, so the step's metadata says idle.
            _, got = decode.step(KvferryConnectorMetadata(idle=True), set())
            done |= got
            if time.perf_counter() - t0 > 120:
                raise RuntimeError(f"round {rnd}: {nreq - len(done)} pulls did not finish in 120 s")
        round_s.append(time.perf_counter() - t0)
        failed += len(decode.connector.get_block_ids_with_load_errors())
        for r in ids:
            for s, d in zip(prefill.blocks(ids[r]), decode.blocks(local[r])):
                if not torch.equal(s, d):
                    corrupted += 1
        moved += nb * prefill.block_bytes
        # The decode's Done released every publication: the prefill frees them all.
        sent: set[str] = set()
        deadline = time.monotonic() + 30
        while len(sent) < nreq and time.monotonic() < deadline:
            s, _ = prefill.step(KvferryConnectorMetadata(), set())
            sent |= s
            time.sleep(0.001)
        if len(sent) < nreq:
            raise RuntimeError(f"round {rnd}: prefill did not see {nreq - len(sent)} releases")
    stats = decode.connector.connector_worker.engine.stats()
    peer_ids = (prefill.worker.engine.peer_id, decode.worker.engine.peer_id)
    prefill.connector.shutdown()
    decode.connector.shutdown()
    total = sum(round_s)
    return {
        **({"dp_rank": dp[0], "peer_ids": list(peer_ids)} if dp else {}),
        "requests": nreq,
        "rounds": a.rounds,
        "blocks_per_request": bpr,
        "block_bytes": prefill.block_bytes,
        "request_bytes": bpr * prefill.block_bytes,
        "bytes": moved,
        "elapsed_s": total,
        "gbps": moved / total / 1e9,
        "blocks_per_s": nb * a.rounds / total,
        "requests_per_s": nreq * a.rounds / total,
        "p50_ms": percentile(round_s, 0.5) * 1e3,
        "p99_ms": percentile(round_s, 0.99) * 1e3,
        "corrupted_blocks": corrupted,
        "failed": failed,
        "checksum_failures": stats["consumer"].get("checksum_failures", 0),
    }


class _Rank(ConnectorHalf):
    """One TP rank of a hetero run: ``heads`` KV heads, in the layout vLLM resolves
    for ``a.backend`` (the connector asks for LBHNC); ``kvv``: each layer's (K, V) as
    the backend reads them, ``[blocks, tokens, heads, head_dim]``."""

    def __init__(self, a: argparse.Namespace, model: str, role: KvRole, num_blocks: int, tp: int, rank: int) -> None:
        from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

        from .alloc import kv_views

        self.layers = [f"model.layers.{i}.self_attn.attn" for i in range(a.layers)]
        self.heads = max(1, a.kv_heads // tp)
        cfg = VllmConfig(
            model_config=ModelConfig(model=model, skip_tokenizer_init=True, dtype="float16", max_model_len=_max_len(a, num_blocks), seed=0),
            cache_config=CacheConfig(block_size=a.block_size),
            parallel_config=ParallelConfig(tensor_parallel_size=tp),
            device_config=DeviceConfig("cpu"),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KvferryConnector",
                kv_connector_module_path="kvferry.integrations.vllm",
                kv_role=role,
                # reader_slots: the connector's default ("auto"), as a user's config has it.
                kv_connector_extra_config={
                    "timeout": 60.0,
                    "lease_ttl": 120.0,
                    **({} if getattr(a, "read_batch", None) is None else {"read_batch": a.read_batch}),
                },
                engine_id=f"bench-{role}-{tp}",
            ),
        )
        cfg.parallel_config.rank = rank
        kcc, self.kv = _kv_caches(cfg, a, max(self.heads, a.kv_heads // tp), self.heads, num_blocks, self.layers, "cpu")
        self.connector = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kcc)
        self.connector.register_kv_caches(self.kv)
        self.kvv = {n: kv_views(a.backend, t, a.head_dim) for n, t in self.kv.items()}
        self.layout = str(self.connector.connector_worker._geo["layout"])
        self.block_bytes = 2 * a.block_size * self.heads * a.head_dim * 2 * a.layers


def _tp_round_trip(a: argparse.Namespace, model: str, ptp: int, dtp: int) -> dict[str, Any]:
    """Rounds of ``--requests`` requests from ``ptp`` prefill ranks to ``dtp`` decode
    ranks, through the connector; every head slice checked."""
    import torch

    from .metadata import KvferryConnectorMetadata, RecvSpec
    from .mapping import KvDescriptor, check, heads_of, plan_request

    bpr, nreq = a.blocks_per_request, a.requests
    nb = nreq * bpr
    # Block 0 is vLLM's null block (never a request's): blocks 1..nb are used.
    prefill = [_Rank(a, model, "kv_producer", nb + 1, ptp, r) for r in range(ptp)]
    decode = [_Rank(a, model, "kv_consumer", nb + 1, dtp, r) for r in range(dtp)]
    slots = prefill[0].worker.reader_slots  # what the prefill publishes (advertised in kvferry_desc)
    gen = torch.Generator().manual_seed(0)
    for side in prefill:
        for t in side.kv.values():
            raw = t.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))

    def desc(tp: int) -> KvDescriptor:
        return KvDescriptor(
            model="bench", dtype="float16", attention="MHA", num_kv_heads=a.kv_heads, head_size=a.head_dim,
            block_size=a.block_size, tp_size=tp, layout=prefill[0].layout, pieces=a.layers, elem_size=2, slots=slots,
        )

    mapping = check(desc(ptp), desc(dtp))
    peers = []
    for side in prefill:
        e = side.connector.connector_worker.engine
        peers.append({"address": e.address, "peer_id": e.peer_id, "incarnation": e.incarnation})
    rng = torch.Generator().manual_seed(1)
    round_s: list[float] = []
    corrupted = failed = 0
    wire0 = 0
    for rnd in range(-1, a.rounds):  # round -1: a warm-up (connections, first touch), not counted
        if rnd == 0:
            round_s.clear()
            wire0 = sum(d.connector.connector_worker.engine.stats()["consumer"]["bytes_received"] for d in decode)
        ids = {f"r{rnd + 1}-{i}": list(range(1 + i * bpr, 1 + (i + 1) * bpr)) for i in range(nreq)}
        perm = (torch.randperm(nb, generator=rng) + 1).tolist()
        local = {r: perm[i * bpr : (i + 1) * bpr] for i, r in enumerate(ids)}
        for side in prefill:
            side.step(KvferryConnectorMetadata(reqs_to_send=ids), set())
            side.step(KvferryConnectorMetadata(), set(ids))
        expires = time.time() + 60.0
        specs = {}
        for r in ids:
            held: list[int | None] = list(ids[r])
            into: list[int | None] = list(local[r])
            plans = plan_request(mapping, r, bpr * a.block_size, [held], [into])
            specs[r] = RecvSpec(
                key=r, peers=peers, remote_block_ids=ids[r], local_block_ids=local[r], plans=plans,
                npub=bpr, src_piece_bytes=mapping.prefill.piece_bytes,
            )
        meta = KvferryConnectorMetadata(reqs_to_recv=specs, expires_at=dict.fromkeys(ids, expires))
        t0 = time.perf_counter()
        done: list[set[str]] = [set() for _ in decode]
        for i, side in enumerate(decode):
            done[i] |= side.step(meta, set())[1]
        while any(len(x) < nreq for x in done):
            for i, side in enumerate(decode):
                if len(done[i]) < nreq:
                    done[i] |= side.step(KvferryConnectorMetadata(idle=True), set())[1]
            if time.perf_counter() - t0 > 120:
                raise RuntimeError(f"round {rnd}: pulls did not finish in 120 s")
        round_s.append(time.perf_counter() - t0)
        for side in decode:
            failed += len(side.connector.get_block_ids_with_load_errors())
        for r in ids:  # every decode rank's every head slice against its prefill rank's
            src = torch.tensor(ids[r], dtype=torch.long)
            dst = torch.tensor(local[r], dtype=torch.long)
            for di, dside in enumerate(decode):
                da, db = heads_of(di, dtp, a.kv_heads)
                for h in range(da, db):
                    q = h // max(1, a.kv_heads // ptp) if ptp <= a.kv_heads else h * (ptp // a.kv_heads)
                    qa, _ = heads_of(q, ptp, a.kv_heads)
                    for n in dside.layers:
                        for kvi in (0, 1):  # K and V of head h, as the backend reads them
                            s_ = prefill[q].kvv[n][kvi][src, :, h - qa].contiguous().view(torch.uint8)  # bytes: random fp16 holds NaNs
                            d_ = dside.kvv[n][kvi][dst, :, h - da].contiguous().view(torch.uint8)
                            if not torch.equal(s_, d_):
                                corrupted += 1
        sent: list[set[str]] = [set() for _ in prefill]
        deadline = time.monotonic() + 30
        while any(len(x) < nreq for x in sent) and time.monotonic() < deadline:
            for i, side in enumerate(prefill):
                sent[i] |= side.step(KvferryConnectorMetadata(), set())[0]
            time.sleep(0.001)
        if any(len(x) < nreq for x in sent):
            raise RuntimeError(f"round {rnd}: prefill did not see every release")
    wire = sum(d.connector.connector_worker.engine.stats()["consumer"]["bytes_received"] for d in decode) - wire0
    for side in prefill + decode:
        side.connector.shutdown()
    total = sum(round_s)
    moved = nb * a.rounds * prefill[0].block_bytes * ptp  # every head of every block: the same bytes for any TP
    return {
        "prefill_tp": ptp,
        "decode_tp": dtp,
        "bytes": moved,
        "elapsed_s": total,
        "gbps": moved / total / 1e9,
        "p50_ms": percentile(round_s, 0.5) * 1e3,
        "p99_ms": percentile(round_s, 0.99) * 1e3,
        "wire_bytes": wire,
        "needed_bytes": nb * a.rounds * decode[0].block_bytes * dtp,
        "corrupted_blocks": corrupted,
        "failed": failed,
    }


def run_hetero(a: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvferry-vllm-bench-") as tmp:
        model = model_dir(tmp, a.layers, a.kv_heads, a.head_dim)
        het = _tp_round_trip(a, model, a.prefill_tp, a.decode_tp)
        st = a.same_tp or a.prefill_tp
        same = _tp_round_trip(a, model, st, st)
    het["same_tp"] = a.same_tp or a.prefill_tp
    het["same_tp_gbps"] = same["gbps"]
    het["same_tp_wire_bytes"] = same["wire_bytes"]
    het["ratio_to_same_tp"] = het["gbps"] / same["gbps"] if same["gbps"] > 0 else None
    # Per-round medians: one round stalled by a busy machine weighs less.
    het["same_tp_p50_ms"] = same["p50_ms"]
    het["ratio_to_same_tp_p50"] = same["p50_ms"] / het["p50_ms"] if het["p50_ms"] > 0 else None
    het["corrupted_blocks"] += same["corrupted_blocks"]
    het["failed"] += same["failed"]
    return het


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvferry.integrations.vllm.bench",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--requests", type=_positive, default=64, help="requests per round (default 64)")
    p.add_argument("--blocks-per-request", type=_positive, default=4, help="blocks per request (default 4)")
    p.add_argument("--rounds", type=_positive, default=5, help="rounds (default 5)")
    p.add_argument("--layers", type=_positive, default=10)
    p.add_argument("--kv-heads", type=_positive, default=8)
    p.add_argument("--head-dim", type=_positive, default=128)
    p.add_argument("--block-size", type=_positive, default=16, help="tokens per block (default 16)")
    p.add_argument(
        "--backend",
        default="FLASH_ATTN",
        choices=["FLASH_ATTN", "TRITON_ATTN", "CPU_ATTN"],
        help="the attention backend whose KV cache layout vLLM allocates (default FLASH_ATTN; CPU_ATTN takes block sizes that are multiples of 32)",
    )
    p.add_argument("--rust-bench", default=None, metavar="PATH|none", help="the Rust kvferry binary (default: as python -m kvferry bench)")
    p.add_argument(
        "--device",
        choices=["host", "sim"],
        default="host",
        help="host: the CPU tensors move zero copy (default); sim: both sides adopt them as kvferry's sim device "
        "memory, so every block goes through the device path (gather into staging, socket, scatter)",
    )
    p.add_argument("--prefill-tp", type=_positive, default=None, help="heterogeneous TP: prefill ranks (with --decode-tp)")
    p.add_argument("--decode-tp", type=_positive, default=None, help="heterogeneous TP: decode ranks (with --prefill-tp)")
    p.add_argument("--same-tp", type=_positive, default=None, help="heterogeneous TP: the TP of the same-TP run compared with (default: --prefill-tp)")
    p.add_argument(
        "--read-batch",
        type=_positive,
        default=None,
        help="heterogeneous TP: the decode's read_batch (default: the connector's, 8); 1: one get per request",
    )
    p.add_argument(
        "--dp",
        type=_positive,
        default=None,
        help="data parallel: this many DP ranks' prefill/decode pairs at once, each in a process of its own, "
        "against as many concurrent Rust benches; per-DP-rank GB/s and ratio_to_rust",
    )
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.dp is not None:
        if a.prefill_tp is not None or a.decode_tp is not None:
            p.error("--dp runs same-shape pairs: not with --prefill-tp/--decode-tp")
        from .bench_dp import print_dp, run_dp

        res = run_dp(a)
        print_dp(res, a)
        return 1 if res["corrupted_blocks"] or res["failed"] else 0
    if a.prefill_tp is not None or a.decode_tp is not None:
        a.prefill_tp, a.decode_tp = a.prefill_tp or 1, a.decode_tp or 1
        res = run_hetero(a)
        if a.json:
            print(json.dumps(res))
        else:
            print(
                f"TP {a.prefill_tp}->{a.decode_tp}: {res['gbps']:.2f} GB/s; same TP {res['same_tp']}->{res['same_tp']}: "
                f"{res['same_tp_gbps']:.2f} GB/s; ratio_to_same_tp {res['ratio_to_same_tp']:.2f} "
                f"(per-round medians {res['p50_ms']:.0f} vs {res['same_tp_p50_ms']:.0f} ms: {res['ratio_to_same_tp_p50']:.2f}); "
                f"wire {res['wire_bytes']} B for {res['needed_bytes']} B needed; corrupted {res['corrupted_blocks']}, failed {res['failed']}"
            )
        return 1 if res["corrupted_blocks"] or res["failed"] else 0
    res = run_connector(a)
    res["device"] = a.device
    binary, note = _rust_binary(a.rust_bench)
    res["rust_gbps"] = None
    if binary is not None:
        ra = argparse.Namespace(
            bytes=res["bytes"], chunk_blocks=4, in_flight=4, connections=4, requests=32, chunks_per_request=4
        )
        try:
            rust = run_rust(binary, ra)
            res["rust_gbps"] = rust.get("gbps")
            res["rust_tcp_limit_gbps"] = rust.get("tcp_limit_gbps")
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            note = f"rust bench failed: {e}"
    res["rust_note"] = note
    r = res["rust_gbps"]
    res["ratio_to_rust"] = res["gbps"] / r if isinstance(r, (int, float)) and r > 0 else None
    if a.json:
        print(json.dumps(res))
    else:
        print(
            f"connector ({a.device}): {res['gbps']:.2f} GB/s, {res['blocks_per_s']:.0f} blocks/s, {res['requests_per_s']:.0f} requests/s "
            f"({res['rounds']} rounds of {res['requests']} requests x {res['request_bytes'] / 2**20:.1f} MiB; "
            f"round p50 {res['p50_ms']:.1f} ms, p99 {res['p99_ms']:.1f} ms); corrupted blocks {res['corrupted_blocks']}, "
            f"failed {res['failed']}"
        )
        print(f"rust kvferry bench: {r:.2f} GB/s" if r else f"rust kvferry bench: n/a ({note})")
        if res["ratio_to_rust"] is not None:
            print(f"ratio_to_rust {res['ratio_to_rust']:.2f}")
    return 1 if res["corrupted_blocks"] or res["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
