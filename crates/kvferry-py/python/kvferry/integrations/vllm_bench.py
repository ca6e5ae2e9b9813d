"""Moved to :mod:`kvferry.integrations.vllm.bench`; this name still runs it
(``python -m kvferry.integrations.vllm_bench``) and imports as it."""

import sys

from .vllm import bench as _bench

if __name__ == "__main__":
    sys.exit(_bench.main())
sys.modules[__name__] = _bench
