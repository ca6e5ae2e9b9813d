"""The shared secret between a prefill and a decode (``secret``, or ``secret_file`` to keep
it off the command line), under vLLM's real scheduler on CPU (``vllm_harness.py``): with
the same secret the pulls land; with another the decode's pulls are load errors within
the timeout and nothing is held on either side; a bad ``secret_file`` is refused when
the connector is made, naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_harness import Instance, prefill, prompts


def _secret_file(tmp_path: Path, name: str, text: str) -> str:
    f = tmp_path / name
    f.write_text(text)
    f.chmod(0o600)
    return str(f)


def _landed_right(d: Instance, reqs: list[tuple[str, list[int]]]) -> None:
    for rid, prompt in reqs:
        for rank in range(d.tp):
            for pos in range(len(prompt)):
                assert d.landed[rid][rank][pos] == d.expected(prompt, rank, pos), (rid, rank, pos)


def test_a_secret_file_on_both_sides_lets_the_pulls_land(made, tmp_path):
    shared = _secret_file(tmp_path, "secret", "  correct horse battery staple, and a stapler\n")  # stripped, as the CLI reads it
    p = Instance("kv_producer", tp=1, tag="p", extra={"secret_file": shared})
    made.append(p)
    # The decode gives the same secret inline: the file's whitespace is not part of it.
    d = Instance("kv_consumer", tp=1, tag="d", extra={"secret": "correct horse battery staple, and a stapler"})
    made.append(d)
    reqs = prompts(3, seed=81, lo=20, hi=40)
    params = prefill(p, reqs)
    for rid, prompt in reqs:
        d.add(rid, prompt, max_tokens=2, params=params[rid])
    d.run_until(lambda: all(r in d.finished_recving for r, _ in reqs), 20, "the pulls")
    assert not d.failed_recving, d.failed_recving
    _landed_right(d, reqs)
    d.run_until(lambda: all(r in d.final for r, _ in reqs), 10, "the decodes")
    p.run_until(lambda: not (p.held() & {r for r, _ in reqs}), 10, "the prefill to free every request")
    assert p.leaks() == [] and d.leaks() == []


def test_another_secret_is_a_load_error_and_nothing_is_held(made, tmp_path):
    p = Instance("kv_producer", tp=1, tag="p", extra={"secret_file": _secret_file(tmp_path, "p", "the prefill instance's secret, 32 bytes or more"), "lease_ttl": 3.0})
    made.append(p)
    d = Instance("kv_consumer", tp=1, tag="d", extra={"secret_file": _secret_file(tmp_path, "d", "not the prefill instance's secret, 32 bytes or more"), "timeout": 3.0})
    made.append(d)
    reqs = prompts(2, seed=82, lo=20, hi=40)
    params = prefill(p, reqs)
    for rid, prompt in reqs:
        d.add(rid, prompt, max_tokens=2, params=params[rid])
    d.run_until(lambda: all(r in d.failed_recving for r, _ in reqs), 15, "the refused pulls")
    assert d.invalid_blocks, "the refused pulls' blocks are reported as load errors"
    d.run_until(lambda: all(r in d.final for r, _ in reqs), 20, "the decodes (recomputed or failed)")
    # The prefill never authenticated the decode: its publications end at lease expiry.
    p.run_until(lambda: not (p.held() & {r for r, _ in reqs}), 15, "the prefill to free every request")
    assert p.leaks() == [] and d.leaks() == []
    assert p.free_blocks() == p.free_at_start and d.free_blocks() == d.free_at_start


@pytest.mark.parametrize(
    "extra,match",
    [
        ({"secret": "a", "secret_file": "/nonexistent"}, "secret or secret_file, not both"),
        ({"secret_file": "/nonexistent/kvferry-secret"}, "cannot read secret_file '/nonexistent/kvferry-secret'"),
        ({"secret_file": "EMPTY"}, "is empty"),
    ],
)
def test_a_bad_secret_file_is_refused_naming_the_key(made, tmp_path, extra, match):
    if extra.get("secret_file") == "EMPTY":
        extra = {"secret_file": _secret_file(tmp_path, "empty", " \n")}
    with pytest.raises(ValueError, match=match):
        Instance("kv_producer", tp=1, tag="p", extra=extra)


def test_listening_beyond_loopback_without_a_secret_is_warned_about(made, caplog):
    with caplog.at_level("WARNING", logger="kvferry.integrations.vllm.config"):
        made.append(Instance("kv_producer", tp=1, tag="p", extra={"host": "127.0.0.1"}))
        assert not [r for r in caplog.records if "without a shared secret" in r.getMessage()]
        made.append(Instance("kv_producer", tp=1, tag="p2", extra={"host": "0.0.0.0", "advertise_host": "127.0.0.1"}))
    warned = [r.getMessage() for r in caplog.records if "without a shared secret" in r.getMessage()]
    assert warned and "0.0.0.0" in warned[0] and "secret_file" in warned[0], warned
