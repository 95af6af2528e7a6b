#!/usr/bin/env bash
# The fused-loss benchmark's GPU run (docs/benchmarks/fused.md, "The loss inside the head"):
# installs the carried Liger wheel from .whl/, puts rlcore and rlcore-fused on the path from the
# working tree (and prev/, the earlier head that make_prev_head.sh writes, when present), records
# the GPU's state, runs bench_fused_loss.py into $OUT.
# Usage (on the GPU machine, from this tree's root): bash plugins/fused/bench/run_on_gpu_loss.sh [args]
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
cd "$ROOT"
OUT="${OUT:-/tmp/bench-fused-loss}"
mkdir -p "$OUT"
if ls .whl/liger_kernel-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/liger_kernel-*.whl
fi
export PYTHONPATH="/tmp/site:$ROOT/core/src:$ROOT/plugins/fused/src:$ROOT/prev" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw,power.limit \
  --format=csv > "$OUT/nvidia-smi.txt" 2>&1
cat "$OUT/nvidia-smi.txt"
python3 plugins/fused/bench/bench_fused_loss.py --out "$OUT" "$@" 2>&1 | tee "$OUT/console.log"
