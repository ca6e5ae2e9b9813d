"""Commands around the real-serving set-up (run with the CPU-build environment's Python):

    python crates/kvferry-py/tests/real_serving/serve_tool.py ttft [--requests 16] [--rounds 5]
            [--concurrency 1 8 32] [--config default|tcp-staged|two-hosts] [--json]
        starts one instance and a P/D set-up, then runs the package's
        ``python -m kvferry.integrations.vllm.serve_bench`` against them: client TTFT
        (one instance against P/D through vllm-router, interleaved rounds) and the
        hand-off (the prefill's answer to the decode's first token)
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
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serving_harness as h  # noqa: E402
import tiny_model  # noqa: E402


def ttft(args: argparse.Namespace) -> int:
    """Starts one instance and a P/D set-up, then runs the package's command
    (``python -m kvferry.integrations.vllm.serve_bench``) against them."""
    from kvferry.integrations.vllm import serve_bench

    model = tiny_model.ensure()
    single = h.Server("single")
    cluster = h.Cluster(model)
    try:
        h.start_all(model, single)
        pd = cluster.get(args.config)
        argv = [
            "--single", single.url, "--router", f"http://127.0.0.1:{pd.router.port}",
            "--prefill", pd.prefill.url, "--decode", pd.decode.url,
            "--concurrency", *map(str, args.concurrency), "--rounds", str(args.rounds),
            "--requests", str(args.requests),
        ] + (["--json"] if args.json else [])  # fmt: skip
        print(f"tiny Llama on vLLM CPU 0.32.0, P/D config {args.config!r}", file=sys.stderr)
        return serve_bench.main(argv)
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
    a = sub.add_parser("ttft", help="client TTFT and hand-off, P/D against one instance (serve_bench)")
    a.add_argument("--requests", type=int, default=16)
    a.add_argument("--rounds", type=int, default=5)
    a.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    a.add_argument("--config", default="default", choices=list(h.CONFIGS))
    a.add_argument("--json", action="store_true")
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
