#!/usr/bin/env python3
"""The vLLM connector's two worker halves over torch KV tensors on one device, bytes
verified: the part of ``scripts/gpu-check.sh`` that checks ``KvferryConnector`` where
vLLM keeps its KV on a GPU.

Two ``KvferryConnector`` worker halves in this process, made by vLLM's own (0.34.0 or 0.33.0)
``KVConnectorFactory`` (a real ``VllmConfig``, a generated model ``config.json``, no
weights), each over its own per-layer paged KV tensors of vLLM's layout
(``[2, num_blocks, block_size, kv_heads, head_dim]``), driven the way vLLM's model
runner drives them (``bind_connector_metadata``, ``start_load_kv``, ``wait_for_save``,
``get_finished``):

- ``--device cuda`` (the check): both halves' tensors on ``cuda:0``, so each half runs a
  ``cuda:0`` kvferry engine (two engines on one GPU). The prefill's "forward" fills its
  blocks with random bytes on the GPU, the same step publishes them (the connector
  waits for the event recorded in ``wait_for_save`` before it publishes), the decode
  pulls them into shuffled blocks (device-to-host gather into pinned staging on the
  prefill, the socket, host-to-device scatter on the decode), and every landed block is
  compared with its source on the GPU. Without torch, vLLM, or a CUDA device it prints
  ``skipped: <why>`` and exits 0.
- ``--device sim`` / ``--device host``: the same over CPU tensors (the sim device's
  path, or host memory zero copy), so the script itself is tested without a GPU
  (``crates/kvferry-py/tests/vllm/test_gpu_check.py``).

Prints one JSON object (``ok``, ``bytes``, ``gbps``, ``corrupted_blocks``, ``failed``,
the engines' device counters); exits 1 if any block differs, a pull failed, or the
prefill did not see every release.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from typing import Any


def _skip(why: str) -> int:
    print(f"skipped: {why}")
    print(json.dumps({"ok": None, "skipped": why}))
    return 0


def _half(a: argparse.Namespace, model: str, role: str, num_blocks: int, place: str) -> Any:
    """One instance's worker-side connector: the benchmark's ``ConnectorHalf``
    (``kvferry.integrations.vllm.bench``) with this check's settings."""
    from kvferry.integrations.vllm.bench import ConnectorHalf

    page = 2 * a.block_size * a.kv_heads * a.head_dim * 2
    # reader_slots 1: the pulls are same-shape specs without a plan (one get per request).
    extra: dict[str, Any] = {"timeout": a.timeout, "lease_ttl": 4 * a.timeout, "reader_slots": 1}
    if a.device in ("sim", "cuda"):  # every byte is staged on both sides
        extra["arena_bytes"] = max(64 << 20, 2 * num_blocks * page * a.layers)
    if a.device == "sim":
        extra["device"] = "sim"
    return ConnectorHalf(a, model, role, num_blocks, place=place, extra=extra)


def run(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    from kvferry.integrations.vllm import KvferryConnectorMetadata, RecvSpec

    place = "cuda:0" if a.device == "cuda" else "cpu"
    bpr, nreq = a.blocks_per_request, a.requests
    nb = nreq * bpr
    from kvferry.integrations.vllm.bench import model_dir

    with tempfile.TemporaryDirectory(prefix="kvferry-gpu-connector-") as tmp:
        model = model_dir(tmp, a.layers, a.kv_heads, a.head_dim)
        prefill = _half(a, model, "kv_producer", nb, place)
        decode = _half(a, model, "kv_consumer", nb, place)
    engines = {"prefill": prefill.worker.device or "host", "decode": decode.worker.device or "host"}
    pw = prefill.worker
    peer = {"address": pw.engine.address, "peer_id": pw.engine.peer_id, "incarnation": pw.engine.incarnation}
    gen = torch.Generator(device=place).manual_seed(0)
    rng = torch.Generator().manual_seed(1)
    corrupted = failed = unreleased = 0
    moved = 0
    elapsed = 0.0
    for rnd in range(a.rounds):
        ids = {f"r{rnd}-{i}": list(range(i * bpr, (i + 1) * bpr)) for i in range(nreq)}
        perm = torch.randperm(nb, generator=rng).tolist()
        local = {r: perm[i * bpr : (i + 1) * bpr] for i, r in enumerate(ids)}

        def forward() -> None:  # the prefill's step writes its blocks (on the GPU: async kernels)
            for t in prefill.kv.values():
                raw = t.view(torch.uint8)
                raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen, device=place))

        # One step computes the blocks; the next one's metadata publishes them (the
        # scheduler saw the requests finish), with the kernels possibly still running
        # on the GPU: the publication waits for the event recorded in wait_for_save.
        prefill.step(KvferryConnectorMetadata(), set(), forward=forward)
        prefill.step(KvferryConnectorMetadata(reqs_to_send=ids), set())
        prefill.step(KvferryConnectorMetadata(), set(ids))
        expires = time.time() + 4 * a.timeout
        meta = KvferryConnectorMetadata(
            reqs_to_recv={r: RecvSpec(key=r, peers=[peer], remote_block_ids=ids[r], local_block_ids=local[r]) for r in ids},
            expires_at=dict.fromkeys(ids, expires),
        )
        t0 = time.perf_counter()
        done: set[str] = set()
        sent: set[str] = set()
        while len(done) < nreq:
            # Publishing may wait a step for the GPU: keep stepping the prefill too.
            sent |= prefill.step(KvferryConnectorMetadata(), set())[0]
            _, got = decode.step(meta, set())
            meta = KvferryConnectorMetadata(idle=True)
            done |= got
            if time.perf_counter() - t0 > 2 * a.timeout + 10:
                raise RuntimeError(f"round {rnd}: {nreq - len(done)} pulls did not finish")
        elapsed += time.perf_counter() - t0
        failed += len(decode.connector.get_block_ids_with_load_errors())
        for r in ids:
            for s, d in zip(prefill.blocks(ids[r]), decode.blocks(local[r])):
                if not torch.equal(s, d):
                    corrupted += 1
        moved += nb * prefill.block_bytes
        deadline = time.monotonic() + a.timeout
        while len(sent) < nreq and time.monotonic() < deadline:
            s, _ = prefill.step(KvferryConnectorMetadata(), set())
            sent |= s
            time.sleep(0.001)
        unreleased += nreq - len(sent)
    dev = {"prefill": pw.engine.stats().get("device", {}), "decode": decode.worker.engine.stats().get("device", {})}
    prefill.connector.shutdown()
    decode.connector.shutdown()
    ok = corrupted == 0 and failed == 0 and unreleased == 0
    return {
        "ok": ok,
        "device": a.device,
        "engines": engines,
        "requests": nreq * a.rounds,
        "block_bytes": prefill.block_bytes,
        "bytes": moved,
        "gbps": moved / elapsed / 1e9 if elapsed else 0.0,
        "corrupted_blocks": corrupted,
        "failed": failed,
        "unreleased": unreleased,
        "device_stats": dev,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "sim", "host"], default="cuda")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--blocks-per-request", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--timeout", type=float, default=30.0)
    a = p.parse_args(argv)
    try:
        import torch
    except ImportError as e:
        return _skip(f"torch is not installed ({e})")
    try:
        import vllm
    except ImportError as e:
        return _skip(f"vLLM is not installed ({e}); scripts/install-vllm.sh makes a venv with vllm 0.33.0 (--version 0.34.0: 0.34.0)")
    if getattr(vllm, "__version__", None) not in ("0.34.0", "0.33.0"):
        return _skip(f"this check runs on vllm 0.34.0 or 0.33.0 (kvferry/integrations/vllm/versions.py), found {getattr(vllm, '__version__', None)}")
    if a.device == "cuda":
        if not torch.cuda.is_available():
            return _skip(f"torch {torch.__version__} sees no CUDA device")
        import kvferry

        try:
            kvferry.Engine(listen=None, device="cuda:0", arena_bytes=4 << 20).close(timeout=5.0)
        except Exception as e:  # noqa: BLE001 - a build without the cuda feature, no driver...
            return _skip(f"kvferry cannot open cuda:0 ({type(e).__name__}: {e}); build it with --features cuda")
    res = run(a)
    print(json.dumps(res))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
