#!/usr/bin/env bash
# Weight sync at copy speed on one GPU, one call (issue 31 items 2-3, issue 32 item 3):
# scripts/gpu/sync_speed.py's three parts (kernels: D2D and the fused copy-and-checksum; mapped: the
# two-process bench, dense and MoE, unverified and coverage+exact; runs: `rlcore train` with models
# of ~0.4, 2 and 8 GB, per-phase push table). Needs only the machine's torch/transformers/triton and
# rlcore from this checkout (core + rlcore-ray, --no-deps, into /tmp/site) and the omegaconf wheel.
#
# Device tool: bash scripts/gpu/sync_speed.sh   with carry [".whl/megatron"] (for omegaconf only)
# Writes $OUT/sync_speed.json, $OUT/sync_speed.md, $OUT/log.txt, $OUT/mapped/results.json,
# $OUT/mapped_log.txt and $OUT/runs/<label>/{metrics.jsonl,log.txt}. Under 4 minutes: BUDGET
# (default 215 s) bounds the Python part, each part stops early when it runs out.
# CPU check: OUT=/tmp/ss DEVICE=cpu TINY=1 SIZES=0.4,2 bash scripts/gpu/sync_speed.sh
set -euo pipefail
OUT="${OUT:-runs/gpu-sync-speed}"
DEVICE="${DEVICE:-cuda}"
mkdir -p "$OUT"
rm -rf /tmp/site-sync && mkdir -p /tmp/site-sync
if ! python3 -c "import omegaconf" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-sync \
    .whl/megatron/omegaconf-2.4.0-py3-none-any.whl
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site-sync ./core ./plugins/ray
export PYTHONPATH=/tmp/site-sync PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  python3 -c "import triton; print('triton', triton.__version__)" 2>/dev/null || echo "no triton"; } | tee "$OUT/log.txt"
args=(--out "$OUT" --device "$DEVICE" --sizes "${SIZES:-0.4,2,8}" --steps "${STEPS:-3}" --budget "${BUDGET:-215}")
[ -n "${TINY:-}" ] && args+=(--tiny)
python3 scripts/gpu/sync_speed.py "${args[@]}" 2>&1 | tee -a "$OUT/log.txt"
