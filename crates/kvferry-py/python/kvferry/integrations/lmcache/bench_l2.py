# mypy: disable-error-code="import-untyped"
# (lmcache ships no type information: its classes are Any here.)
"""Retrieve (L2 load) throughput of the kvferry L2 adapter against LMCache's ``fs``
adapter, through LMCache's own L2 adapter bench runner.

``python -m kvferry.integrations.lmcache.bench_l2 [--num-keys 32] [--data-size-kb 1024]
[--runs 5] [--rounds 3] [--fs-dir DIR] [--serve-model llama3-8b|tiny] [--param KEY=VALUE ...]
[--json]``

Both adapters are built by LMCache's ``--l2-adapter`` parsing and factory over one
aligned L1 buffer (LMCache's bench helpers), hold the same bytes under the same keys
(stored once, up front), and load them into the same L1 objects. A *run* is one
``bench_load`` of ``--rounds`` rounds (each round loads every key, waited for on the
adapter's load event fd); runs alternate between the adapters (kvferry, fs, kvferry, …)
so both see the same minutes of the host, and each adapter's figure is the median of
its ``--runs`` runs (bytes loaded / time). Every run's bytes are compared with what was
stored; a short load fails the bench.

The kvferry side is a ``kvferry serve`` started here on loopback (``$KVFERRY_BIN``, else
``target/release/kvferry`` of this checkout, else ``kvferry`` on ``PATH``); with the
default transport it is on this host, so the adapter reads it with
``process_vm_readv``. The fs side writes to ``--fs-dir`` (default: a temporary
directory), so its reads come from the page cache: the comparison is between two
memory-speed paths, not against a disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

SECRET = "kvferry-bench-l2-secret-0123456789abcdef"


def _kvferry_bin() -> str:
    env = os.environ.get("KVFERRY_BIN")
    if env:
        return env
    built = Path(__file__).resolve().parents[6] / "target" / "release" / "kvferry"
    if built.exists():
        return str(built)
    found = shutil.which("kvferry")
    if found is None:
        raise SystemExit("bench_l2: no kvferry binary (set KVFERRY_BIN or build target/release/kvferry)")
    return found


_BLOCK_BYTES = {"tiny": 2 << 10, "llama3-8b": 2 << 20}
"""Bytes of one block of the ``kvferry serve`` model presets used here (its store's unit)."""


def _serve(total_bytes: int, chunks: int, model: str) -> tuple[subprocess.Popen[str], str]:
    env = dict(os.environ, KVFERRY_SECRET=SECRET)
    # a chunk takes whole blocks: room for twice the chunks, rounded up, so nothing is evicted
    blocks = 16 + 2 * (chunks + total_bytes // _BLOCK_BYTES[model])
    cmd = [_kvferry_bin(), "serve", "--listen", "127.0.0.1:0", "--model", model, "--blocks", str(blocks), "--arena", "64MiB", "--page-size", "1MiB"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "listening on" in line:
            return proc, line.split("listening on ")[1].split()[0]
    proc.wait()
    raise SystemExit("bench_l2: kvferry serve did not start")


def _param(kv: str) -> tuple[str, Any]:
    k, _, v = kv.partition("=")
    try:
        return k, json.loads(v)
    except ValueError:
        return k, v


def _adapter(spec: dict[str, Any], l1_desc: Any) -> Any:
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(spec)])).adapters[0]
    return create_l2_adapter(cfg, l1_memory_desc=l1_desc)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the bench; prints a table (or JSON) and returns the figures."""
    import torch
    from lmcache.cli.commands.bench.l2_adapter_bench.data import (
        create_l1_memory_desc,
        make_aligned_tensor,
        make_memory_objects,
        make_object_keys,
    )
    from lmcache.cli.commands.bench.l2_adapter_bench.runner import bench_load, bench_store

    p = argparse.ArgumentParser(prog="python -m kvferry.integrations.lmcache.bench_l2", description=__doc__.split("\n\n")[0])
    p.add_argument("--num-keys", type=int, default=32)
    p.add_argument("--data-size-kb", type=int, default=1024)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--fs-dir", default=None)
    p.add_argument("--serve-model", choices=sorted(_BLOCK_BYTES), default="llama3-8b", help="the kvferry serve's model preset: its block size is its store's unit")
    p.add_argument("--json", action="store_true")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="an extra adapter_params entry of the kvferry adapter (e.g. transport=tcp, parallel=8)")
    a = p.parse_args(argv)
    size = a.data_size_kb << 10
    n = a.num_keys
    total = n * size

    buf = make_aligned_tensor(2 * total, align_bytes=4096)
    l1 = create_l1_memory_desc(buf, align_bytes=4096)
    keys = list(make_object_keys(n, model_name="kvferry-bench-l2"))
    src = list(make_memory_objects(buf, n, size, 0))
    g = torch.Generator().manual_seed(0)
    for o in src:
        o.raw_data.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g))
    dst = list(make_memory_objects(buf, n, size, total))

    fs_dir = a.fs_dir or tempfile.mkdtemp(prefix="kvferry-bench-l2-fs-")
    proc, address = _serve(total, n, a.serve_model)
    adapters: dict[str, Any] = {}
    try:
        adapters["kvferry"] = _adapter(
            {
                "type": "plugin",
                "module_path": "kvferry.integrations.lmcache",
                "class_name": "KvferryL2Adapter",
                "adapter_params": {"server": address, "secret": SECRET, "timeout": 30.0, **dict(_param(x) for x in a.param)},
            },
            l1,
        )
        adapters["fs"] = _adapter({"type": "fs", "base_path": fs_dir}, l1)

        def quiet(_msg: str) -> None:
            return None

        for name, ad in adapters.items():
            r = bench_store(ad, 1, n, size, 1, lambda _r: [keys], lambda _r: [src], quiet)
            if r.total_success != n:
                raise SystemExit(f"bench_l2: {name} stored {r.total_success}/{n} objects")
        per: dict[str, list[float]] = {k: [] for k in adapters}
        for run in range(a.runs):
            order = list(adapters) if run % 2 == 0 else list(reversed(adapters))
            for name in order:
                r = bench_load(adapters[name], 1, n, size, a.rounds, lambda _r: [keys], lambda _r: [dst], quiet)
                if r.timed_out_rounds or r.total_success != n * a.rounds:
                    raise SystemExit(f"bench_l2: {name} loaded {r.total_success}/{n * a.rounds} objects")
                for s_obj, d_obj in zip(src, dst):
                    if not torch.equal(s_obj.raw_data, d_obj.raw_data):
                        raise SystemExit(f"bench_l2: {name} loaded different bytes")
                per[name].append(total * a.rounds / sum(r.round_durations))
    finally:
        for ad in adapters.values():
            ad.close()
        proc.kill()
        proc.wait(10)
        if a.fs_dir is None:
            shutil.rmtree(fs_dir, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in per.items()}
    out = {
        "num_keys": n,
        "data_size_bytes": size,
        "runs": a.runs,
        "rounds": a.rounds,
        "gib_per_s_median": {k: v / (1 << 30) for k, v in med.items()},
        "gib_per_s_runs": {k: [x / (1 << 30) for x in v] for k, v in per.items()},
        "kvferry_over_fs": med["kvferry"] / med["fs"],
    }
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"L2 load throughput, {n} x {a.data_size_kb} KiB per round, {a.rounds} rounds a run, median of {a.runs} interleaved runs")
        for k in adapters:
            runs = ", ".join(f"{x:.2f}" for x in out["gib_per_s_runs"][k])
            print(f"  {k:8s} {out['gib_per_s_median'][k]:7.2f} GiB/s   (runs: {runs})")
        print(f"  kvferry / fs: {out['kvferry_over_fs']:.2f}x")
    return out


if __name__ == "__main__":
    main()
