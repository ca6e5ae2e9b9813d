#!/usr/bin/env bash
# Installs lmcache==0.5.6 into the vLLM environment (which has torch), without
# lmcache's own dependency list (it pins CUDA builds of torch and many servers' clients
# LMCache does not import on this path), plus the few modules it does import:
# sortedcontainers, aiofile (with caio) and aiofiles. Then rebuilds kvferry into it.
# Idempotent: an environment that already has lmcache 0.5.6 only rebuilds kvferry.
#
#   ./scripts/install-lmcache.sh                          # $KVFERRY_VLLM_VENV or ~/.cache/kvferry/venv-vllm
#   KVFERRY_LMCACHE_VENV=/work/venv-lmc ./scripts/install-lmcache.sh   # another venv (must import torch)
#   ./scripts/install-lmcache.sh --no-build               # skip rebuilding kvferry
#
# Then: "$venv/bin/python" -m pytest crates/kvferry-py/tests/with_lmcache -q
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv=${KVFERRY_LMCACHE_VENV:-${KVFERRY_VLLM_VENV:-$HOME/.cache/kvferry/venv-vllm}}
lmcache_version=0.5.6
build=1
[ "${1:-}" = "--no-build" ] && build=0

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f s", b - a }'; }
t_all=$(now)

if [ ! -x "$venv/bin/python" ]; then
    echo "no virtual environment at $venv: run scripts/install-vllm.sh first (lmcache needs its torch)" >&2
    exit 1
fi
py="$venv/bin/python"
"$py" -c 'import torch' 2>/dev/null || { echo "$venv has no torch: run scripts/install-vllm.sh first" >&2; exit 1; }

have=$("$py" -c 'import importlib.metadata as m; print(m.version("lmcache"))' 2>/dev/null || true)
echo "== lmcache==$lmcache_version into $venv (installed: ${have:-none})"
t=$(now)
if [ "$have" != "$lmcache_version" ]; then
    "$py" -m pip install -q --disable-pip-version-check --no-deps "lmcache==$lmcache_version"
fi
# redis: only for the benchmark's Redis tier (python -m kvferry.integrations.lmcache.bench),
# which starts Debian's redis-server: installed here as root when missing (the tests
# do not need it).
if ! command -v redis-server >/dev/null 2>&1; then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null \
            || echo "note: apt-get install redis-server failed; the benchmark's Redis tier will be skipped" >&2
    else
        echo "note: redis-server is not installed (sudo apt-get install -y redis-server); only the benchmark's Redis tier needs it" >&2
    fi
fi
"$py" -m pip install -q --disable-pip-version-check sortedcontainers aiofile aiofiles redis numpy pytest "maturin>=1.5,<2"
echo "done in $(since "$t")"

if [ "$build" = 1 ]; then
    echo "== kvferry (maturin develop --release)"
    t=$(now)
    (cd crates/kvferry-py && VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" maturin develop -q --release)
    echo "built in $(since "$t")"
fi

echo "== check"
(cd /tmp && "$py" -c '
import importlib.metadata as m
import kvferry.integrations.lmcache as k
from lmcache.v1.cache_engine import LMCacheEngineBuilder  # noqa: F401  (the engine imports)
v = m.version("lmcache")
assert v == k.LMCACHE_VERSION, (v, k.LMCACHE_VERSION)
print(f"lmcache {v}: kvferry.integrations.lmcache importable")
' 2>&1 | grep -v -e 'LMCache INFO' -e 'LMCache WARNING' -e '^W[0-9]')

echo "== done in $(since "$t_all")"
echo "run: $py -m pytest $root/crates/kvferry-py/tests/with_lmcache -q"
