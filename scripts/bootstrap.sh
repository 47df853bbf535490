#!/usr/bin/env bash
# Create ./.venv (if missing) and install pagedexperts with every extra, CPU torch first.
# torch is pinned to the CPU build here so that a fresh machine does not pull a multi-GB
# CUDA build; machines that already have torch (the GPU machines) do not need this script.
#
# A second run with nothing to do returns at once: the install leaves a stamp (a hash of
# pyproject.toml and this script, with the installed pagedexperts version and source
# directory) in .venv, and a run whose stamp still matches installs nothing.
# `bash scripts/bootstrap.sh --force` (or BOOTSTRAP_FORCE=1) reinstalls anyway.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAMP=.venv/.bootstrap-stamp
FORCE=${BOOTSTRAP_FORCE:-0}
case "${1:-}" in
  --force) FORCE=1 ;;
  "") ;;
  *) echo "bootstrap.sh: unknown argument '$1' (only --force: reinstall even when up to date)" >&2; exit 2 ;;
esac

# What the stamp records: the inputs of the install and what it installed (no torch import: fast).
stamp() {
  { sha256sum pyproject.toml scripts/bootstrap.sh
    .venv/bin/python - <<'EOF'
import importlib.metadata as md, importlib.util, os
spec = importlib.util.find_spec("pagedexperts")
print("pagedexperts", md.version("pagedexperts"), os.path.dirname(os.path.dirname(spec.origin)) if spec else None)
EOF
  } 2>/dev/null
}
versions() {
  .venv/bin/python -c "import importlib.metadata as md; print(*(f'{n} {md.version(n)}' for n in ('pagedexperts', 'torch', 'transformers')))"
}

if [ "$FORCE" != 1 ] && [ -f "$STAMP" ] && [ "$(stamp)" = "$(cat "$STAMP")" ]; then
  echo "bootstrap: .venv up to date ($(versions)); nothing installed (--force reinstalls)"
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
rm -f "$STAMP"
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# torch's CPU build. On Linux, PyPI's torch wheel is the CUDA build (several GB with its nvidia-*
# packages); PyTorch's own CPU index serves the CPU build, so it is used where it resolves. Where
# it does not (a machine whose pip is configured with its own mirror or wheel directory, as CI's),
# pip's configured sources are used as they are. PAGEDEXPERTS_TORCH_INDEX=URL chooses an index
# (empty: pip's configured sources).
TORCH_INDEX=${PAGEDEXPERTS_TORCH_INDEX-auto}
if [ "$TORCH_INDEX" = auto ]; then
  TORCH_INDEX=""
  if [ "$(uname -s)" = Linux ] && .venv/bin/python -c "import socket; socket.getaddrinfo('download.pytorch.org', 443)" 2>/dev/null; then
    TORCH_INDEX=https://download.pytorch.org/whl/cpu
  fi
fi
.venv/bin/python -m pip install -q "torch==2.13.0" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
.venv/bin/python -m pip install -q -e ".[all]"
.venv/bin/python -c "import torch, transformers, pagedexperts; print('pagedexperts', pagedexperts.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
stamp > "$STAMP"
