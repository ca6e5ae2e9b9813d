#!/usr/bin/env bash
# Installs what the etcd peer directory needs when it is missing: `protoc` (to build
# the etcd client) and `etcd` (started by the tests on loopback ports), from Debian's
# packages. Needs root; otherwise says what to install and fails.
set -euo pipefail
missing=()
command -v protoc >/dev/null 2>&1 || missing+=(protobuf-compiler)
command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
    echo "error: missing ${missing[*]}: install them (sudo apt-get install -y ${missing[*]})" >&2
    exit 1
fi
echo "== installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
apt-get install -y -q "${missing[@]}" >/dev/null
