"""``python -m kvferry bench``: the transfer benchmark, through the Python API.

Two engines in this process over loopback, on the process's shared runtime (as the
Rust bench's engines share one): ``prefill`` publishes chunks of one numpy array (every
chunk its own random bytes); ``--in-flight`` worker threads of ``decode`` each fetch
chunks with ``Engine.get`` and ``Transfer.wait`` into a slot of their own in a
destination array and check every landed chunk before the next: its crc32c (computed
with the GIL released, as the Rust bench checks its chunks) against its source's, and
on a mismatch count the differing bytes. The Rust bench has the same shape: one task
per transfer in flight, each getting and then verifying its slot. Then the Rust
``kvferry bench`` moves the same bytes the same way (``--path direct``), so that
``ratio_to_rust`` says what the Python layer costs on this machine, in this run. Last,
the per-call overhead: ``get_blocking`` calls that miss.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .errors import Error, NotFoundError

RUST_TIMEOUT_S = 1800.0
"""Bound on the Rust bench (it also measures its TCP and pipeline limits)."""
RUST_BLOCK_BYTES = 655360
"""Block size of the Rust bench's default model preset (llama3-70b-tp8: 640 KiB)."""

DESCRIPTION = """\
Benchmarks kvferry through its Python API: two engines in this process over loopback.
The prefill engine publishes chunks (--chunk-blocks blocks of --block-bytes each) of
one numpy array holding --requests requests x --chunks-per-request chunks, every chunk
with its own random bytes. The decode engine fetches chunks round-robin over them from
--in-flight worker threads (as the Rust bench runs one task per transfer in flight),
each with its own slot of a destination array: Engine.get, Transfer.wait, then the
landed chunk's crc32c against its source's (every byte; on a mismatch numpy counts the
differing bytes), then the next chunk into the same slot. Both engines run on the
process's shared runtime (--separate-runtimes: one each), as the Rust bench's engines
share one. Then it runs the Rust
benchmark on the same workload and times --miss-calls get_blocking calls that miss."""

EPILOG = """\
printed fields (the table shows them; --json prints one object with these keys,
plus the options used: path, bytes_requested, block_bytes, chunk_blocks, requests,
chunks_per_request, in_flight, connections, runtimes ("shared" or "separate"),
wait_spin_us):
  bytes               chunk bytes landed and verified (chunks - errors) x chunk_bytes;
                      bytes_requested is --bytes, chunks = max(1, bytes_requested //
                      chunk_bytes) transfers were issued
  chunk_bytes         --chunk-blocks x --block-bytes
  elapsed_s           wall time of the transfer loop (gets, waits and verification)
  gbps                bytes / elapsed_s / 1e9 (GB/s, decimal)
  p50_ms, p99_ms      per-chunk latency: Engine.get called to Transfer.wait returned
  errors              transfers that raised (none expected: no faults are injected)
  corrupted_chunks    landed chunks whose bytes differ from their source;
  corrupted_bytes     how many bytes differ in them (the table's "corrupt B" column)
  checksum_failures   chunks the decode engine rejected on its checksum (stats())
  leaked_pages        staging-arena pages of both engines neither free nor
                      quarantined after the run (stats() polled for up to 5 s)
  close_clean         both engines closed with nothing outstanding
  miss_calls          get_blocking calls for keys that were never published;
  miss_p50_us,        their latency, call to NotFoundError raised, in microseconds:
  miss_p99_us         the fixed per-call cost (Python layer, engine, one round trip)
  miss_errors         miss calls that did not raise NotFoundError
  cpu_s_per_gb        CPU seconds (user + system, every thread of this process: the
                      workers, the engines' runtime and copy threads) per GB over the
                      transfer loop, as the Rust bench's `cpu_s_per_gb`
  miss_cpu_us_per_call  the same over the miss loop, microseconds per call
  wakeups_per_chunk   voluntary context switches of the process (a thread blocked,
                      then woken) per chunk over the transfer loop, as the Rust
                      bench's field
  cpu_ratio_to_rust   cpu_s_per_gb / the Rust bench's cpu_s_per_gb (null without it)
  rust_gbps           the Rust `kvferry bench --path direct --json --quiet` on the same
                      bytes, chunk blocks, requests, in-flight and connections, run
                      right after (its `gbps` field); `rust` holds its gbps,
                      p50/p99, tcp_limit_gbps (raw loopback TCP moving the same
                      bytes, measured in its run), chunks, bytes, elapsed_s, errors,
                      corrupted_bytes, leaked_pages, cpu_s_per_gb, tcp_cpu_s_per_gb,
                      wakeups_per_chunk, exit_status and binary. It runs with
                      `--verify reread`: it checksums every landed chunk again, as
                      this bench does, so both do the same work per byte
  ratio_to_rust       gbps / rust_gbps (null when the Rust bench was skipped;
                      rust_note says why, or notes a workload that differs). One
                      difference stays: the Rust producers hold a per-layer layout
                      (a 2.5 MiB chunk is 160 ranges of 16 KiB), this bench one
                      contiguous array (a chunk is one range)

The Rust binary is --rust-bench PATH, else `kvferry` on PATH, else
<repo>/target/release/kvferry next to this package's source (cargo build --release -p
kvferry-cli); if none is found the comparison is skipped with a note.
Exit status: 1 if any chunk landed corrupted or any page leaked, 2 on bad options,
else 0."""

_UNITS = {
    "": 1, "b": 1, "B": 1,
    "k": 1 << 10, "K": 1 << 10, "KiB": 1 << 10, "kib": 1 << 10, "Ki": 1 << 10,
    "m": 1 << 20, "M": 1 << 20, "MiB": 1 << 20, "mib": 1 << 20, "Mi": 1 << 20,
    "g": 1 << 30, "G": 1 << 30, "GiB": 1 << 30, "gib": 1 << 30, "Gi": 1 << 30,
    "KB": 1000, "kB": 1000, "kb": 1000,
    "MB": 10**6, "mb": 10**6,
    "GB": 10**9, "gb": 10**9,
}  # fmt: skip


def parse_size(text: str) -> int:
    """``"1GiB"``, ``"64MiB"``, ``"655360"``, ``"1.5G"``, ``"100MB"``: bytes, as the Rust CLI reads them."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2) not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1GiB, 64MiB, 655360)")
    n = int(float(m.group(1)) * _UNITS[m.group(2)])
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return n


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return n


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} TiB"  # unreachable


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile by nearest rank (as the Rust bench computes it); 0 if empty."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[round((len(s) - 1) * q)]


def _spin_us(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= n <= 1_000_000:
        raise argparse.ArgumentTypeError(f"must be in 0..1000000 (microseconds): {text!r}")
    return n


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bytes", type=parse_size, default=parse_size("1GiB"), metavar="SIZE",
                   help="total chunk bytes to move (default 1GiB; units B, KiB/K, MiB/M, GiB/G, KB, MB, GB)")
    p.add_argument("--chunk-blocks", type=_positive, default=4, metavar="N",
                   help="blocks per chunk: one published key, one transfer (default 4)")
    p.add_argument("--block-bytes", type=parse_size, default=RUST_BLOCK_BYTES, metavar="SIZE",
                   help="bytes per block (default 655360 = 640 KiB, llama3-70b with TP 8, as the Rust bench's "
                        "default model; another size still runs, but the Rust comparison then moves other chunks)")
    p.add_argument("--in-flight", type=_positive, default=4, metavar="N",
                   help="transfers outstanding at once, each into its own destination slot (default 4)")
    p.add_argument("--connections", type=_positive, default=4, metavar="N",
                   help="pooled connections from decode to prefill (connections_per_peer; default 4)")
    p.add_argument("--requests", type=_positive, default=32, metavar="N",
                   help="requests held by prefill, each with its own bytes (default 32)")
    p.add_argument("--chunks-per-request", type=_positive, default=4, metavar="N",
                   help="chunks per request (default 4); prefill holds requests x chunks-per-request chunks "
                        "(320 MiB by default), fetched round-robin until --bytes moved")
    p.add_argument("--miss-calls", type=_positive, default=2000, metavar="N",
                   help="get_blocking calls that miss, timed for the per-call overhead (default 2000)")
    p.add_argument("--separate-runtimes", action="store_true",
                   help="give each engine a runtime of its own (Engine(shared_runtime=False)) instead of "
                        "the process's shared one, which the Rust bench's engines share too")
    p.add_argument("--runtime-threads", type=_positive, default=None, metavar="N",
                   help="Engine(runtime_threads=...) of both engines (default: the Engine default)")
    p.add_argument("--wait-spin-us", type=_spin_us, default=None, metavar="US",
                   help="Engine(wait_spin_us=...) of both engines (default: the Engine default)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--rust-bench", default=None, metavar="PATH|none",
                   help="the Rust `kvferry` binary to compare with (default: `kvferry` on PATH, else "
                        "<repo>/target/release/kvferry); `none` skips the comparison")


def _rust_binary(choice: str | None) -> tuple[str | None, str | None]:
    """The Rust binary to run and, when there is none, why."""
    if choice is not None:
        if choice.lower() == "none":
            return None, "skipped (--rust-bench none)"
        if not (os.path.isfile(choice) and os.access(choice, os.X_OK)):
            return None, f"skipped: --rust-bench {choice} is not an executable file"
        return choice, None
    on_path = shutil.which("kvferry")
    if on_path:
        return on_path, None
    # An editable/dev install: this file is <repo>/crates/kvferry-py/python/kvferry/bench.py.
    for parent in Path(__file__).resolve().parents:
        cand = parent / "target" / "release" / "kvferry"
        if (parent / "Cargo.toml").is_file() and cand.is_file() and os.access(cand, os.X_OK):
            return str(cand), None
    return None, (
        "skipped: no Rust kvferry binary (not on PATH, no <repo>/target/release/kvferry); "
        "build it with `cargo build --release -p kvferry-cli` or pass --rust-bench PATH"
    )


def run_rust(binary: str, a: argparse.Namespace) -> dict[str, Any]:
    """Runs the Rust bench on the same workload and returns its JSON object."""
    cmd = [
        binary, "bench", "--path", "direct", "--bytes", str(a.bytes), "--json", "--quiet",
        "--blocks-per-chunk", str(a.chunk_blocks), "--in-flight", str(a.in_flight),
        "--connections", str(a.connections), "--requests", str(a.requests),
        "--chunks-per-request", str(a.chunks_per_request), "--verify", "reread",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUST_TIMEOUT_S)
    start = proc.stdout.find("{")
    if start < 0:
        tail = (proc.stderr or proc.stdout).strip()[-500:]
        raise RuntimeError(f"`{' '.join(cmd)}` exited {proc.returncode} without JSON: {tail}")
    out: dict[str, Any] = json.loads(proc.stdout[start:])
    out["exit_status"] = proc.returncode
    return out


def _usage() -> tuple[float, int]:
    """CPU seconds (user + system) and voluntary context switches of this process so
    far, every thread counted."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime, u.ru_nvcsw


def run_python(a: argparse.Namespace) -> dict[str, Any]:
    """The transfer loop and the miss loop; returns the measured fields."""
    import numpy as np

    from ._engine import DEFAULT_WAIT_SPIN_US, Engine, Transfer
    from ._kvferry import crc32c

    bb, bpc = a.block_bytes, a.chunk_blocks
    chunk_bytes = bb * bpc
    src_chunks = a.requests * a.chunks_per_request
    total = max(1, a.bytes // chunk_bytes)

    # Source: every chunk its own random bytes (blocks (r * cpr + c) * bpc ..).
    rng = np.random.default_rng(0x6B7666)
    kv = np.empty((src_chunks * bpc, bb), dtype=np.uint8)
    for i in range(src_chunks):
        kv[i * bpc : (i + 1) * bpc] = np.frombuffer(rng.bytes(chunk_bytes), dtype=np.uint8).reshape(bpc, bb)
    want_crc = [crc32c(kv[i * bpc : (i + 1) * bpc].data) for i in range(src_chunks)]
    out = np.zeros((a.in_flight * bpc, bb), dtype=np.uint8)

    day = 24 * 3600.0
    opts: dict[str, Any] = {"shared_runtime": not a.separate_runtimes}
    if a.wait_spin_us is not None:
        opts["wait_spin_us"] = a.wait_spin_us
    if a.runtime_threads is not None:
        opts["runtime_threads"] = a.runtime_threads
    prefill = Engine(ttl=day, max_ttl=day, peer_id="bench-prefill", **opts)
    decode = Engine(listen=None, connections_per_peer=a.connections, peer_id="bench-decode", **opts)
    engines = (prefill, decode)
    try:
        src = prefill.register_kv_cache(kv, block_bytes=bb, name="bench-kv")
        dst = decode.register_kv_cache(out, block_bytes=bb, name="bench-out")
        for i in range(src_chunks):
            prefill.publish(f"bench/chunk{i}", src, range(i * bpc, (i + 1) * bpc), once=False)
        peer = prefill.address
        assert peer is not None

        cpr, requests = int(a.chunks_per_request), int(a.requests)

        def source_index(n: int) -> int:  # as the Rust bench: request r, chunk c
            r = (n // cpr) % requests
            return r * cpr + n % cpr

        # One worker thread per transfer in flight, each fetching into its own slot
        # and verifying what landed there before its next get: the structure of the
        # Rust bench, whose in-flight tasks each get and then verify their slot. The
        # GIL is released in get's wait and in crc32c, so workers overlap as tasks do.
        lat_ms: list[float] = []
        counts = {"errors": 0, "corrupted_chunks": 0, "corrupted_bytes": 0, "issued": 0}
        lock = threading.Lock()
        failures: list[BaseException] = []

        def worker(slot: int) -> None:
            blocks = list(range(slot * bpc, (slot + 1) * bpc))
            got = out[slot * bpc : (slot + 1) * bpc]
            try:
                while True:
                    with lock:
                        n = counts["issued"]
                        if n >= total or failures:
                            return
                        counts["issued"] = n + 1
                    i = source_index(n)
                    started = time.perf_counter()
                    t: Transfer = decode.get(peer, f"bench/chunk{i}", dst, blocks, timeout=30.0)
                    try:
                        landed = t.wait()
                    except Error:
                        landed = 0
                        t.cancel()  # the slot is reused only after the drain
                    if landed != 1:
                        with lock:
                            counts["errors"] += 1
                        continue
                    lat_ms.append((time.perf_counter() - started) * 1e3)
                    # Every landed byte, as the Rust bench verifies: crc32c of the landed
                    # chunk (GIL released) against its source's; on a mismatch, the exact
                    # count of differing bytes.
                    if crc32c(got.data) != want_crc[i]:
                        bad = int(np.count_nonzero(got != kv[i * bpc : (i + 1) * bpc]))
                        with lock:
                            counts["corrupted_chunks"] += 1
                            counts["corrupted_bytes"] += bad
            except BaseException as e:  # reported by the main thread
                with lock:
                    failures.append(e)

        workers = [threading.Thread(target=worker, args=(s,), name=f"bench-{s}") for s in range(a.in_flight)]
        t0 = time.perf_counter()
        cpu0, csw0 = _usage()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        elapsed = time.perf_counter() - t0
        cpu1, csw1 = _usage()
        if failures:
            raise failures[0]
        errors = counts["errors"]
        corrupted_chunks, corrupted_bytes = counts["corrupted_chunks"], counts["corrupted_bytes"]
        moved = (total - errors) * chunk_bytes

        # Per-call overhead: gets of keys never published.
        miss_us: list[float] = []
        miss_errors = 0
        blocks = list(range(bpc))
        miss_cpu0, _ = _usage()
        for n in range(a.miss_calls):
            key = f"bench/miss{n}"
            c0 = time.perf_counter()
            try:
                decode.get_blocking(peer, key, dst, blocks, timeout=5.0)
                miss_errors += 1  # a hit: nothing was published under this key
            except NotFoundError:
                miss_us.append((time.perf_counter() - c0) * 1e6)
            except Error:
                miss_errors += 1
        miss_cpu = _usage()[0] - miss_cpu0

        # Every staging page back (free or quarantined) once the engines are quiet.
        deadline = time.monotonic() + 5.0
        while True:
            stats = [e.stats() for e in engines]
            leaked = sum(s["arena"]["total_pages"] - s["arena"]["free_pages"] - s["arena"]["quarantined_pages"]
                         for s in stats)  # fmt: skip
            if leaked == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        checksum_failures = stats[1]["consumer"]["checksum_failures"]
    finally:
        reports = [e.close() for e in engines]

    return {
        "path": "direct",
        "bytes_requested": a.bytes,
        "block_bytes": bb,
        "chunk_blocks": bpc,
        "chunk_bytes": chunk_bytes,
        "requests": a.requests,
        "chunks_per_request": a.chunks_per_request,
        "in_flight": a.in_flight,
        "connections": a.connections,
        "runtimes": "separate" if a.separate_runtimes else "shared",
        "wait_spin_us": a.wait_spin_us if a.wait_spin_us is not None else DEFAULT_WAIT_SPIN_US,
        "chunks": total,
        "bytes": moved,
        "elapsed_s": elapsed,
        "gbps": moved / elapsed / 1e9,
        "p50_ms": percentile(lat_ms, 0.5),
        "p99_ms": percentile(lat_ms, 0.99),
        "errors": errors,
        "corrupted_chunks": corrupted_chunks,
        "corrupted_bytes": corrupted_bytes,
        "checksum_failures": checksum_failures,
        "leaked_pages": leaked,
        "close_clean": all(bool(r["clean"]) for r in reports),
        "miss_calls": a.miss_calls,
        "miss_p50_us": percentile(miss_us, 0.5),
        "miss_p99_us": percentile(miss_us, 0.99),
        "miss_errors": miss_errors,
        "cpu_s_per_gb": (cpu1 - cpu0) / (moved / 1e9) if moved else 0.0,
        "miss_cpu_us_per_call": miss_cpu / a.miss_calls * 1e6 if a.miss_calls else 0.0,
        "wakeups_per_chunk": (csw1 - csw0) / total,
    }


_RUST_FIELDS = ("gbps", "p50_ms", "p99_ms", "tcp_limit_gbps", "chunk_bytes", "chunks", "bytes", "elapsed_s",
                "errors", "corrupted_bytes", "leaked_pages", "cpu_s_per_gb", "tcp_cpu_s_per_gb",
                "wakeups_per_chunk", "exit_status")  # fmt: skip


def run(a: argparse.Namespace) -> int:
    """Runs the benchmark and prints it; the exit status."""
    chunk_bytes = a.block_bytes * a.chunk_blocks
    if not a.json:
        print(
            f"kvferry {_version()} Python bench: {human(a.bytes)} in {human(chunk_bytes)} chunks "
            f"({a.chunk_blocks} x {human(a.block_bytes)}), {a.in_flight} in flight, "
            f"{a.connections} connections, loopback, path direct ...",
            file=sys.stderr,
            flush=True,
        )
    res = run_python(a)

    binary, note = _rust_binary(a.rust_bench)
    rust: dict[str, Any] | None = None
    if binary is not None:
        if not a.json:
            print(f"running the Rust bench ({binary}) on the same workload ...", file=sys.stderr, flush=True)
        try:
            full = run_rust(binary, a)
            rust = {k: full.get(k) for k in _RUST_FIELDS}
            rust["binary"] = binary
            if a.block_bytes != RUST_BLOCK_BYTES:
                note = (f"workload differs: the Rust bench's blocks are {RUST_BLOCK_BYTES} bytes, "
                        f"these {a.block_bytes}")  # fmt: skip
        except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
            note = f"Rust bench failed: {e}"
    rust_gbps = rust.get("gbps") if rust else None
    res["rust_gbps"] = rust_gbps
    res["ratio_to_rust"] = res["gbps"] / rust_gbps if isinstance(rust_gbps, (int, float)) and rust_gbps > 0 else None
    res["rust"] = rust
    rust_cpu = rust.get("cpu_s_per_gb") if rust else None
    res["cpu_ratio_to_rust"] = (
        res["cpu_s_per_gb"] / rust_cpu if isinstance(rust_cpu, (int, float)) and rust_cpu > 0 else None
    )
    res["rust_note"] = note

    if a.json:
        print(json.dumps(res, indent=2))
    else:
        print_table(res)
    bad = res["corrupted_chunks"] > 0 or res["leaked_pages"] > 0
    if bad and not a.json:
        print("INTEGRITY FAILURE: corrupted chunks or leaked pages", file=sys.stderr)
    return 1 if bad else 0


def _version() -> str:
    from ._kvferry import __version__

    return __version__


def print_table(r: dict[str, Any]) -> None:
    rust = r["rust"]
    print(f"{'':8} {'GB/s':>7} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7} {'corrupt B':>10} {'leaked':>7}")
    print(f"{'python':8} {r['gbps']:>7.2f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} {r['errors']:>7} "
          f"{r['corrupted_bytes']:>10} {r['leaked_pages']:>7}")  # fmt: skip
    if rust:
        print(f"{'rust':8} {rust['gbps'] or 0:>7.2f} {rust['p50_ms'] or 0:>8.2f} {rust['p99_ms'] or 0:>8.2f} "
              f"{rust['errors']!s:>7} {rust['corrupted_bytes']!s:>10} {rust['leaked_pages']!s:>7}")  # fmt: skip
    ratio = r["ratio_to_rust"]
    print(f"ratio_to_rust {ratio:.2f}" if ratio is not None else "ratio_to_rust n/a", end="")
    print(f"  ({r['rust_note']})" if r["rust_note"] else "")
    if rust and rust.get("tcp_limit_gbps"):
        print(f"raw loopback TCP limit (Rust bench, same bytes): {rust['tcp_limit_gbps']:.2f} GB/s")
    rust_cpu = f" (Rust {rust['cpu_s_per_gb']:.3f})" if rust and rust.get("cpu_s_per_gb") else ""
    print(f"CPU {r['cpu_s_per_gb']:.3f} s per GB{rust_cpu}, {r['wakeups_per_chunk']:.1f} wake-ups per chunk; "
          f"misses {r['miss_cpu_us_per_call']:.0f} us CPU per call")  # fmt: skip
    print(f"get_blocking miss: p50 {r['miss_p50_us']:.1f} us, p99 {r['miss_p99_us']:.1f} us "
          f"over {r['miss_calls']} calls ({r['miss_errors']} not NotFoundError)")  # fmt: skip
    print(f"moved {human(r['bytes'])} in {r['chunks']} chunks of {human(r['chunk_bytes'])} in {r['elapsed_s']:.2f} s; "
          f"every chunk compared with its source; corrupted chunks {r['corrupted_chunks']}, "
          f"checksum failures {r['checksum_failures']}, engines closed clean: {r['close_clean']}")  # fmt: skip
    print("(python -m kvferry bench --help explains every field)")


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="python -m kvferry bench")
    p.description = DESCRIPTION
    p.epilog = EPILOG
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
