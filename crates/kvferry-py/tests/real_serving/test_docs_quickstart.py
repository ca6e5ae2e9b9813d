"""docs/vllm.md's "P/D on one machine in three commands", run exactly as written.

The section's shell blocks are taken from the docs as they are (the install line, the
two servers, the router, then the ``curl`` of a completion) and run by ``bash`` from the
repository's root, as a user would paste them; the test adds only bounded waits around
them (health, then the completion) and the cleanup. It checks that the answer came
through the router and that the decode counted the prompt's tokens as pulled through
kvferry. Long-run only (``KVFERRY_SERVE_LONG=1``): it runs the install script and starts
two more servers on the docs' fixed ports (8000, 8100, 8200).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[4]
PORTS = (8000, 8100, 8200, 29000)
LOGS = ("kv_producer.log", "kv_consumer.log", "router.log")


def quickstart_blocks() -> list[str]:
    """The shell blocks of the docs' quick-start section, in order."""
    text = (REPO / "docs" / "vllm.md").read_text()
    start = text.index("## P/D on one machine in three commands")
    section = text[start : text.index("\n## ", start + 1)]
    return re.findall(r"```sh\n(.*?)```", section, re.S)


def _busy(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.skipif(os.environ.get("KVFERRY_SERVE_LONG") != "1", reason="runs the install script: KVFERRY_SERVE_LONG=1")
def test_quickstart_as_written(serve_env: None) -> None:
    blocks = quickstart_blocks()
    assert len(blocks) == 4, f"expected install, servers, router and curl blocks, found {len(blocks)}"
    busy = [p for p in PORTS if _busy(p)]
    if busy:
        pytest.skip(f"the docs' ports {busy} are in use here")
    present = [f for f in LOGS if (REPO / f).exists()]
    if present:
        pytest.skip(f"{present} already exist in the checkout; the docs' commands would overwrite them")
    script = "\n".join(
        [
            blocks[0], blocks[1], blocks[2],
            'for i in $(seq 1 300); do curl -sf -m 2 localhost:8000/health >/dev/null && break; sleep 1; done',
            f'for i in $(seq 1 60); do out=$({blocks[3].strip()}) && echo "$out" | grep -q choices && break; sleep 2; done',
            'echo "ANSWER $out"',
            'echo "METRICS $(curl -s -m 10 localhost:8200/metrics | grep "^vllm:prompt_tokens_by_source_total.*external_kv_transfer")"',
            "kill %1 %2 %3; wait",
        ]
    )  # fmt: skip
    p = subprocess.Popen(
        ["bash", "-c", script], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        out, _ = p.communicate(timeout=900)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(10)
        logs = {f: (REPO / f).read_text(errors="replace")[-2000:] for f in LOGS if (REPO / f).exists()}
        for f in LOGS:
            (REPO / f).unlink(missing_ok=True)
    text = out.decode(errors="replace")
    answer = next((line for line in text.splitlines() if line.startswith("ANSWER ")), "")
    assert '"choices"' in answer and '"finish_reason":"length"' in answer, f"no completion:\n{text[-3000:]}\n{logs}"
    metric = next((line for line in text.splitlines() if line.startswith("METRICS ")), "")
    pulled = float(metric.rsplit(" ", 1)[-1]) if metric.strip() != "METRICS" else 0.0
    assert pulled > 0, f"the decode counted no prompt token through kvferry: {metric!r}"
    print(f"quick start as written: {answer[:160]}... ; {pulled:.0f} prompt tokens through kvferry")
