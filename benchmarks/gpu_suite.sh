#!/usr/bin/env bash
# A machine with one H100 or H200: every CUDA test, both kernels at real sizes, G1-G5 and a two-process job; one JSON
# file under benchmarks/results/ and a table per call (see benchmarks/gpu_suite.py). All of it takes about 25 minutes;
# each --part fits one 10-minute call.
#
#     bash benchmarks/gpu_suite.sh --part 1|2|3 [--budget-s 570]
#     bash benchmarks/gpu_suite.sh [--only kernels g1 ...]
set -euo pipefail
cd "$(dirname "$0")/.."
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
exec python benchmarks/gpu_suite.py "$@"
