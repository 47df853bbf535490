#!/usr/bin/env bash
# Create ./.venv (if missing) and install pagedexperts with every extra, CPU torch first.
# torch is pinned to the CPU build here so that a fresh machine does not pull a multi-GB
# CUDA build; machines that already have torch (the GPU machines) do not need this script.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[all]"
.venv/bin/python -c "import torch, transformers, pagedexperts; print('pagedexperts', pagedexperts.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
