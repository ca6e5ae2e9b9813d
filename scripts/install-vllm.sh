#!/usr/bin/env bash
# Creates (or updates) the cached virtual environment for kvferry's vLLM integration:
# vllm==0.33.0 (with torch, about 9.5 GB, a few minutes) and kvferry built from this
# checkout, then prints how long each phase took and the environment's size.
# Idempotent: an environment that already has vllm 0.33.0 only rebuilds kvferry.
#
#   ./scripts/install-vllm.sh                     # $KVFERRY_VLLM_VENV or ~/.cache/kvferry/venv-vllm
#   KVFERRY_VLLM_VENV=~/venvs/vllm ./scripts/install-vllm.sh
#   ./scripts/install-vllm.sh --force             # reinstall vllm's packages too
#
# Then: "$KVFERRY_VLLM_VENV/bin/python" -m pytest crates/kvferry-py/tests/vllm -q
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv=${KVFERRY_VLLM_VENV:-$HOME/.cache/kvferry/venv-vllm}
mkdir -p "$(dirname "$venv")"
vllm_version=0.33.0
force=0
[ "${1:-}" = "--force" ] && force=1

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f s", b - a }'; }
t_all=$(now)

echo "== virtual environment ($venv)"
t=$(now)
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    echo "created in $(since "$t")"
else
    echo "exists"
fi

have=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null || true)
echo "== vllm==$vllm_version (installed: ${have:-none})"
t=$(now)
if [ "$have" != "$vllm_version" ] || [ "$force" = 1 ]; then
    # PyPI's wheel; VLLM_TARGET_DEVICE only matters if pip ever falls back to a source build.
    VLLM_TARGET_DEVICE=cpu "$venv/bin/python" -m pip install -q --disable-pip-version-check \
        "vllm==$vllm_version" numpy pytest hypothesis "maturin>=1.5,<2"
    echo "installed in $(since "$t")"
else
    "$venv/bin/python" -m pip install -q --disable-pip-version-check numpy pytest hypothesis "maturin>=1.5,<2"
    echo "up to date ($(since "$t"))"
fi

echo "== kvferry (maturin develop --release, as scripts/test.sh builds it)"
t=$(now)
(cd crates/kvferry-py && VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" maturin develop -q --release)
echo "built in $(since "$t")"

echo "== check"
(cd /tmp && HF_HUB_OFFLINE=1 "$venv/bin/python" -c '
import kvferry, vllm
from kvferry.integrations.vllm import KvferryConnector, VLLM_VERSION
assert vllm.__version__ == VLLM_VERSION, (vllm.__version__, VLLM_VERSION)
print(f"kvferry {kvferry.__version__} from {kvferry.__file__}, vllm {vllm.__version__}: KvferryConnector importable")
' 2>&1 | grep -v -e '^W[0-9]' -e 'FlashInfer' -e 'vllm._C')

echo "== done in $(since "$t_all"); $(du -sh "$(readlink -f "$venv")" | cut -f1) in $venv"
echo "run: $venv/bin/python -m pytest $root/crates/kvferry-py/tests/vllm -q"
