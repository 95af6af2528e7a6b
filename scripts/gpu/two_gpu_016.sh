#!/usr/bin/env bash
# Issue 16 on 2 GPUs of one host (nvidia-h200-x2): rlcore-megatron TP=2 / EP=2 ranks with NCCL,
# weight sync, timings and the fused head with a sharded vocabulary
# (plugins/megatron/bench/two_gpu.py; results in docs/benchmarks/two_gpu.md).
#
# The ranks are the worker code the Ray actors run (rlcore.cluster.worker.run_rank), started
# WITHOUT Ray (Ray's wheel is over what can be sent to the machine): two spawned processes, one GPU
# each through CUDA_VISIBLE_DEVICES. megatron-core 0.19.x and omegaconf come as wheels in $WHL
# (see scripts/gpu/megatron_019.sh for the pip download lines).
# Every part runs under run_limited (scripts/gpu/lib.sh: its own process group; every process of it,
# ranks included, dumps its stacks 12 s before the limit, then all are killed at the limit, nothing
# else on the host touched, so the PARTS_A run side by side); one failing part does not stop the others;
# each writes $OUT/<part>.json as it finishes, the log is $OUT/log.txt.
#   PARTS_A (run side by side, limit LIMIT_A s), then PARTS_B one after another (the sync measurements, each
#   alone, limit LIMIT_BIG s each) and d2d (LIMIT_D2D) alone; STEPS (default 3) training steps per tiny part.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
export RUN_DUMP_LEAD=12 RUN_DUMP_WAIT=12  # stacks 12 s before the limit, killed at it
OUT="${OUT:-runs/two-gpu}"
WORK="${WORK:-/tmp/rlcore-two-gpu}"
WHL="${WHL:-.whl/megatron}"
mkdir -p "$OUT" "$WORK"
# NVLink multicast stays off (KINDS.md: it can take the host's shared GPUs out of service);
# spawned ranks inherit these
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
t0=$(date +%s)
log() { echo "$*" | tee -a "$OUT/log.txt"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target /tmp/site \
  ./core ./plugins/megatron ./plugins/fused ./plugins/mtp
stack_dump_site /tmp/site  # every process of a part (the spawned ranks too) dumps its stacks on SIGUSR1
export PYTHONPATH=/tmp/site
{ date -u; nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader; nvidia-smi topo -m
  python3 -c "import megatron.core as m, torch, triton; print('megatron-core', m.__version__, 'torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
} 2>&1 | tee -a "$OUT/log.txt"
timeout 30 python3 -m compileall -q -j 16 /tmp/site > /dev/null 2>&1  # every spawned rank imports megatron: compile once
log "install and compile: $(( $(date +%s) - t0 )) s"
# one part, under its limit; on a timeout its result is the writer's metrics so far
run_part() {
  local part=$1 limit=$2 p0 rc
  p0=$(date +%s)
  log "=== part $part (limit $limit s)"
  run_limited "$limit" /dev/stdout python3 plugins/megatron/bench/two_gpu.py --part "$part" \
    --out "$WORK/$part" --results "$OUT/$part.json" --device cuda --steps "${STEPS:-3}" --rank-timeout "$(( limit - 5 ))" \
    2>&1 | grep --line-buffered -v -e '^\s*warnings.warn' -e 'Warning:' -e 'DEPRECATED' \
    | sed -u "s/^/[$part] /" >> "$OUT/log.txt"
  rc=${PIPESTATUS[0]}
  log "=== part $part rc=$rc in $(( $(date +%s) - p0 )) s"
  if [ ! -s "$OUT/$part.json" ]; then
    python3 - "$part" "$rc" "$WORK/$part/$part/metrics.jsonl" "$OUT/$part.json" <<'PY'
import json, pathlib, sys
part, rc, metrics, out = sys.argv[1:5]
p = pathlib.Path(metrics)
rows = [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.is_file() else []
json.dump({"part": part, "errors": [f"no result: rc={rc} (124 = timed out)"], "partial_metrics": rows},
          open(out, "w"), indent=1)
PY
  fi
}
# the tiny parts run side by side (their step timings share the GPUs: see the doc); the sync
# measurements run alone after them
for part in ${PARTS_A:-tp_train logprobs ep_mtp_train fused_tp_train}; do
  run_part "$part" "${LIMIT_A:-150}" &
done
wait
for part in ${PARTS_B:-sync_big sync_big_in_place sync_big_unverified}; do
  run_part "$part" "${LIMIT_BIG:-150}"
done
run_part d2d "${LIMIT_D2D:-45}"
log "total: $(( $(date +%s) - t0 )) s"
