"""``python -m kvferry.integrations.vllm.serve_bench``: time to first token of running
``vllm serve`` instances — P/D through its router against one instance — and the
hand-off between a prefill and a decode, measured from a client.

Nothing is started: point it at servers that run (docs/vllm.md, "P/D on one machine in
three commands", and one instance without a connector started the same way)::

    python -m kvferry.integrations.vllm.serve_bench --router http://127.0.0.1:8000 \\
        --single http://127.0.0.1:8300 --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --concurrency 1 8 32 --rounds 5

- **TTFT** (``--router`` and ``--single``): a streamed greedy completion's first token
  as the client sees it, the same prompts to both set-ups, ``--concurrency`` clients
  at once; the rounds interleave the set-ups (single, P/D, single, P/D, ...) so that
  both see the same machine; fresh prompts each round (no prefix-cache hit).
- **Hand-off** (``--prefill`` and ``--decode``): the client does what a P/D router does
  — the prompt to the prefill with ``max_tokens=1`` and
  ``kv_transfer_params={"do_remote_decode": true}``, then, the moment that answer
  arrives, to the decode (streamed) with the ``kv_transfer_params`` it returned — and
  times the second half: from the prefill's answer to the decode's first token (the
  decode's admission, kvferry's pull, the decode's first step). The prefill's own time
  is printed beside it, and the decode's floor: its TTFT for a one-word prompt sent
  straight to it (admission and a first step of its own, no pull), so that hand-off
  minus floor is what the transfer and its bookkeeping add.

Prompts are words of a seeded generator (``--prompt-words``), sent with
``ignore_eos`` so every answer has ``--max-tokens`` tokens. Prints a table, or one JSON
object with ``--json`` (median, p90, min and max per row, the per-round medians, the
load average before and after). Standard library only: it runs with any Python that
reaches the servers. Exit status 1 when a request failed.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import http.client as hc
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

WORDS = (
    "cache block layer token prefill decode transfer engine memory host device peer "
    "stream chunk page arena lease grant fence verify checksum socket kernel thread "
    "request prompt model batch queue step router server client latency bytes"
).split()


class BenchError(Exception):
    """A request that did not give what the bench needs (status, body or stream)."""


def _conn(url: str, timeout: float) -> tuple[hc.HTTPConnection, str]:
    u = urlsplit(url)
    if u.scheme != "http" or not u.hostname:
        raise BenchError(f"{url!r}: expected http://HOST:PORT")
    return hc.HTTPConnection(u.hostname, u.port or 80, timeout=timeout), u.path.rstrip("/")


def _body(model: str, prompt: str, max_tokens: int, **kw: Any) -> bytes:
    return json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, **kw}
    ).encode()


def served_model(url: str, timeout: float = 10.0) -> str:
    """The first model ``url``'s ``/v1/models`` lists."""
    c, base = _conn(url, timeout)
    try:
        c.request("GET", f"{base}/v1/models")
        r = c.getresponse()
        raw = r.read()
        if r.status != 200:
            raise BenchError(f"{url}/v1/models: HTTP {r.status}: {raw[:200]!r}")
        return str(json.loads(raw)["data"][0]["id"])
    finally:
        c.close()


def complete(url: str, model: str, prompt: str, max_tokens: int, timeout: float, **kw: Any) -> dict[str, Any]:
    """One non-streamed completion's JSON answer."""
    c, base = _conn(url, timeout)
    try:
        c.request("POST", f"{base}/v1/completions", body=_body(model, prompt, max_tokens, **kw), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        raw = r.read()
        if r.status != 200:
            raise BenchError(f"{url}: HTTP {r.status}: {raw[:300]!r}")
        out: dict[str, Any] = json.loads(raw)
        return out
    finally:
        c.close()


def first_token(url: str, model: str, prompt: str, max_tokens: int, timeout: float, **kw: Any) -> float:
    """Seconds from sending a streamed completion to its first token (the stream is read
    to its end, so the server finishes the request)."""
    c, base = _conn(url, timeout)
    t = time.perf_counter()
    first = None
    try:
        c.request(
            "POST", f"{base}/v1/completions", body=_body(model, prompt, max_tokens, stream=True, **kw),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        r = c.getresponse()
        if r.status != 200:
            raise BenchError(f"{url}: HTTP {r.status}: {r.read()[:300]!r}")
        for line in r:
            if first is None and line.startswith(b"data: ") and b'"text"' in line:
                first = time.perf_counter() - t
        if first is None:
            raise BenchError(f"{url}: the stream carried no token")
        return first
    finally:
        c.close()


def handoff(prefill: str, decode: str, model: str, prompt: str, max_tokens: int, timeout: float) -> tuple[float, float]:
    """``(prefill seconds, hand-off seconds)`` of one request routed by hand: see the
    module docs."""
    t = time.perf_counter()
    r = complete(prefill, model, prompt, 1, timeout, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
    t_prefill = time.perf_counter() - t
    params = r.get("kv_transfer_params")
    if not params:
        raise BenchError(f"{prefill} returned no kv_transfer_params (is it a kv_producer?): {str(r)[:300]}")
    return t_prefill, first_token(decode, model, prompt, max_tokens, timeout, kv_transfer_params=params)


def prompts(n: int, words: int, seed: int) -> list[str]:
    """``n`` distinct prompts of ``words`` words (a fresh prefix each: ``seed`` and index lead)."""
    rng = random.Random(seed)
    return [f"[{seed}:{i}] " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(n)]


@dataclass
class Row:
    """One measured row: a set-up at one concurrency, over the rounds."""

    what: str
    concurrency: int
    samples: list[float] = field(default_factory=list)
    round_medians: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        s = sorted(self.samples)
        return {
            "what": self.what,
            "concurrency": self.concurrency,
            "n": len(s),
            "p50_ms": statistics.median(s) * 1e3,
            "p90_ms": s[int(0.9 * (len(s) - 1))] * 1e3,
            "min_ms": s[0] * 1e3,
            "max_ms": s[-1] * 1e3,
            "round_p50_ms": [m * 1e3 for m in self.round_medians],
        }


def _many(fn: Any, items: list[str], concurrency: int) -> list[Any]:
    with cf.ThreadPoolExecutor(concurrency) as ex:
        return list(ex.map(fn, items))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every row the arguments ask for; see the module docs."""
    setups = [(name, url) for name, url in (("one instance", args.single), ("P/D (router)", args.router)) if url]
    any_url = args.router or args.single or args.decode
    model = args.model or served_model(any_url)
    rows: dict[tuple[str, int], Row] = {}
    load_before = os.getloadavg()
    seed = args.seed
    # Warm-up: first requests pay one-off costs (graph capture, connections).
    for _, url in setups:
        _many(lambda p, url=url: first_token(url, model, p, args.max_tokens, args.timeout), prompts(4, args.prompt_words, seed), 4)
    if args.prefill and args.decode:
        handoff(args.prefill, args.decode, model, prompts(1, args.prompt_words, seed + 1)[0], args.max_tokens, args.timeout)
    for r in range(args.rounds):
        for conc in args.concurrency:
            seed += 1
            n = max(conc, args.requests)
            for name, url in setups:
                ps = prompts(n, args.prompt_words, seed * 1000 + len(name))  # fresh prompts per set-up
                t = _many(lambda p, url=url: first_token(url, model, p, args.max_tokens, args.timeout), ps, conc)
                row = rows.setdefault((name, conc), Row(f"TTFT {name}", conc))
                row.samples += t
                row.round_medians.append(statistics.median(t))
            if args.prefill and args.decode:
                ps = prompts(n, args.prompt_words, seed * 1000 + 7)
                got = _many(
                    lambda p: handoff(args.prefill, args.decode, model, p, args.max_tokens, args.timeout), ps, conc
                )
                for label, idx in (("prefill (max_tokens=1)", 0), ("hand-off", 1)):
                    row = rows.setdefault((label, conc), Row(label, conc))
                    vals = [g[idx] for g in got]
                    row.samples += vals
                    row.round_medians.append(statistics.median(vals))
                short = [f"[{seed}:{i}]" for i in range(n)]
                vals = _many(lambda p: first_token(args.decode, model, p, args.max_tokens, args.timeout), short, conc)
                row = rows.setdefault(("decode floor", conc), Row("decode floor (1-word prompt)", conc))
                row.samples += vals
                row.round_medians.append(statistics.median(vals))
    return {
        "model": model,
        "prompt_words": args.prompt_words,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "loadavg_before": list(load_before),
        "loadavg_after": list(os.getloadavg()),
        "rows": [row.summary() for row in rows.values()],
    }


def build_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--router", help="the P/D router's URL (TTFT through P/D)")
    p.add_argument("--single", help="one instance without a connector (the TTFT reference)")
    p.add_argument("--prefill", help="the prefill instance's URL (hand-off, with --decode)")
    p.add_argument("--decode", help="the decode instance's URL (hand-off, with --prefill)")
    p.add_argument("--model", help="the served model's name (default: the first in /v1/models)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="clients at once (default: 1 8 32)")
    p.add_argument("--requests", type=int, default=16, help="requests per row and round, at least the concurrency (default 16)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--prompt-words", type=int, default=120, help="words per prompt (default 120)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (default 16)")
    p.add_argument("--timeout", type=float, default=120.0, help="bound on each request, seconds (default 120)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def print_table(out: dict[str, Any]) -> None:
    print(
        f"model {out['model']}, {out['prompt_words']}-word prompts, {out['max_tokens']} tokens, "
        f"{out['rounds']} rounds; load {out['loadavg_before'][0]:.1f} -> {out['loadavg_after'][0]:.1f}"
    )
    print(f"{'row':<28}{'conc':>5}{'n':>5}{'p50 ms':>9}{'p90 ms':>9}{'min':>8}{'max':>8}   per-round p50")
    for r in out["rows"]:
        rounds = " ".join(f"{m:.0f}" for m in r["round_p50_ms"])
        print(
            f"{r['what']:<28}{r['concurrency']:>5}{r['n']:>5}{r['p50_ms']:>9.1f}{r['p90_ms']:>9.1f}"
            f"{r['min_ms']:>8.1f}{r['max_ms']:>8.1f}   {rounds}"
        )


def main(argv: list[str] | None = None) -> int:
    p = build_parser(
        argparse.ArgumentParser(
            prog="python -m kvferry.integrations.vllm.serve_bench",
            description=(__doc__ or "").split("\n\n")[0].replace("\n", " "),
            epilog="See the module docs (python -c 'import kvferry.integrations.vllm.serve_bench as m; help(m)').",
        )
    )
    args = p.parse_args(argv)
    if not (args.router or args.single) and not (args.prefill and args.decode):
        p.error("give --router and/or --single (TTFT), or --prefill and --decode (hand-off)")
    if bool(args.prefill) != bool(args.decode):
        p.error("--prefill and --decode go together")
    try:
        out = run(args)
    except (BenchError, OSError) as e:
        print(f"serve_bench: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print_table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
