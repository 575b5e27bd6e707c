#!/usr/bin/env bash
# The test suite against one PyTorch release, in a scratch virtual environment of its own:
#
#     bash .ci/torch_version.sh 2.15.0 [pytest arguments...]
#
# The environment is .venv-torch<version>/ (git-ignored) and is reused by the next run. PyPI's CUDA wheels run on a
# CPU-only machine (the download is several GB). Use it before raising the upper bound of torch in setup.py.
set -euo pipefail
version=${1:?usage: bash .ci/torch_version.sh <torch version> [pytest arguments...]}
shift
cd "$(dirname "$0")/.."
env_dir=".venv-torch$version"
[ -d "$env_dir" ] || python3 -m venv "$env_dir"
source "$env_dir/bin/activate"
export OMP_NUM_THREADS=1
# Some machines cap torch through a constraints file in their pip config; this environment asks for one exact release
# instead, so it reads no pip config file (PIP_* variables still apply).
export PIP_CONFIG_FILE=/dev/null
pip install -q "torch==$version"
pip install -q -e ".[test]" "torch==$version"
python -c "import torch; print('torch', torch.__version__)"
python -m pytest -q "$@"
