#!/usr/bin/env bash
# Packed (no padding) vs padded attention on the GPU, hf and megatron engines (issue 31 item 4;
# docs/benchmarks/packed_attention.md). One call, one GPU, 4-5 minutes for both engines (the hf part
# alone took most of the 230 s the first GPU run had):
#   bash scripts/gpu/packed_attention.sh        with carry [".whl/megatron"] (megatron-core 0.19.2 and
#                                               omegaconf wheels, fetched as scripts/gpu/megatron_019.sh says)
# A Qwen2.5-0.5B-shaped model (random weights), 64 sequences of 64-4096 tokens, forward + backward:
# tokens/s and peak memory per path, log-prob and gradient equality (fp32 and bf16), the varlen
# backend that ran. Writes $OUT/results.json, $OUT/results.md and $OUT/log.txt.
# CPU check of the script (tiny sizes): SIZE=tiny DEVICE=cpu bash scripts/gpu/packed_attention.sh
# PARTS=megatron (or hf; default hf,megatron) runs one engine's part alone: megatron alone is estimated
# at 1.5-3 minutes on a warm H100/H200 (carry [".whl/megatron"]; not yet timed on a GPU). ITERS (timed passes per path, default 2) and
# LAYERS (decoder layers, default the size's 24) shorten a run; the results say which ran.
set -euo pipefail
OUT="${OUT:-runs/gpu-packed-attention}"
mkdir -p "$OUT"
SITE="${SITE:-/tmp/site}"
PARTS="${PARTS:-hf,megatron}"
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if [ "${DEVICE:-cuda}" = cuda ]; then
  PKGS=(./core)
  if [[ ",$PARTS," == *,megatron,* ]]; then
    pip_target --no-compile .whl/megatron/*.whl
    PKGS+=(./plugins/megatron)
  fi
  pip_target --no-build-isolation "${PKGS[@]}"
  export PYTHONPATH="$SITE"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/log.txt"
fi
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/log.txt"
"$PY" -c "import inspect; from torch.nn.attention.varlen import varlen_attn; print('varlen_attn', inspect.signature(varlen_attn))" 2>&1 | tee -a "$OUT/log.txt" || true
if [ "${SIZE:-qwen0.5b}" = tiny ]; then
  ARGS=(--size tiny --seqs 8 --check-seqs 4 --min-len 4 --max-len 64 --mb-tokens 128 --check-mb-tokens 128 --iters "${ITERS:-1}")
else
  ARGS=(--size qwen0.5b --seqs 64 --check-seqs 8 --min-len 64 --max-len 4096 --mb-tokens 8192 --check-mb-tokens 4096 --iters "${ITERS:-2}")
fi
ARGS+=(--engines "$PARTS")
if [ -n "${LAYERS:-}" ]; then ARGS+=(--layers "$LAYERS"); fi
set +e
"$PY" scripts/gpu/packed_attention_bench.py --out "$OUT" --device "${DEVICE:-cuda}" "${ARGS[@]}" 2>&1 | tee -a "$OUT/log.txt"
rc=${PIPESTATUS[0]}
set -e
exit "$rc"
