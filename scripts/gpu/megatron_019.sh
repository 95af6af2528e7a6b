#!/usr/bin/env bash
# The megatron engine on the GPU machine with megatron-core 0.19.x (docs/benchmarks/megatron.md).
#
# That machine has Python 3.12, torch, transformers and triton but no network, no megatron-core
# and no Transformer Engine. Carry the wheels (git-ignored) in .whl/megatron/:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d .whl/megatron "megatron-core>=0.19,<0.20"
#   python3 -m pip download --no-deps -d .whl/megatron omegaconf==2.4.0
# and run (device tool): bash scripts/gpu/megatron_019.sh   with carry [".whl/megatron"].
# FORWARD=fused trains with the rlcore-fused Triton head (policy loss and MTP loss alike).
# Results land in $OUT (results.json, metrics.jsonl, log.txt).
set -euo pipefail
OUT="${OUT:-runs/gpu-megatron}"
WORK="${WORK:-/tmp/rlcore-gpu-megatron}"
mkdir -p "$OUT" "$WORK"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/megatron/*.whl
# rlcore and the rlcore-megatron plugin, with their entry points (plugins are found through them)
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site ./core ./plugins/megatron
FORWARD="${FORWARD:-reference}"
if [ "$FORWARD" = fused ]; then  # the rlcore-fused plugin, found through its entry point
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site ./plugins/fused
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/log.txt"
python3 -c "import megatron.core as m, torch, transformers; print('megatron-core', m.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/log.txt"
set +e
python3 plugins/megatron/bench/gpu_smoke.py --out "$WORK" --device cuda --steps "${STEPS:-40}" --forward "$FORWARD" 2>&1 | tee -a "$OUT/log.txt"
rc=${PIPESTATUS[0]}
set -e
cp "$WORK/results.json" "$OUT/" 2>/dev/null || true
cp "$WORK/train/metrics.jsonl" "$OUT/" 2>/dev/null || true
exit "$rc"
