#!/usr/bin/env bash
# Create or reuse ./.venv and install zerodp into it. A torch >= 2.6 that is already
# importable is used as is; otherwise torch==2.13.0 is installed (the CPU build on
# machines that carry it; a bare `pip install torch` would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv --system-site-packages "$VENV"
fi
if ! "$VENV/bin/python" - <<'PYEOF' 2>/dev/null
import torch
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
raise SystemExit(0 if (major, minor) >= (2, 6) else 1)
PYEOF
then
  TORCH="torch==2.13.0"  # installed in the same resolve as the rest: one pip run, not two
fi
"$VENV/bin/pip" install --quiet --disable-pip-version-check ${TORCH:+"$TORCH"} -e ".[test,plot]"
