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
EXTRAS=${EXTRAS:-dev,trackers}  # trackers: MLflow and W&B, which the tracker tests run for real

if [ ! -x "$VENV/bin/python" ]; then
  echo "creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==${TORCH_VERSION:-2.13.0}"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[${EXTRAS}]"
# megatron-core (0.16.1: newest for Py3.11); --no-deps so pip never re-resolves the CPU torch. No-op if present.
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps "megatron-core==0.16.1"
# SGLang's server-flag parser, for the test that checks the flags Relax launches SGLang with against
# SGLang's own ServerArgs (tests/relax/engines/sglang): its wheel and what its parser imports, in a folder
# of their own that nothing else imports (SGLang itself needs a GPU). No-op if present.
SGLANG_PARSER="$VENV/sglang-parser"
if [ ! -d "$SGLANG_PARSER/sglang" ]; then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --target "$SGLANG_PARSER" \
    sglang==0.5.23 msgspec==0.23.0 pybase64==1.5.1 pyzmq==27.3.0 psutil==7.2.2 ipython==9.18.1 traitlets==5.16.1
fi
"$VENV/bin/python" -c "import relax, torch, flytekit, ray; print(f'relax ready: torch {torch.__version__}, flytekit {flytekit.__version__}, ray {ray.__version__}')"
