"""The repository's Python example runs as its README says and succeeds."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_prefill_decode_example_moves_every_byte_across_processes() -> None:
    script = ROOT / "examples" / "prefill_decode.py"
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "every byte matches" in out.stdout, out.stdout
    assert "released: [('request-42', 'done')]" in out.stdout, out.stdout
