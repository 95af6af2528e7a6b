#!/usr/bin/env bash
# A megatron-core engine suite: create or reuse .venvs/megatron-<X.Y> with megatron-core==VERSION
# on the CPU build of torch, then run the rlcore-megatron plugin's tests (plugins/megatron/tests and plugins/npu/tests) in it.
#   scripts/megatron_suite.sh VERSION          (scripts/suites/megatron-0.12.sh and -0.16.sh call it)
# Idempotent: the venv is stamped with a hash of its inputs; an unchanged venv is reused at once.
# Install order: torch==2.13.0 first (-c scripts/constraints.txt keeps the CPU build), then
# megatron-core, then rlcore and rlcore-megatron (editable, without the plugin's `megatron-core`
# extra: the version pinned here is already in) and the test tools.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MCORE="${1:?usage: scripts/megatron_suite.sh MEGATRON_CORE_VERSION [pytest args...]}"
shift
NAME="megatron-${MCORE%.*}"
VENV="$ROOT/.venvs/$NAME"
source scripts/lib/cpu_venv.sh

inputs=(scripts/megatron_suite.sh scripts/lib/cpu_venv.sh "scripts/suites/$NAME.sh" scripts/constraints.txt core/pyproject.toml
        plugins/megatron/pyproject.toml plugins/replay/pyproject.toml plugins/npu/pyproject.toml plugins/mtp/pyproject.toml
        plugins/ray/pyproject.toml)
hash="$(venv_inputs_hash "${inputs[@]}" -- "megatron-core==$MCORE")"
if ! venv_is_current "$VENV" "$hash"; then
  echo "[$NAME] preparing $VENV" >&2
  venv_create_cpu_torch "$VENV"
  case "$MCORE" in
    0.12.*|0.13.*)
      # these wheels declare megatron-LM's whole training stack (nvidia-modelopt, wandb, zarr,
      # tensorstore, nltk, ...), none of which megatron.core's model code imports: install the
      # wheel alone and the two packages its models do import
      "${PIP[@]}" --no-deps "megatron-core==$MCORE"
      "${PIP[@]}" "packaging>=24.2" numpy ;;
    *)
      "${PIP[@]}" "megatron-core==$MCORE" ;;
  esac
  # rlcore-replay, rlcore-npu and rlcore-mtp need nothing beyond rlcore and megatron-core; rlcore-npu's
  # MindSpeed / 0.12.1 compatibility tests run here against the real megatron-core, and stacks with
  # plugins: [megatron, mtp, replay] find every plugin through its entry point. rlcore-ray (Ray at the
  # same pin as scripts/setup_venv.sh's) runs the megatron TP/EP ranks as Ray actors
  # (plugins/megatron/tests/test_megatron_ray.py)
  "${PIP[@]}" --no-build-isolation -e "core[test]" -e plugins/megatron -e plugins/replay -e plugins/npu -e plugins/mtp \
    -e plugins/ray pytest hypothesis ray==2.60.0
  venv_stamp "$VENV" "$hash"
  echo "[$NAME] $VENV ready" >&2
fi

figures="$(mktemp)"
trap 'rm -f "$figures"' EXIT
set +e
RLCORE_MEGATRON_FIGURES="$figures" PYTHONWARNINGS=ignore OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" \
  "$VENV/bin/python" -m pytest plugins/megatron/tests plugins/npu/tests -q -p no:cacheprovider -W ignore::UserWarning "$@"
rc=$?
set -e
if [ -s "$figures" ]; then
  echo "---------------------------- $NAME figures ----------------------------"
  cat "$figures"
fi
exit $rc
