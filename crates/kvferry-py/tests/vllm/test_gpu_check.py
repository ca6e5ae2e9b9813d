"""``scripts/gpu_connector_check.py`` (the connector part of ``scripts/gpu-check.sh``)
runs here without a GPU: over CPU tensors through the sim device's path and through
host memory, every byte compared, and with ``--device cuda`` it says why it skips (or,
where a GPU and a CUDA build exist, passes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[4] / "scripts" / "gpu_connector_check.py"
SMALL = ["--requests", "8", "--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--timeout", "20"]


def _run(*args: str) -> tuple[int, str, dict]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    p = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=env)
    last = [line for line in p.stdout.splitlines() if line.startswith("{")]
    assert last, f"no JSON line (rc {p.returncode}):\n{p.stdout}\n{p.stderr[-3000:]}"
    return p.returncode, p.stdout, json.loads(last[-1])


@pytest.mark.parametrize("device", ["sim", "host"])
def test_connector_halves_on_cpu(need_vllm, device):
    rc, out, res = _run("--device", device, *SMALL)
    assert rc == 0 and res["ok"] is True, out
    assert res["corrupted_blocks"] == 0 and res["failed"] == 0 and res["unreleased"] == 0
    assert res["requests"] == 16 and res["bytes"] == 16 * 4 * res["block_bytes"]
    if device == "sim":
        assert res["engines"] == {"prefill": "sim", "decode": "sim"}
        assert res["device_stats"]["prefill"]["operations"] >= 16  # a gather per pull
        assert res["device_stats"]["decode"]["operations"] >= 16  # a scatter per pull
    else:
        assert res["engines"] == {"prefill": "host", "decode": "host"}


def test_cuda_check_skips_with_a_reason_or_passes(need_vllm):
    rc, out, res = _run("--device", "cuda", *SMALL)
    assert rc == 0, out
    if res["ok"] is None:
        assert out.startswith("skipped: ") and res["skipped"], out
    else:
        assert res["ok"] is True and res["engines"] == {"prefill": "cuda:0", "decode": "cuda:0"}, out
