#!/usr/bin/env bash
# Installs sglang==0.5.23 into the vLLM environment (which has CPU torch, zmq, aiohttp,
# msgspec, requests and kvferry), without sglang's own dependency list (it pins CUDA
# builds of torch, flashinfer, sgl-kernel and exact transformers/xgrammar versions the
# disaggregation path does not need), plus the few pure-Python modules that path
# imports and the vLLM environment lacks (IPython, through sglang/__init__, and gguf).
# Every package already installed keeps its version: the extra ones are installed
# under a constraints file of the environment's versions, and the script fails if any
# version changed. Then checks that vLLM and kvferry's vLLM connector still import.
# Idempotent: an environment that already has sglang 0.5.23 and those modules only
# runs the checks.
#
#   ./scripts/install-sglang.sh                 # $KVFERRY_VLLM_VENV or ~/.cache/kvferry/venv-vllm
#   KVFERRY_SGLANG_VENV=/work/venv ./scripts/install-sglang.sh   # another venv (must import torch)
#
# Then: "$venv/bin/python" -m pytest crates/kvferry-py/tests/with_sglang -q
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv=${KVFERRY_SGLANG_VENV:-${KVFERRY_VLLM_VENV:-$HOME/.cache/kvferry/venv-vllm}}
sglang_version=0.5.23
extra=(ipython gguf)

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f s", b - a }'; }
t_all=$(now)

if [ ! -x "$venv/bin/python" ]; then
    echo "no virtual environment at $venv: run scripts/install-vllm.sh first (sglang needs its torch)" >&2
    exit 1
fi
py="$venv/bin/python"
"$py" -c 'import torch, zmq, aiohttp' 2>/dev/null \
    || { echo "$venv lacks torch, zmq or aiohttp: run scripts/install-vllm.sh first" >&2; exit 1; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$py" -m pip freeze --disable-pip-version-check --exclude-editable > "$tmp/before.txt"
grep -v -e ' @ ' "$tmp/before.txt" > "$tmp/constraints.txt" || true

have=$("$py" -c 'import importlib.metadata as m; print(m.version("sglang"))' 2>/dev/null || true)
echo "== sglang==$sglang_version into $venv (installed: ${have:-none})"
t=$(now)
if [ "$have" != "$sglang_version" ]; then
    "$py" -m pip install -q --disable-pip-version-check --no-deps "sglang==$sglang_version"
    echo "installed in $(since "$t")"
else
    echo "up to date ($(since "$t"))"
fi

echo "== the modules its disaggregation path imports: ${extra[*]}"
t=$(now)
missing=()
"$py" -c 'import IPython' 2>/dev/null || missing+=(ipython)
"$py" -c 'import gguf' 2>/dev/null || missing+=(gguf)
if [ ${#missing[@]} -gt 0 ]; then
    # pip's resolver warns that sglang wants other transformers/xgrammar pins: by
    # design (--no-deps above); the constraints keep every installed version.
    "$py" -m pip install -q --disable-pip-version-check -c "$tmp/constraints.txt" "${missing[@]}" 2>&1 \
        | grep -v -e 'sglang 0.5.23 requires' -e "pip's dependency resolver" || true
    echo "installed ${missing[*]} in $(since "$t")"
else
    echo "present ($(since "$t"))"
fi

echo "== no installed package changed version"
"$py" -m pip freeze --disable-pip-version-check --exclude-editable > "$tmp/after.txt"
changed=$(diff "$tmp/before.txt" "$tmp/after.txt" | grep '^<' || true)
if [ -n "$changed" ]; then
    echo "these packages changed or vanished:" >&2
    echo "$changed" >&2
    exit 1
fi
echo "ok ($(diff "$tmp/before.txt" "$tmp/after.txt" | grep -c '^>' || true) added)"

echo "== check"
t=$(now)
(cd /tmp && HF_HUB_OFFLINE=1 "$py" -W ignore -c '
import importlib.metadata as m
import vllm  # noqa: F401  (the vLLM environment still works)
from kvferry.integrations.vllm import KvferryConnector  # noqa: F401
from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer  # noqa: F401
from sglang.srt.disaggregation.utils import poll_and_all_reduce  # noqa: F401
import kvferry.integrations.sglang as k
v = m.version("sglang")
assert v == k.SGLANG_VERSION, (v, k.SGLANG_VERSION)
print(f"sglang {v}, vllm {vllm.__version__}: kvferry.integrations.sglang and the vLLM connector importable")
' 2>&1 | grep -v -e '^W[0-9]' -e 'FlashInfer' -e 'vllm._C')
echo "checked in $(since "$t")"

echo "== done in $(since "$t_all")"
echo "run: $py -m pytest $root/crates/kvferry-py/tests/with_sglang -q"
