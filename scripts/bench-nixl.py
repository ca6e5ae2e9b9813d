#!/usr/bin/env python3
"""NIXL same-host read benchmark, for comparison with `kvferry bench` (issue 42).

Two processes on one host. The target process registers a host (DRAM) buffer of
`--bytes` (default 1 GiB) filled with a deterministic pattern; the initiator (this
process) registers its own buffer of the same size, the two exchange NIXL agent
metadata and the target's descriptors over a multiprocessing pipe, and the
initiator READs the whole working set in `--block` (default 4 MiB) descriptors —
all blocks in one transfer request, posted once per run, as NIXL users do (e.g. one
request per layer set). NIXL's UCX backend with UCX's default transports: nothing
restricts UCX_TLS, so UCX chooses (on one host: `cma`, i.e. process_vm_readv).

Timing: one untimed warm-up run, then `--runs` (default 5) timed runs; each timed
run is post + poll until DONE. Before every run the destination is overwritten
with a poison byte (outside the timed region). After the last timed run the whole
destination is compared once with the expected pattern (outside the timed region;
NIXL itself verifies nothing). Prints one JSON object:
  {"engine":"nixl","backend":"UCX","gbps":[...],"median":...,"verified":true,...}

`--busy 1` starts one busy process beside the initiator for the timed runs (one OS
thread computing a checksum over its own 256 KiB buffer in a loop: zlib.crc32 here,
the stand-in for `kvferry bench --contend 1`'s crc32c loop over a 256 KiB buffer).
A process, not a Python thread, so that it does not take the initiator's GIL.

NIXL agent configuration: NIXL's defaults (progress thread on, `num_threads` 0) unless
`--no-prog-thread` (no progress thread) or `--num-threads N` (the UCX backend's
`num_threads`: N threads share each transfer request) are given; on a 2-core machine
these change NIXL's figure a lot, so compare with each (docs/benchmarks.md).
In every configuration the READ is posted by this process and UCX moves it with
`process_vm_readv`: `--proto-info` sets UCX_PROTO_INFO=y, and UCX then prints (on
stdout, before the JSON line) its protocol table, whose READ line names the transport:
  remote memory read by ucp_get*(multi) into host memory from host | 0..inf | zero-copy | cma/memory

Run it with the NIXL venv's Python, e.g.
  ~/.cache/kvferry/venv-nixl/bin/python scripts/bench-nixl.py [--busy 1] [--no-prog-thread] [--num-threads 2]
(NIXL installs from the Python registry as `nixl-cu12`; its package is `nixl_cu12`;
`pip install --no-deps nixl-cu12 numpy` avoids torch, which the API does not import.)
The JSON object is the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import numpy as np

MIB = 1 << 20
POISON = 0xA5


def _nixl():
    # NIXL's Python logger prints INFO lines on stdout; keep stdout for the JSON.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        import nixl_cu12 as nixl  # the pip wheel `nixl-cu12`
    except ImportError:
        import nixl  # type: ignore  # a source build or the `nixl` meta package
    return nixl


def pattern_block(index: int, block: int) -> np.ndarray:
    """The expected bytes of block `index`: a 64-bit mix of the global word index."""
    words = block // 8
    w = np.arange(index * words, (index + 1) * words, dtype=np.uint64)
    w *= np.uint64(0x9E3779B97F4A7C15)
    w ^= w >> np.uint64(29)
    return w.view(np.uint8)


def target_main(conn, total: int, block: int) -> None:
    nixl = _nixl()
    buf = np.empty(total, dtype=np.uint8)
    nblocks = total // block
    for i in range(nblocks):
        buf[i * block : (i + 1) * block] = pattern_block(i, block)
    agent = nixl.nixl_agent("kvferry-bench-target", nixl.nixl_agent_config(backends=["UCX"]))
    addr = buf.ctypes.data
    agent.register_memory([(addr, total, 0, "")], "DRAM")
    # Metadata and where the registered buffer lives; the initiator builds its
    # remote descriptor lists (4 MiB each) from the base address.
    conn.send((agent.get_agent_metadata(), addr, os.getpid()))
    # Stay alive (and registered) until the initiator is done.
    msg = conn.recv()
    assert msg == "done", msg
    conn.send("bye")


def busy_main(stop) -> None:
    import zlib

    data = os.urandom(256 * 1024)
    c = 0
    while not stop.is_set():
        for _ in range(64):
            c = zlib.crc32(data, c)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", default="1GiB", help="working set (default 1GiB)")
    ap.add_argument("--block", default="4MiB", help="descriptor size (default 4MiB)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--busy", type=int, default=0, help="busy processes beside the initiator")
    ap.add_argument("--requests", type=int, default=1, help="transfer requests the blocks are split into")
    ap.add_argument("--num-threads", type=int, default=0,
                    help="nixl_agent_config num_threads for UCX (0: NIXL's default)")
    ap.add_argument("--no-prog-thread", action="store_true",
                    help="disable NIXL's progress thread (default: NIXL's default, enabled)")
    ap.add_argument("--proto-info", action="store_true",
                    help="UCX_PROTO_INFO=y: UCX prints its protocol choices (the transport) on stdout")
    args = ap.parse_args()
    if args.proto_info:
        os.environ["UCX_PROTO_INFO"] = "y"  # before NIXL/UCX load; the spawned target inherits it

    def size(s: str) -> int:
        s = s.strip()
        for suf, m in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1024)):
            if s.endswith(suf):
                return int(float(s[: -len(suf)]) * m)
        return int(s)

    total, block = size(args.bytes), size(args.block)
    assert total % block == 0 and block % 8 == 0
    nblocks = total // block
    assert nblocks % args.requests == 0

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    target = ctx.Process(target=target_main, args=(child, total, block), daemon=True)
    target.start()

    nixl = _nixl()
    dst = np.empty(total, dtype=np.uint8)
    dst.fill(POISON)  # fault every page in before registration
    agent = nixl.nixl_agent(
        "kvferry-bench-initiator",
        nixl.nixl_agent_config(
            enable_prog_thread=not args.no_prog_thread,
            num_threads=args.num_threads,
            backends=["UCX"],
        ),
    )
    daddr = dst.ctypes.data
    agent.register_memory([(daddr, total, 0, "")], "DRAM")

    meta, raddr, target_pid = parent.recv()
    remote_name = agent.add_remote_agent(meta)
    agent.make_connection(remote_name)

    per = nblocks // args.requests
    handles = []
    for r in range(args.requests):
        local = agent.get_xfer_descs(
            [(daddr + i * block, block, 0) for i in range(r * per, (r + 1) * per)], "DRAM"
        )
        remote = agent.get_xfer_descs(
            [(raddr + i * block, block, 0) for i in range(r * per, (r + 1) * per)], "DRAM"
        )
        handles.append(agent.initialize_xfer("READ", local, remote, remote_name))

    post_s = []

    def one_run() -> float:
        t0 = time.perf_counter()
        for h in handles:
            st = agent.transfer(h)
            if st == "ERR":
                raise RuntimeError("NIXL transfer post failed")
        post_s.append(time.perf_counter() - t0)
        for h in handles:
            while True:
                st = agent.check_xfer_state(h)
                if st == "DONE":
                    break
                if st == "ERR":
                    raise RuntimeError("NIXL transfer failed")
        return time.perf_counter() - t0

    backend = agent.query_xfer_backend(handles[0])
    dst.fill(POISON)
    one_run()  # warm-up (connection, first-use costs); untimed

    stop = ctx.Event()
    busy = [ctx.Process(target=busy_main, args=(stop,), daemon=True) for _ in range(args.busy)]
    for b in busy:
        b.start()
    if busy:
        time.sleep(0.3)  # let the busy loop get going

    gbps = []
    load = []
    for _ in range(args.runs):
        dst.fill(POISON)  # untimed: every run must land every byte again
        load.append(os.getloadavg()[0])
        dt = one_run()
        gbps.append(total / dt / 1e9)

    stop.set()
    for b in busy:
        b.join(5)

    # One comparison after timing (not in the timed region): the last run's bytes.
    verified = True
    bad_blocks = 0
    for i in range(nblocks):
        if not np.array_equal(dst[i * block : (i + 1) * block], pattern_block(i, block)):
            verified = False
            bad_blocks += 1

    for h in handles:
        agent.release_xfer_handle(h)
    parent.send("done")
    parent.recv()
    target.join(10)

    out = {
        "engine": "nixl",
        "version": _version(),
        "backend": backend,
        "ucx_tls": os.environ.get("UCX_TLS", "(unset: UCX's defaults)"),
        "bytes": total,
        "block": block,
        "blocks": nblocks,
        "requests": args.requests,
        "busy": args.busy,
        "gbps": [round(g, 3) for g in gbps],
        "median": round(statistics.median(gbps), 3),
        "best": round(max(gbps), 3),
        "verified": verified,
        "bad_blocks": bad_blocks,
        "verify": "one comparison of every byte after the timed runs (untimed); destination poisoned before each run",
        "post_share": [round(p / (total / g / 1e9), 3) for p, g in zip(post_s[1:], gbps)],
        "prog_thread": not args.no_prog_thread,
        "num_threads": args.num_threads,
        "loadavg_1m": [round(x, 2) for x in load],
        "target_pid": target_pid,
    }
    print(json.dumps(out), flush=True)
    sys.stderr.flush()
    # NIXL 1.5.1's pip build crashes (SIGSEGV) in interpreter teardown after the
    # agent is garbage-collected; everything is measured and printed by now, so
    # leave without running the teardown.
    os._exit(0 if verified else 1)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("nixl-cu12")
    except Exception:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
