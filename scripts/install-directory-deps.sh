#!/usr/bin/env bash
# Installs `etcd` (Debian's etcd-server), which the etcd peer directory's tests start on
# loopback ports, when it is missing. Building needs nothing extra: `protoc` comes from
# the system or the protoc-bin-vendored crate (scripts/protoc, .cargo/config.toml).
# Without root it says what to install and carries on (those tests then skip with a
# message), except under CI=true, where a missing etcd is a failure.
set -euo pipefail
command -v etcd >/dev/null 2>&1 && exit 0
if [ "$(id -u)" -ne 0 ]; then
    echo "note: etcd is not installed, so the etcd directory tests will skip; to run them: sudo apt-get install -y etcd-server" >&2
    [ "${CI:-}" = "true" ] && exit 1
    exit 0
fi
echo "== installing etcd-server"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
apt-get install -y -q etcd-server >/dev/null
