#!/usr/bin/env bash
# MTP and routing-replay proofs of the megatron engine on the GPU machine with megatron-core 0.19.x
# (docs/benchmarks/megatron_mtp.md): plugins/megatron/bench/gpu_mtp.py in one process.
#
# The machine has Python 3.12, torch, transformers and triton but no network and no megatron-core:
# carry the wheels (git-ignored) in $WHL (default .whl/megatron; see scripts/gpu/megatron_019.sh
# for the pip download lines: megatron-core>=0.19,<0.20 and omegaconf==2.4.0).
# Installs rlcore and the plugins rlcore-megatron, rlcore-fused, rlcore-replay and rlcore-mtp
# (their entry points are how `plugins: [...]` finds them). Results land in $OUT.
set -euo pipefail
OUT="${OUT:-runs/gpu-megatron-mtp}"
WORK="${WORK:-/tmp/rlcore-gpu-mtp}"
WHL="${WHL:-.whl/megatron}"
mkdir -p "$OUT" "$WORK"
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site \
  ./core ./plugins/megatron ./plugins/fused ./plugins/replay ./plugins/mtp
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/log.txt"
python3 -c "import megatron.core as m, torch, transformers, triton; print('megatron-core', m.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" | tee -a "$OUT/log.txt"
echo "install: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/log.txt"
set +e
python3 plugins/megatron/bench/gpu_mtp.py --out "$WORK" --results "$OUT/results.json" --device cuda \
  --steps "${STEPS:-30}" ${ONLY:+--only "$ONLY"} 2>&1 | tee -a "$OUT/log.txt"
rc=${PIPESTATUS[0]}
set -e
for run in train_fused_mtp train_fused_mtp_r2 train_mimo_draft; do
  cp "$WORK/$run/metrics.jsonl" "$OUT/$run.metrics.jsonl" 2>/dev/null || true
done
echo "total: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/log.txt"
exit "$rc"
