#!/usr/bin/env bash
# Installs the system tools kvferry's tests use, where they are missing:
#   etcd  (Debian's etcd-server)  the etcd peer directory's tests start it on loopback
#   nft   (nftables)              the tests across network namespaces cut links with it
#   ip    (iproute2)              those tests build their hosts with it
# Building needs none of them: `protoc` comes from the system or the
# protoc-bin-vendored crate (scripts/protoc, .cargo/config.toml).
#
# As root it installs what is missing with apt-get. Without root it says what to
# install and carries on: the tests that need a missing tool then skip with a message
# naming it. Under CI=true a tool it cannot install is a failure (exit 1), because there
# a skipped test is a failed one.
#
#   ./scripts/install-test-deps.sh        # called by scripts/test.sh and .ci/run
set -euo pipefail
missing=()
for tool in etcd:etcd-server nft:nftables ip:iproute2; do
    command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool#*:}")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "note: ${missing[*]} not installed, so the tests that need them will skip with a message;" \
        "to run them: sudo apt-get install -y ${missing[*]}" >&2
    [ "${CI:-}" = "true" ] && { echo "error: CI=true needs ${missing[*]}" >&2; exit 1; }
    exit 0
fi
echo "== installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
apt-get install -y -q "${missing[@]}" >/dev/null
for tool in etcd nft ip; do
    command -v "$tool" >/dev/null 2>&1 || { echo "error: $tool still missing after apt-get install" >&2; exit 1; }
done
