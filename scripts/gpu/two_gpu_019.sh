#!/usr/bin/env bash
# Issue 32 item 3 (megatron's half) and megatron DP=2 on 2 GPUs of one host (nvidia-h100-x2), one call
# under 5 minutes, NCCL, no Ray, megatron-core 0.19.2 from the carried wheels in $WHL
# (scripts/gpu/megatron_019.sh has their pip download lines). Parts (plugins/megatron/bench/two_gpu.py):
#   d2d         a 1 GiB copy GPU0 -> GPU1 and an NCCL all-gather between the two ranks (the link);
#   sync_large  the 2.16 GB dense model (24 layers, bf16) at TP=2, in place: BIG_STEPS verified pushes
#               (coverage+exact) then UNVERIFIED pushes of the same run without checksums; push GB/s,
#               every rank's peak extra memory, the sync's phases, the export (gathers) alone;
#   dp2_equal   megatron DP=2 vs one rank with the whole batch (fp32): log-probs, loss, gradients, norm;
#   dp2_train   GRPO with megatron DP=2 (TP=1 on the two GPUs), the per-phase step table.
# The ranks run the worker code the Ray actors run (rlcore.parallel.worker.run_rank), started as
# two spawned processes with one GPU each (CUDA_VISIBLE_DEVICES). Every part runs under run_limited
# (scripts/gpu/lib.sh: its own process group; LIMIT_D2D, LIMIT_LARGE, LIMIT_DP_EQUAL, LIMIT_DP_TRAIN
# seconds; every process of it, ranks included, dumps its stacks 12 s before its limit, then all are
# killed at it), one failing part does not stop the others; each writes $OUT/<part>.json, the log is
# $OUT/log.txt, and $OUT/summary.md sums them up at the end.
# PARTS (default "d2d sync_large dp2_equal dp2_train") picks and orders the parts; any other part of
# two_gpu.py runs with its defaults under LIMIT_EXTRA (default 90), as EXTRA_PARTS (run after PARTS) do.
# CPU dry run (gloo, tiny sizes): DEVICE=cpu OUT=/tmp/two-gpu-dry bash scripts/gpu/two_gpu_019.sh
# (with PYTHON set to a Python that has megatron-core, e.g. .venvs/megatron-0.16/bin/python: no install).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
export RUN_DUMP_LEAD=12 RUN_DUMP_WAIT=12  # stacks 12 s before the limit, killed at it
OUT="${OUT:-runs/two-gpu-019}"
WORK="${WORK:-/tmp/rlcore-two-gpu-019}"
WHL="${WHL:-.whl/megatron}"
DEVICE="${DEVICE:-cuda}"
PY="${PYTHON:-python3}"
PARTS="${PARTS:-d2d sync_large dp2_equal dp2_train}"
mkdir -p "$OUT" "$WORK"
# NVLink multicast stays off (KINDS.md: it can take the host's shared GPUs out of service);
# spawned ranks inherit these
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
t0=$(date +%s)
log() { echo "$*" | tee -a "$OUT/log.txt"; }
if [ "$DEVICE" = cuda ]; then
  # a warm machine keeps /tmp/site: start from nothing so that this commit's code is the one that runs
  rm -rf /tmp/site
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHL"/*.whl
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site \
    ./core ./plugins/megatron
  export PYTHONPATH=/tmp/site
  { date -u; nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader; nvidia-smi topo -m
    "$PY" -c "import megatron.core as m, torch; print('megatron-core', m.__version__, 'torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
  } 2>&1 | tee -a "$OUT/log.txt"
  timeout 25 "$PY" -m compileall -q -j 16 /tmp/site > /dev/null 2>&1  # every spawned rank imports megatron: compile once
fi
stack_dump_site "$WORK/stacks"  # every process of a part (the spawned ranks too) dumps its stacks on SIGUSR1
export PYTHONPATH="$WORK/stacks${PYTHONPATH:+:$PYTHONPATH}"
git log -1 --format='rlcore at %h %cI' 2>/dev/null | tee -a "$OUT/log.txt"
log "install and compile: $(( $(date +%s) - t0 )) s"
# one part, under its limit; on a timeout its result is what the ranks wrote so far
run_part() {
  local part=$1 limit=$2 p0 rc
  shift 2
  p0=$(date +%s)
  log "=== part $part (limit $limit s)"
  run_limited "$limit" /dev/stdout "$PY" plugins/megatron/bench/two_gpu.py --part "$part" \
    --out "$WORK/$part" --results "$OUT/$part.json" --device "$DEVICE" --rank-timeout "$(( limit - 5 ))" "$@" \
    2>&1 | grep --line-buffered -v -e '^\s*warnings.warn' -e 'Warning:' -e 'DEPRECATED' \
    | sed -u "s/^/[$part] /" >> "$OUT/log.txt"
  rc=${PIPESTATUS[0]}
  log "=== part $part rc=$rc in $(( $(date +%s) - p0 )) s"
  if [ ! -s "$OUT/$part.json" ]; then
    "$PY" - "$part" "$rc" "$WORK/$part" "$OUT/$part.json" <<'PY'
import json, pathlib, sys
part, rc, work, out = sys.argv[1:5]
work = pathlib.Path(work)
rows = []
for p in work.glob("*/metrics.jsonl"):
    rows = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
ranks = [json.loads(p.read_text()) for p in sorted(work.glob("*_ranks/rank*.json"))]
json.dump({"part": part, "errors": [f"no result: rc={rc} (124 = timed out)"], "partial_metrics": rows,
           "ranks_so_far": ranks}, open(out, "w"), indent=1, default=str)
PY
  fi
}
# one after another: each part's timings have the GPUs to themselves; EXTRA_PARTS, e.g.
# sync_big_in_place (the 0.72 GB model of the calls before, against call 9)
for part in $PARTS ${EXTRA_PARTS:-}; do
  case "$part" in
    d2d) run_part d2d "${LIMIT_D2D:-40}" ;;
    sync_large) run_part sync_large "${LIMIT_LARGE:-110}" --big-steps "${BIG_STEPS:-4}" --unverified-pushes "${UNVERIFIED:-3}" ;;
    dp2_equal) run_part dp2_equal "${LIMIT_DP_EQUAL:-50}" ;;
    dp2_train) run_part dp2_train "${LIMIT_DP_TRAIN:-70}" --steps "${STEPS:-4}" ;;
    *) run_part "$part" "${LIMIT_EXTRA:-90}" ;;
  esac
done
"$PY" plugins/megatron/bench/two_gpu_summary.py "$OUT" > /dev/null 2>> "$OUT/log.txt" || log "summary failed"
log "total: $(( $(date +%s) - t0 )) s"
