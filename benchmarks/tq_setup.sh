#!/usr/bin/env bash
# Create .venv-tq, a separate venv holding the PyPI package `transferqueue` 0.1.11,
# the baseline that benchmarks/baselines/tq_baseline.py measures Relax's TransferQueue against.
#
# Separate on purpose: the transferqueue wheel installs top-level `tests`, `scripts`,
# `recipe` and `tutorial` packages into site-packages, which would shadow the
# project's own in .venv.
#
# Idempotent: exits 0 at once when .venv-tq already imports transfer_queue 0.1.11.
# torch 2.13.0 goes in first and stays pinned: on these machines it is a local CPU
# wheel, and letting pip pick another torch would pull a multi-GB CUDA build.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TQ_VENV:-$ROOT/.venv-tq}"
PY="${PYTHON:-python3}"
TQ_VERSION="0.1.11"
TORCH_VERSION="2.13.0"

check() {
    "$VENV/bin/python" - "$TQ_VERSION" <<'EOF' >/dev/null 2>&1
import sys
import transfer_queue
sys.exit(transfer_queue.__version__ != sys.argv[1])
EOF
}

if [ -x "$VENV/bin/python" ] && check; then
    echo "tq_setup: $VENV ready (transferqueue $TQ_VERSION)"
    exit 0
fi

echo "tq_setup: creating $VENV" >&2
"$PY" -m venv --clear "$VENV"
"$VENV/bin/pip" install --quiet "torch==$TORCH_VERSION"
# Name torch again so the resolver keeps the CPU build or fails, never swaps it.
"$VENV/bin/pip" install --quiet "transferqueue==$TQ_VERSION" numpy "torch==$TORCH_VERSION"

if ! check; then
    echo "tq_setup: transfer_queue $TQ_VERSION still not importable from $VENV" >&2
    exit 1
fi
echo "tq_setup: $VENV ready (transferqueue $TQ_VERSION)"
