#!/usr/bin/env bash
# One run on a machine with an NVIDIA GPU verifies the CUDA backend: every CUDA test
# (the device layer, and GPU -> peer -> GPU through the engine over loopback, every byte
# compared; CUDA IPC between two processes of one GPU), the device benchmark (pinned D2H/H2D GB/s beside the plain host-memory
# copy), and the end-to-end GB/s. Needs only the Rust toolchain and the NVIDIA driver
# (the CUDA backend loads libcuda dynamically; no toolkit). Takes well under 8 minutes.
# The Python CUDA tests (crates/kvferry-py/tests/test_cuda.py) also need CPython with
# torch (CUDA) — $KVFERRY_GPU_PYTHON or python3, whose packages a venv under
# target/gpu-check-venv sees — and say why they skip without it.
# The vLLM connector's worker halves over torch CUDA tensors (two cuda:0 engines on
# one GPU: publish -> pull -> every byte compared on the GPU; scripts/
# gpu_connector_check.py) also need vLLM 0.33.0: the venv of scripts/install-vllm.sh
# ($KVFERRY_VLLM_VENV, default ~/.cache/kvferry/venv-vllm) is added behind that venv's
# own packages; without it, or without a CUDA device, the check says why it skips.
#
#   scripts/gpu-check.sh            # results also go to $OUT (default: target/gpu-check)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-target/gpu-check}
mkdir -p "$out"
start=$(date +%s)
{
    echo "== machine"; date -u; nproc; (nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "nvidia-smi: not found")
    echo "== build (release, --features cuda)"
    cargo build --release -q --features cuda -p kvferry-cli
    cargo test --release -q --features kvferry/cuda -p kvferry --test device_cuda --test engine_cuda --no-run
    echo "== CUDA tests"
    cargo test --release --features kvferry/cuda -p kvferry --test device_cuda --test engine_cuda -- --nocapture --test-threads 1
    echo "== CUDA IPC: two processes, one GPU, device-to-device, bytes compared (never run on a GPU before)"
    if nvidia-smi -L >/dev/null 2>&1; then
        KVFERRY_CUDA_IPC=1 cargo test --release --features kvferry/cuda -p kvferry --test p2p_cuda_ipc -- --nocapture --test-threads 1 \
            || echo "FAILED: the CUDA IPC case (the consumer then falls back; see docs/architecture.md, Movers)"
    else
        echo "skipped: no NVIDIA GPU on this machine (nvidia-smi -L finds none)"
    fi
    echo "== device benchmark (host, sim and CUDA rows)"
    ./target/release/kvferry bench device
    ./target/release/kvferry bench device --json > "$out/bench-device.json"
    echo "== end-to-end host benchmark on this machine (direct path)"
    ./target/release/kvferry bench --bytes 4GiB --json > "$out/bench-direct.json"
    echo "== python CUDA tests (torch CUDA tensors through Engine(device='cuda:0'))"
    py=${KVFERRY_GPU_PYTHON:-python3}
    venv=$PWD/target/gpu-check-venv
    if "$py" -m venv --system-site-packages "$venv" &&
        "$venv/bin/python" -m pip install -q --disable-pip-version-check "maturin>=1.5,<2" pytest numpy; then
        (cd crates/kvferry-py && VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" maturin develop -q --release --features cuda)
        "$venv/bin/python" -m pytest crates/kvferry-py/tests/test_cuda.py -q -rs
        echo "== bounded_wait on real CUDA events (a 2 s kernel; a stream gated on a host flag, 1 s deadline)"
        "$venv/bin/python" -m pytest crates/kvferry-py/tests/test_bounded_wait.py -q -rs
        echo "== bounded_wait benchmark (query(), CompletionEvent and cuda kinds)"
        "$venv/bin/python" -m kvferry.bench_bounded_wait --samples 200
        echo "== vLLM connector worker halves over torch CUDA tensors (two cuda:0 engines, bytes verified)"
        vllm_venv=${KVFERRY_VLLM_VENV:-$HOME/.cache/kvferry/venv-vllm}
        vllm_site=$("$vllm_venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null || true)
        if [ -n "$vllm_site" ] && [ -d "$vllm_site/vllm" ]; then
            site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
            echo "$vllm_site" > "$site/zz-kvferry-vllm.pth"   # after this venv's own packages (its CUDA kvferry wins)
            HF_HUB_OFFLINE=1 "$venv/bin/python" scripts/gpu_connector_check.py --device cuda | tee "$out/connector-cuda.json"
        else
            echo "skipped: no vLLM 0.33.0 environment at $vllm_venv (scripts/install-vllm.sh makes one)"
        fi
    else
        echo "skipped: no Python environment with maturin, pytest and numpy (offline?)"
    fi
    echo "== done in $(( $(date +%s) - start )) s"
} 2>&1 | tee "$out/gpu-check.log"
