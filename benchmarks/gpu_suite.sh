#!/usr/bin/env bash
# One command for a machine with one H100 or H200: every CUDA test, both kernels at real sizes, G1-G5 and a two-process
# job, in about 10 minutes; one JSON file under benchmarks/results/ and a table (see benchmarks/gpu_suite.py).
#
#     bash benchmarks/gpu_suite.sh [--budget-s 600] [--only kernels g1g2 ...]
set -euo pipefail
cd "$(dirname "$0")/.."
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
exec python benchmarks/gpu_suite.py "$@"
