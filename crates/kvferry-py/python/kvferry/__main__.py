"""``python -m kvferry``: command-line tools of the Python package.

    python -m kvferry bench [options]   # the transfer benchmark through the Python API
    python -m kvferry plugins [--json]  # will vLLM and SGLang find kvferry's plugins here?
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvferry", description="kvferry's Python command-line tools.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    from . import bench, plugins

    bench.build_parser(
        sub.add_parser(
            "bench",
            prog="python -m kvferry bench",
            help="transfer benchmark through the Python API, compared with the Rust bench",
        )
    )
    plugins.build_parser(
        sub.add_parser(
            "plugins",
            prog="python -m kvferry plugins",
            help="whether vLLM and SGLang find kvferry's plugins in this interpreter (run it with the server's python)",
        )
    )
    args = parser.parse_args(argv)
    if args.command == "bench":
        return bench.run(args)
    if args.command == "plugins":
        return plugins.run(args)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
