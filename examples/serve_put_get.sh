#!/usr/bin/env bash
# The quickstart's first transfer, self-contained: starts `kvferry serve` with a fresh
# secret on a free loopback port, puts a chunk, gets it back, compares the bytes, stops
# the server. Uses `kvferry` from PATH, or builds it (release) when absent.
#
#   ./examples/serve_put_get.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v kvferry >/dev/null 2>&1; then
    kvferry=kvferry
else
    cargo build --release -q -p kvferry-cli
    kvferry=$PWD/target/release/kvferry
fi
work=$(mktemp -d)
trap 'kill "$server" 2>/dev/null || true; rm -rf "$work"' EXIT

openssl rand -hex 32 > "$work/secret" 2>/dev/null || head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$work/secret"
chmod 600 "$work/secret"

# Port 0: the kernel picks a free port; `serve` prints the address on its first line.
"$kvferry" serve --listen 127.0.0.1:0 --secret-file "$work/secret" --model tiny \
    --arena 16MiB --page-size 256KiB > "$work/serve.out" 2> "$work/serve.log" &
server=$!
for _ in $(seq 100); do
    grep -q "listening on" "$work/serve.out" 2>/dev/null && break
    sleep 0.1
done
addr=$(sed -n 's/^kvferry serve: listening on \([^ ]*\).*/\1/p' "$work/serve.out")
[ -n "$addr" ] || { echo "serve did not start:"; cat "$work/serve.log"; exit 1; }
echo "serve is listening on $addr"

head -c 32768 /dev/urandom > "$work/chunk.bin"     # 16 blocks of the tiny model
"$kvferry" put --peer "$addr" --secret-file "$work/secret" --key my-prefix --file "$work/chunk.bin"
"$kvferry" get --peer "$addr" --secret-file "$work/secret" --key my-prefix --model tiny --out "$work/landed.bin"
cmp "$work/chunk.bin" "$work/landed.bin"
echo "serve_put_get: the landed bytes are identical"
