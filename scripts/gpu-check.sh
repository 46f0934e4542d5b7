#!/usr/bin/env bash
# The NVML path, on a machine with an NVIDIA GPU and driver (one command, a few minutes):
#   1. the ignored NVML test: inventory from NVML, MIG placements read from NVML equal to the
#      table (for GPUs in MIG mode), DCGM-named metrics from samples;
#   2. `torpor gpu ls` through the binary: the NVML inventory, as many GPUs as nvidia-smi lists;
#   3. when runsc is installed and this runs as root: `torpor up` on a free port, /metrics has
#      the allocation families and DCGM_FI_DEV_FB_USED for GPU 0; then it is stopped by PID;
#   4. as root: MIG instances created and destroyed through NVML (or nvml_mig_mode_off where
#      MIG mode is off) (ignored test; step 1 also ran the XID watch and GPM tensor test);
#   5. when runsc has --nvproxy and cuda-checkpoint is installed: a CUDA context survives
#      park and wake (cuda-checkpoint toggled inside the sandbox); skipped otherwise.
# No GPU here: CI runs the rest of the suite; this script is for GPU machines.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null; then
    echo "gpu-check: nvidia-smi not found; this script needs an NVIDIA driver" >&2
    exit 1
fi
nvidia-smi -L
smi_gpus=$(nvidia-smi -L | grep -c '^GPU ' || true)

echo "== 1. NVML inventory, MIG placements vs the table, DCGM metrics, XID watch, tensor activity (ignored tests)"
cargo test -p torpor-gpu --features nvml --test nvml_device -- --include-ignored --nocapture \
    --skip nvml_mig_instances_are_created_and_destroyed

echo "== 2. torpor gpu ls (NVML)"
cargo build -q -p torpor
bin=target/debug/torpor
"$bin" gpu ls
tmp=$(mktemp -d)
daemon_pid=""
cleanup() {
    if [ -n "$daemon_pid" ]; then kill "$daemon_pid" 2>/dev/null || true; wait "$daemon_pid" 2>/dev/null || true; fi
    rm -rf -- "$tmp"
}
trap cleanup EXIT
"$bin" gpu ls --json > "$tmp/ls.json"
grep -q '"source": "nvml"' "$tmp/ls.json" || { echo "gpu ls did not use NVML" >&2; exit 1; }
torpor_gpus=$(grep -c '"uuid"' "$tmp/ls.json" || true)
if [ "$torpor_gpus" != "$smi_gpus" ]; then
    echo "gpu-check: torpor sees $torpor_gpus GPUs, nvidia-smi $smi_gpus" >&2
    exit 1
fi
if nvidia-smi mig -lgipp >/dev/null 2>&1; then
    echo "-- nvidia-smi mig -lgipp (for the record; the test compared NVML with the table)"
    nvidia-smi mig -lgipp || true
fi

echo "== 3. daemon /metrics"
if [ "$(id -u)" = 0 ] && command -v runsc >/dev/null; then
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    "$bin" up --listen "127.0.0.1:$port" --data-dir "$tmp/data" --workers 2 >"$tmp/up.log" 2>&1 &
    daemon_pid=$!
    for _ in $(seq 1 600); do
        curl -fs "http://127.0.0.1:$port/healthz" >/dev/null 2>&1 && break
        sleep 0.2
    done
    curl -fs -H "Authorization: Bearer $(cat "$tmp/data/admin-token")" "http://127.0.0.1:$port/metrics" > "$tmp/metrics.txt"
    grep -E '^torpor_gpu_(shares|free)\{' "$tmp/metrics.txt" | head -5
    grep -E '^DCGM_FI_DEV_FB_USED\{gpu="0"' "$tmp/metrics.txt" \
        || { echo "no DCGM metrics on /metrics" >&2; tail -20 "$tmp/up.log" >&2; exit 1; }
else
    echo "skipped: needs root and runsc"
fi
echo "== 4. NVML MIG create/destroy (ignored test), XID and tensor families on /metrics"
if [ "$(id -u)" = 0 ]; then
    cargo test -p torpor-gpu --features nvml --test nvml_device -- --ignored --nocapture \
        nvml_mig_instances_are_created_and_destroyed
else
    echo "skipped: MIG instance creation needs root"
fi
grep -E '^DCGM_FI_(DEV_XID_ERRORS|PROF_PIPE_TENSOR_ACTIVE)\{' "$tmp/metrics.txt" 2>/dev/null | head -4 || true

echo "== 5. cuda-checkpoint around park and wake"
if [ "$(id -u)" = 0 ] && runsc flags 2>&1 | grep -qE '^ +-nvproxy( |$)' \
    && { command -v cuda-checkpoint >/dev/null || [ -n "${TORPOR_CUDA_CHECKPOINT:-}" ]; }; then
    cargo test -p torpor --test gpu_hardware -- --ignored --nocapture
else
    echo "skipped: needs root, runsc with --nvproxy and cuda-checkpoint"
fi
echo "gpu-check: OK"
