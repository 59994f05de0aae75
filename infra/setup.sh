#!/usr/bin/env bash
# Set up the project's virtual environment on a fresh machine (what `make setup` runs).
#
# torch is installed first and pinned: with no torch present, a bare `torch` requirement
# resolves to a multi-GB CUDA build; 2.13.0 is the CPU wheel our machines carry, and the
# project's range (torch>=2.6,<2.15) is then already satisfied.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-dev}

if [ ! -x "$VENV/bin/python" ]; then
  echo "creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==${TORCH_VERSION:-2.13.0}"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[${EXTRAS}]"
# megatron-core (0.16.1: newest for Py3.11); --no-deps so pip never re-resolves the CPU torch. No-op if present.
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps "megatron-core==0.16.1"
"$VENV/bin/python" -c "import relax, torch, flytekit, ray; print(f'relax ready: torch {torch.__version__}, flytekit {flytekit.__version__}, ray {ray.__version__}')"
