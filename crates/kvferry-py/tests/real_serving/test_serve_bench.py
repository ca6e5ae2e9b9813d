"""The package's ``python -m kvferry.integrations.vllm.serve_bench`` against the running
P/D set-up and one instance: it exits 0 and reports every row it was asked for, with
times that are times (positive, ordered, within the request bound)."""

from __future__ import annotations

import json
import subprocess
import sys

import serving_harness as h


def test_serve_bench_reports_ttft_and_hand_off(pd: h.PD, single: h.Server) -> None:
    p = subprocess.run(
        [
            sys.executable, "-m", "kvferry.integrations.vllm.serve_bench",
            "--single", single.url, "--router", f"http://127.0.0.1:{pd.router.port}",
            "--prefill", pd.prefill.url, "--decode", pd.decode.url,
            "--concurrency", "1", "4", "--rounds", "1", "--requests", "4", "--max-tokens", "4", "--json",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert out["model"] == "tiny"
    rows = {(r["what"], r["concurrency"]): r for r in out["rows"]}
    for what in ("TTFT one instance", "TTFT P/D (router)", "prefill (max_tokens=1)", "hand-off", "decode floor (1-word prompt)"):
        for conc in (1, 4):
            r = rows[(what, conc)]
            assert r["n"] == 4, r
            assert 0 < r["min_ms"] <= r["p50_ms"] <= r["p90_ms"] <= r["max_ms"] < 300_000, r
    # The hand-off moved the prompt's KV through kvferry: the decode counted it.
    m = pd.decode.metrics()
    assert h.metric(m, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > 0
    h.assert_no_blocks_held(pd, single)
