#!/usr/bin/env bash
# One call on a bare GPU machine (one H100 or H200, no network): installs the wheels that benchmarks/gpu_wheels.sh put
# in .whl/ (the call names .whl in `carry`), prints the versions it found, and runs benchmarks/gpu_suite.py, which
# builds the models once and runs every step under its own limit, writing its JSON after each (docs/benchmarks.md).
#
#     bash benchmarks/gpu_suite.sh --out "$OUT"            # 8 to 9.5 minutes; --budget-s 550 by default (timeout_s 600)
#     bash benchmarks/gpu_suite.sh --only g2_static --out "$OUT"
#     bash benchmarks/gpu_suite.sh --smoke --out /tmp/s    # tiny sizes, CPU: checks the suite (tests do this cold)
#
# SPMD_WHEELS (default .whl) is where the wheels are, SPMD_SITE (default /tmp/spmd_site) where they are installed; with no
# wheels there, the packages already importable are used.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
SITE=${SPMD_SITE:-/tmp/spmd_site}
WHEELS=${SPMD_WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    # Compiled once here (pip's default): every step is a fresh interpreter, and where PYTHONDONTWRITEBYTECODE is set
    # each would compile the package and TRL's modules again (half a second to a second of CPU per step).
    "$PYTHON" -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --disable-pip-version-check \
        --target "$SITE" "$WHEELS"/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$PYTHON" benchmarks/gpu_suite.py "$@"
