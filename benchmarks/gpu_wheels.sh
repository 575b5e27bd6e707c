#!/usr/bin/env bash
# Run here (with network to the package registry), before a GPU call: fills .whl/ (ignored by git) with every wheel that
# benchmarks/gpu_suite.sh needs and the GPU image lacks, for the image's Python (3.12, x86-64, manylinux), and the
# package itself as a wheel. The image holds torch, triton, transformers, peft, safetensors, pyarrow, numpy, pyyaml,
# accelerate, pandas, xxhash and pytest (see docs/benchmarks.md); it lacks omegaconf (2.4 needs only PyYAML: no
# antlr4 wheel to build) and TRL's baseline needs trl, datasets, dill and multiprocess.
#
#     bash benchmarks/gpu_wheels.sh [DEST]      # default .whl; prints the total, which must stay under 64 MiB
#
# WHEELS_PYTHON (default 3.12, the image's) is the Python version the wheels are for; the cold-start test
# (tests/benchmarks/test_gpu_benchmarks.py) builds them for this machine's.
#
# The GPU call then names .whl in `carry` and runs `bash benchmarks/gpu_suite.sh`, which installs them offline.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
PYTHON=${PYTHON:-python3}
WHEELS_PYTHON=${WHEELS_PYTHON:-3.12}
# The versions the CPU suite runs against (setup.py's test extra), one of each: two versions stop the install there.
WHEELS=(omegaconf==2.4.0 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19)
PLATFORMS=()
for platform in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
    manylinux1_x86_64; do
    PLATFORMS+=(--platform "$platform")
done
rm -rf "$DEST"
mkdir -p "$DEST"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$WHEELS_PYTHON" --implementation cp \
    "${PLATFORMS[@]}" -d "$DEST" "${WHEELS[@]}"
# The package: pure Python, so the wheel built here installs there (setup.py maps recipes/ and kernels/ into it). It is
# built from a copy, so that the tree gets no build/ or egg-info (and a test can build it beside a running suite).
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cp -r setup.py README.md src kernels recipes "$scratch"/
find "$scratch" -name __pycache__ -prune -exec rm -rf {} +
"$PYTHON" -m pip wheel -q --no-deps -w "$DEST" "$scratch"
ls -l "$DEST"
total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
echo "total $((total / 1024)) KiB in $DEST (at most 64 MiB travel with the working tree)"
if [ "$total" -gt $((60 * 1024 * 1024)) ]; then
    echo "error: $DEST holds more than 60 MiB; the working tree must travel within 64 MiB" >&2
    exit 1
fi
