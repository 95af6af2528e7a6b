#!/usr/bin/env bash
# Create or reuse the development venv (.venv at the repository root): torch==2.13.0 (the CPU
# build) first, then rlcore, the first-party plugins (editable) and the test tools, then the
# example third-party plugin installed the way an outsider would (pip install <dir>).
# Idempotent: a stamp of the inputs makes a second run return in well under a second.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RLCORE_VENV:-$ROOT/.venv}"
cd "$ROOT"
source scripts/lib/cpu_venv.sh

inputs=(scripts/setup_venv.sh scripts/lib/cpu_venv.sh scripts/constraints.txt core/pyproject.toml)
for f in plugins/*/pyproject.toml; do [ -e "$f" ] && inputs+=("$f"); done
while IFS= read -r f; do inputs+=("$f"); done < <(find examples/third_party_plugin -type f \( -name '*.py' -o -name '*.toml' \) -not -path '*/build/*' | sort)
hash="$(venv_inputs_hash "${inputs[@]}")"
if venv_is_current "$VENV" "$hash" && [ -x "$VENV/bin/rlcore" ]; then
  exit 0
fi

echo "[setup] preparing $VENV (first run takes about a minute)" >&2
venv_create_cpu_torch "$VENV"
editables=(-e "core[test,tensorboard,data,math,mlflow,wandb,trackio,lora]")
# every plugin editable, rlcore-ray (cluster.backend: ray) among them
for d in plugins/*/; do [ -f "$d/pyproject.toml" ] && editables+=(-e "$d"); done
# ray pinned for CI (rlcore-ray allows >=2.40,<3; 2.60.0 has the cp311 wheel)
"${PIP[@]}" --no-build-isolation "${editables[@]}" pytest hypothesis ruff ray==2.60.0
# the example plugin is installed as an outsider would install it: a regular, non-editable install
"${PIP[@]}" --no-build-isolation --force-reinstall --no-deps examples/third_party_plugin
venv_stamp "$VENV" "$hash"
echo "[setup] $VENV ready" >&2
