#!/usr/bin/env bash
# The tensor-parallel check's GPU run (a machine with 2 GPUs; see docs/benchmarks/fused.md): puts
# rlcore and rlcore-fused on the path from the working tree and runs bench_fused_tp.py into $OUT.
# NCCL's environment is left as the machine sets it (NVLink multicast stays off).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
cd "$ROOT"
OUT="${OUT:-/tmp/bench-fused-tp}"
mkdir -p "$OUT"
export PYTHONPATH="$ROOT/core/src:$ROOT/plugins/fused/src" PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$OUT/nvidia-smi.txt"
python3 plugins/fused/bench/bench_fused_tp.py --out "$OUT" "$@" 2>&1 | tee "$OUT/tp_console.log"
