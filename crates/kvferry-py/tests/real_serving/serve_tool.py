"""Commands around the real-serving set-up (run with the CPU-build environment's Python):

    python crates/kvferry-py/tests/real_serving/serve_tool.py ttft [--requests 16] [--config default]
        client TTFT (streamed, first token) p50 / p90 at 1 and 8 concurrent: one
        instance against P/D through vllm-router, the same prompts
    python crates/kvferry-py/tests/real_serving/serve_tool.py soak --requests 2000 [--rounds 3]
        the long fault soak: per round, ``--requests`` completions aborted by their
        clients at random times, the prefill SIGKILLed under load and restarted, the
        decode too, clients gone mid-stream; after each, no block held and tokens
        identical to one instance (exits 1 on a failed check)

Both start a single instance, a prefill, a decode and the router (as the suite does) and
stop them all at the end.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serving_harness as h  # noqa: E402
import tiny_model  # noqa: E402


def _ttft(port: int, prompts: list[str], concurrency: int) -> list[float]:
    with cf.ThreadPoolExecutor(concurrency) as ex:
        return list(ex.map(lambda p: h.stream_ttft(port, p), prompts))


def ttft(args: argparse.Namespace) -> int:
    model = tiny_model.ensure()
    single = h.Server("single")
    cluster = h.Cluster(model)
    try:
        h.start_all(model, single)
        pd = cluster.get(args.config)
        # Warm both paths (first requests pay one-off costs).
        _ttft(single.port, h.prompts(4, seed=1), 4)
        _ttft(pd.router.port, h.prompts(4, seed=2), 4)
        print(f"client TTFT, tiny Llama on vLLM CPU 0.32.0, {args.requests} requests per row (ms)")
        print(f"{'set-up':<22}{'concurrent':>11}{'p50':>9}{'p90':>9}")
        for conc in (1, 8):
            for name, port in (("one instance", single.port), (f"P/D ({args.config})", pd.router.port)):
                ps = h.prompts(args.requests, seed=1000 + conc)
                t = sorted(_ttft(port, ps, conc))
                p50 = statistics.median(t) * 1e3
                p90 = t[int(0.9 * (len(t) - 1))] * 1e3
                print(f"{name:<22}{conc:>11}{p50:>9.1f}{p90:>9.1f}")
        return 0
    finally:
        cluster.stop()
        single.stop()


def soak(args: argparse.Namespace) -> int:
    import test_faults as tf

    model = tiny_model.ensure()
    single = h.Server("single")
    cluster = h.Cluster(model)
    failed = 0
    try:
        h.start_all(model, single)
        pd = cluster.get("default")
        for r in range(args.rounds):
            checks: list[tuple[str, Callable[[], None]]] = [
                ("random client aborts", lambda: tf.test_random_client_aborts(pd, single, requests=args.requests)),
                ("prefill SIGKILLed", lambda: tf.test_prefill_killed_mid_transfer(pd, single)),
                ("decode SIGKILLed", lambda: tf.decode_killed_and_restarted(pd, single)),
                ("clients gone mid-stream", lambda: tf.test_client_disconnects_mid_stream(pd, single)),
            ]
            for name, check in checks:
                t = time.monotonic()
                try:
                    check()
                    print(f"round {r}: {name}: ok ({time.monotonic() - t:.0f} s)")
                except AssertionError as e:
                    failed += 1
                    print(f"round {r}: {name}: FAILED: {e}")
        return 1 if failed else 0
    finally:
        cluster.stop()
        single.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("ttft", help="client TTFT, P/D against one instance")
    a.add_argument("--requests", type=int, default=16)
    a.add_argument("--config", default="default", choices=["default", "tcp-staged"])
    b = sub.add_parser("soak", help="the long fault soak")
    b.add_argument("--requests", type=int, default=2000)
    b.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    why = h.missing()
    if why:
        print(why, file=sys.stderr)
        return 2
    return ttft(args) if args.cmd == "ttft" else soak(args)


if __name__ == "__main__":
    sys.exit(main())
