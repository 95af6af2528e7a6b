#!/usr/bin/env bash
# The fused-head Triton suite: rlcore-fused's Triton kernels run on CPU by Triton's interpreter
# (TRITON_INTERPRET=1, small shapes), in their own venv, .venvs/fused-triton, because a CPU Triton
# is a ~650 MB install the main venv does without. The main venv tests the plugin's torch path;
# the kernels' real (compiled, timed) runs are on the GPU machine: see docs/benchmarks/fused.md.
#
# The venv: torch==2.13.0 (the CPU build from the machine's find-links) with numpy<2.4 (Triton
# 3.6's interpreter converts one-element arrays with int(), which numpy 2.4 refuses) first, then
# Triton 3.6.0 (the version of the GPU machine's image), then rlcore, rlcore-fused and rlcore-algorithms
# (CISPO, one of the losses the kernels are checked with) editable.
# From scratch on a 2-core machine: about 2 minutes of setup, 1.5 minutes of tests.
# Idempotent: a stamp of the inputs' hash makes an unchanged venv cost a second.
# Usage: bash scripts/suites/fused-triton.sh [pytest args...]   (default: the interpreter tests)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${RLCORE_FUSED_TRITON_VENV:-$ROOT/.venvs/fused-triton}"
cd "$ROOT"
source scripts/lib/cpu_venv.sh

TRITON_VERSION=3.6.0
inputs=(scripts/suites/fused-triton.sh scripts/lib/cpu_venv.sh scripts/constraints.txt core/pyproject.toml
        plugins/fused/pyproject.toml plugins/algorithms/pyproject.toml)
hash="$(venv_inputs_hash "${inputs[@]}")"

if venv_is_current "$VENV" "$hash"; then
  echo "[fused-triton] reusing $VENV"
else
  t0=$(date +%s)
  echo "[fused-triton] preparing $VENV (first run: about a minute, ~1.5 GB)" >&2
  venv_create_cpu_torch "$VENV" "setuptools>=68" "numpy<2.4"
  "${PIP[@]}" "triton==$TRITON_VERSION"
  "${PIP[@]}" --no-build-isolation -e core -e plugins/fused -e plugins/algorithms "pytest>=8" "hypothesis>=6.100"
  "$VENV/bin/python" - <<'PYEOF'
import torch, triton, rlcore, rlcore_fused
print(f"[fused-triton] torch {torch.__version__}, triton {triton.__version__}, rlcore {rlcore.__version__}, rlcore-fused {rlcore_fused.__version__}")
PYEOF
  venv_stamp "$VENV" "$hash"
  echo "[fused-triton] $VENV ready in $(( $(date +%s) - t0 ))s" >&2
fi

# TRITON_INTERPRET must be set before triton is imported: it decides at @triton.jit time.
export TRITON_INTERPRET=1
# the suite's tests unless an argument names a test path (`-k expr` alone would collect the whole checkout)
has_path=0; for a in "$@"; do [ -e "${a%%::*}" ] && has_path=1; done
[ "$has_path" = 1 ] || set -- plugins/fused/tests/test_triton_interpreter.py "$@"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider -W "ignore::DeprecationWarning" "$@"
