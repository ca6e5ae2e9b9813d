#!/usr/bin/env bash
# All of kvferry's tests, Rust and Python, on a fresh machine with only the Rust
# toolchain and CPython >= 3.11: creates a virtual environment (.venv, or
# $KVFERRY_VENV), installs maturin, pytest, numpy and mypy into it, builds the Python
# package from source, installs the system tools some tests use (etcd, nftables,
# iproute2; as root with apt-get, otherwise those tests skip with a message, and under
# CI=true a missing tool is a failure), then runs `cargo test --workspace` and pytest.
#
# Tests build with the release profile, like the README's first command
# (`cargo run --release -- bench`), so the two commands compile the workspace once, not
# twice; kvferry's own debug assertions stay on in that profile (Cargo.toml).
# KVFERRY_TEST_PROFILE=dev runs them in the dev profile instead.
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
"$venv/bin/python" -m pip install -q --disable-pip-version-check "maturin>=1.5,<2" "pytest>=7" "numpy>=1.24" "mypy>=1.10"

profile_flag=--release
[ "${KVFERRY_TEST_PROFILE:-release}" = "dev" ] && profile_flag=

echo "== system tools the tests use (etcd, nftables, iproute2)"
"$root/scripts/install-test-deps.sh"

echo "== rust tests"
cargo test --workspace $profile_flag "$@"

echo "== python package (maturin develop $profile_flag)"
(cd crates/kvferry-py && VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" maturin develop -q $profile_flag)

echo "== python types: the stubs against the built module (stubtest); mypy --strict on the package core and on its core tests (tests/*.py, not tests/vllm/ nor tests/with_lmcache/) and the real-serving suite's"
(cd crates/kvferry-py/python && "$venv/bin/python" -m mypy.stubtest kvferry._kvferry \
    && "$venv/bin/python" -m mypy --strict kvferry --exclude 'kvferry/integrations/')
(cd crates/kvferry-py && MYPYPATH=python "$venv/bin/python" -m mypy --strict tests --exclude 'tests/(vllm|with_lmcache|real_serving)/')
# The real-serving suite on its own (its conftest.py would be a second module "conftest").
(cd crates/kvferry-py/tests/real_serving && MYPYPATH=../../python "$venv/bin/python" -m mypy --strict .)

echo "== python tests"
# shellcheck disable=SC2086
"$venv/bin/python" -m pytest crates/kvferry-py/tests -q ${KVFERRY_PYTEST_ARGS:-}
