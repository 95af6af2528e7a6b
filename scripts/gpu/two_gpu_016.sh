#!/usr/bin/env bash
# Issue 16 on 2 GPUs of one host (nvidia-h200-x2): rlcore-megatron TP=2 / EP=2 ranks with NCCL,
# weight sync, timings and the fused head with a sharded vocabulary
# (plugins/megatron/bench/two_gpu.py; results in docs/benchmarks/two_gpu.md).
#
# The ranks are the worker code the Ray actors run (rlcore.cluster.worker.run_rank), started
# WITHOUT Ray (Ray's wheel is over what can be sent to the machine): two spawned processes, one GPU
# each through CUDA_VISIBLE_DEVICES. megatron-core 0.19.x and omegaconf come as wheels in $WHL
# (see scripts/gpu/megatron_019.sh for the pip download lines).
# Every part runs in its own process under `timeout`; one failing part does not stop the others;
# each writes $OUT/<part>.json as it finishes, the log is $OUT/log.txt.
#   PARTS="d2d logprobs ..." to run a subset; STEPS (default 4) training steps per training part.
set -uo pipefail
OUT="${OUT:-runs/two-gpu}"
WORK="${WORK:-/tmp/rlcore-two-gpu}"
WHL="${WHL:-.whl/megatron}"
mkdir -p "$OUT" "$WORK"
# NVLink multicast stays off (KINDS.md: it can take the host's shared GPUs out of service);
# spawned ranks inherit these
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
t0=$(date +%s)
log() { echo "$*" | tee -a "$OUT/log.txt"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site \
  ./core ./plugins/megatron ./plugins/fused ./plugins/mtp
export PYTHONPATH=/tmp/site
{ date -u; nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader; nvidia-smi topo -m
  python3 -c "import megatron.core as m, torch, triton; print('megatron-core', m.__version__, 'torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
} 2>&1 | tee -a "$OUT/log.txt"
log "install: $(( $(date +%s) - t0 )) s"
declare -A LIMIT=([d2d]=45 [tp_train]=75 [logprobs]=80 [ep_mtp_train]=75 [sync_big]=100 [fused_tp_train]=70)
for part in ${PARTS:-d2d tp_train logprobs ep_mtp_train sync_big fused_tp_train}; do
  p0=$(date +%s)
  log "=== part $part (limit ${LIMIT[$part]:-90} s)"
  timeout -k 5 "${LIMIT[$part]:-90}" python3 plugins/megatron/bench/two_gpu.py --part "$part" --out "$WORK/$part" \
    --results "$OUT/$part.json" --device cuda --steps "${STEPS:-4}" --rank-timeout "$(( ${LIMIT[$part]:-90} - 5 ))" \
    2>&1 | grep -v -e '^\s*warnings.warn' -e 'Warning:' | tee -a "$OUT/log.txt"
  rc=${PIPESTATUS[0]}
  log "=== part $part rc=$rc in $(( $(date +%s) - p0 )) s"
  [ -s "$OUT/$part.json" ] || echo "{\"part\": \"$part\", \"errors\": [\"no result: rc=$rc (124 = timed out)\"]}" > "$OUT/$part.json"
done
log "total: $(( $(date +%s) - t0 )) s"
