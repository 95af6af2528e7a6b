#!/usr/bin/env bash
# Where the time goes (issue 31 item 5): torch.profiler tables per phase and per kernel, as markdown,
# for (a) one forward + backward pass of the hf engine, padded rows vs packed (the model and length
# spread of scripts/gpu/packed_attention.sh, 16 sequences of 64-4096 tokens) and (b) one call of the
# fused loss head, the fused head + torch loss and the four-GEMM floor (T=16384, H=4096, V=151936).
#   bash scripts/gpu/profile_phases.sh          one GPU, no carry (add carry [".whl/megatron"] and
#                                               PARTS=hf,megatron,fused for megatron's pass too);
#                                               about 1 minute on a warm H100/H200
# Writes $OUT/profile.md (the tables), $OUT/profile.json and $OUT/log.txt.
# CPU check of the script (tiny sizes): SIZE=tiny DEVICE=cpu bash scripts/gpu/profile_phases.sh
set -euo pipefail
OUT="${OUT:-runs/gpu-profile-phases}"
mkdir -p "$OUT"
SITE="${SITE:-/tmp/site}"
PARTS="${PARTS:-hf,fused}"
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if [ "${DEVICE:-cuda}" = cuda ]; then
  PKGS=(./core ./plugins/fused)
  if [[ ",$PARTS," == *,megatron,* ]]; then
    pip_target --no-compile .whl/megatron/*.whl
    PKGS+=(./plugins/megatron)
  fi
  pip_target --no-build-isolation "${PKGS[@]}"
  export PYTHONPATH="$SITE"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/log.txt"
fi
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
if [ "${SIZE:-qwen0.5b}" = tiny ]; then
  ARGS=(--size tiny --seqs 6 --min-len 4 --max-len 64 --mb-tokens 128 --tokens 64 --hidden 64 --vocab 512)
else
  ARGS=(--size qwen0.5b --seqs 16 --min-len 64 --max-len 4096 --mb-tokens 8192 --tokens 16384 --hidden 4096 --vocab 151936)
fi
"$PY" scripts/gpu/profile_phases.py --out "$OUT" --device "${DEVICE:-cuda}" --parts "$PARTS" "${ARGS[@]}" 2>&1 | tee -a "$OUT/log.txt"
exit "${PIPESTATUS[0]}"
