"""`python -m kvferry bench`: a short run end to end, through its JSON output."""

from __future__ import annotations

import json
import subprocess
import sys

CHUNK = 4 * 655360  # default --chunk-blocks x --block-bytes
BYTES = 64 << 20


def test_bench_json() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvferry", "bench", "--bytes", "64MiB", "--json", "--rust-bench", "none"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    r = json.loads(proc.stdout)
    assert r["corrupted_chunks"] == 0 and r["corrupted_bytes"] == 0
    assert r["leaked_pages"] == 0
    assert r["close_clean"] is True
    assert r["errors"] == 0
    assert r["gbps"] > 0
    assert r["bytes_requested"] == BYTES
    assert r["chunk_bytes"] == CHUNK
    assert r["chunks"] == BYTES // CHUNK == 25
    assert r["bytes"] == r["chunks"] * CHUNK
    assert 0 < r["p50_ms"] <= r["p99_ms"]
    assert r["miss_calls"] == 2000 and r["miss_errors"] == 0
    assert 0 < r["miss_p50_us"] <= r["miss_p99_us"]
    assert r["rust_gbps"] is None and r["ratio_to_rust"] is None and "none" in r["rust_note"]
    # CPU per GB of the transfer loop: every thread counted, so at least the bytes'
    # socket copies (far above zero) and below a core-second per 64 MiB.
    assert 0 < r["cpu_s_per_gb"] < 1.0 / (BYTES / 1e9)
    assert r["miss_cpu_us_per_call"] > 0
    assert r["wakeups_per_chunk"] >= 0
    assert r["cpu_ratio_to_rust"] is None


def test_bench_help_explains_fields() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvferry", "bench", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    for field in ("gbps", "p50_ms", "p99_ms", "errors", "corrupted_chunks", "leaked_pages",
                  "miss_p50_us", "miss_p99_us", "rust_gbps", "ratio_to_rust", "--rust-bench", "--in-flight",
                  "cpu_s_per_gb", "miss_cpu_us_per_call", "wakeups_per_chunk", "cpu_ratio_to_rust"):  # fmt: skip
        assert field in out, field
