#!/usr/bin/env bash
# `make gpu-check`: proves pdserve's GPU path on one NVIDIA GPU in at most 7 minutes, offline
# (bench/gpu_check.py says what each step proves; results go to $OUT, else
# bench/results/gpu_check/, and the summary to bench/results/gpu_check.md).
# It needs the wheels `make gpu-wheels` puts in .gpu-wheels/ for what the machine lacks
# (pyzmq, fastapi, uvicorn, pydantic, llguidance). Without a GPU it says so and exits 0.
set -u
cd "$(dirname "$0")/.." || exit 1
PYTHON=${GPU_CHECK_PYTHON:-python3}
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q GPU; then
    echo "gpu-check: no NVIDIA GPU is present on this machine (nvidia-smi lists none);" \
        "nothing was run."
    exit 0
fi
exec "$PYTHON" bench/gpu_check.py "$@"
