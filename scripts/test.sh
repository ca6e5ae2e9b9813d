#!/usr/bin/env bash
# All of kvferry's tests, Rust and Python, on a fresh machine with only the Rust
# toolchain and CPython >= 3.11: creates a virtual environment (.venv, or
# $KVFERRY_VENV), installs maturin, pytest and numpy into it, builds the Python
# package from source, then runs `cargo test --workspace` and pytest.
#
#   ./scripts/test.sh                 # everything
#   ./scripts/test.sh -- --nocapture  # extra arguments go to cargo test
#   KVFERRY_PYTEST_ARGS="-k readme" ./scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv=${KVFERRY_VENV:-$root/.venv}

echo "== python environment ($venv)"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check "maturin>=1.5,<2" "pytest>=7" "numpy>=1.24"

echo "== etcd and protoc (the etcd peer directory's build and tests)"
"$root/scripts/install-directory-deps.sh"

echo "== rust tests"
cargo test --workspace "$@"

echo "== python package (maturin develop)"
(cd crates/kvferry-py && VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" maturin develop -q)

echo "== python tests"
# shellcheck disable=SC2086
"$venv/bin/python" -m pytest crates/kvferry-py/tests -q ${KVFERRY_PYTEST_ARGS:-}
