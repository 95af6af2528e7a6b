#!/usr/bin/env bash
# The benchmark's GPU run, as sent to the device machine (see docs/benchmarks/fused.md):
# installs the carried competitor wheels from .whl/ (liger-kernel, cut-cross-entropy; verl's kernel
# files are read straight from its wheel by bench_fused.py), puts rlcore and rlcore-fused on the
# path from the working tree, records the GPU's state, then runs bench_fused.py into $OUT.
# Usage (on the GPU machine, repository root): bash plugins/fused/bench/run_on_gpu.sh [bench args]
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
cd "$ROOT"
OUT="${OUT:-/tmp/bench-fused}"
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/liger_kernel-*.whl .whl/cut_cross_entropy-*.whl || exit 1
export PYTHONPATH="/tmp/site:$ROOT/core/src:$ROOT/plugins/fused/src" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw,power.limit \
  --format=csv > "$OUT/nvidia-smi.txt" 2>&1
cat "$OUT/nvidia-smi.txt"
python3 plugins/fused/bench/bench_fused.py --wheels .whl --out "$OUT" "$@" 2>&1 | tee "$OUT/console.log"
