#!/usr/bin/env bash
# Checks the NVML path of torpor-gpu on a machine with an NVIDIA GPU and driver: inventory,
# MIG placements read from NVML against the MIG-GEOMETRY table (for GPUs with MIG enabled),
# and DCGM-named metrics. One command, a few minutes at most (mostly the build).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v nvidia-smi >/dev/null && nvidia-smi -L || echo "nvidia-smi not found; NVML may still load"
timeout 600 cargo test --features nvml --test nvml_device -- --include-ignored --nocapture
