"""``--dp N`` of ``python -m kvferry.integrations.vllm.bench`` (data parallel): N DP
ranks' prefill/decode pairs at once, each in a process of its own (as each DP engine
core is), every round started on every rank at once (a barrier); then N concurrent
``kvferry bench`` runs of the same bytes. Each DP rank's GB/s is compared with the mean
of the concurrent Rust runs (``ratio_to_rust``; the run's ``ratio_to_rust`` is the
lowest DP rank's). The fields are described in :mod:`.bench`'s docs.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ...bench import _rust_binary, run_rust
from .bench import run_connector


def _dp_child(conn: Any, a: argparse.Namespace, rank: int, size: int, barrier: Any) -> None:
    """One DP rank's pair in its own process (as each DP engine core is)."""
    try:
        res = run_connector(a, dp=(rank, size), sync=lambda: barrier.wait(timeout=600))
        conn.send(("ok", res))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        barrier.abort()
        conn.send(("error", f"DP rank {rank}: {type(e).__name__}: {e}"))


def run_dp(a: argparse.Namespace) -> dict[str, Any]:
    """``--dp N``: N DP ranks' pairs at once, each in a process of its own; then N
    concurrent Rust benches of the same bytes (module docs)."""
    import concurrent.futures
    import multiprocessing as mp

    n = int(a.dp)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(n)
    pipes, procs = [], []
    for r in range(n):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_dp_child, args=(child, a, r, n, barrier), daemon=True)
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    ranks: list[dict[str, Any]] = []
    errors_: list[str] = []
    for r, (conn, proc) in enumerate(zip(pipes, procs)):
        if conn.poll(900):
            kind, body = conn.recv()
            if kind == "ok":
                ranks.append(body)
            else:
                errors_.append(str(body))
        else:
            errors_.append(f"DP rank {r}: no result within 900 s")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    if errors_:
        raise RuntimeError("; ".join(errors_))
    out: dict[str, Any] = {
        "dp": n,
        "device": a.device,
        "dp_ranks": ranks,
        "gbps_per_dp": [x["gbps"] for x in ranks],
        "gbps_total": sum(x["gbps"] for x in ranks),
        "corrupted_blocks": sum(x["corrupted_blocks"] for x in ranks),
        "failed": sum(x["failed"] for x in ranks),
    }
    binary, note = _rust_binary(a.rust_bench)
    runs: list[float] = []
    if binary is not None:
        ra = argparse.Namespace(
            bytes=ranks[0]["bytes"], chunk_blocks=4, in_flight=4, connections=4, requests=32, chunks_per_request=4
        )
        try:
            with concurrent.futures.ThreadPoolExecutor(n) as pool:
                got = list(pool.map(lambda _: run_rust(binary, ra), range(n)))
            runs = [float(g["gbps"]) for g in got if isinstance(g.get("gbps"), (int, float))]
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            note = f"rust bench failed: {e}"
    rust = sum(runs) / len(runs) if runs else None
    out["rust_gbps_runs"] = runs
    out["rust_gbps"] = rust
    out["rust_concurrent"] = n
    out["rust_note"] = note
    for x in ranks:
        x["rust_gbps"] = rust
        x["ratio_to_rust"] = x["gbps"] / rust if rust else None
    ratios = [x["ratio_to_rust"] for x in ranks if x["ratio_to_rust"] is not None]
    out["ratio_to_rust_per_dp"] = [x["ratio_to_rust"] for x in ranks]
    out["ratio_to_rust"] = min(ratios) if ratios else None
    return out


def print_dp(res: dict[str, Any], a: argparse.Namespace) -> None:
    """Prints a :func:`run_dp` result: one JSON object with ``--json``, else a line per
    DP rank and a summary."""
    if a.json:
        print(json.dumps(res))
    else:
        for x in res["dp_ranks"]:
            ratio = x["ratio_to_rust"]
            print(
                f"DP rank {x['dp_rank']}: connector ({a.device}) {x['gbps']:.2f} GB/s, round p50 {x['p50_ms']:.1f} ms, "
                f"p99 {x['p99_ms']:.1f} ms; ratio_to_rust {'n/a' if ratio is None else f'{ratio:.2f}'}; "
                f"corrupted blocks {x['corrupted_blocks']}, failed {x['failed']}"
            )
        runs = ", ".join(f"{g:.2f}" for g in res["rust_gbps_runs"])
        print(
            f"all {res['dp']} DP ranks: {res['gbps_total']:.2f} GB/s; rust kvferry bench x{res['dp']} concurrent: "
            + (f"{runs} GB/s (mean {res['rust_gbps']:.2f})" if res["rust_gbps"] else f"n/a ({res['rust_note']})")
        )
