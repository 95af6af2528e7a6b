#!/usr/bin/env bash
# Issue 32 item 2 on two GPUs of one host (nvidia-h100-x2 / nvidia-h200-x2): rlcore under Ray with
# vLLM 0.26 rollout replicas (docs/benchmarks/two_gpu.md, "Under Ray with vLLM").
#
# On the GPU machine (no network), after every carry folder of scripts/gpu/two_gpu_ray_fetch.sh
# ran its stash.sh (the wheels in WHEEL_DIR, default /tmp/carry):
#   SRC_TAR=.device-carry/tworay/src/rlcore-src.tar.gz bash scripts/gpu/two_gpu_ray.sh
# installs the wheels (vLLM, Ray, megatron-core; once per machine) and rlcore with its plugins
# vllm, ray and megatron from SRC_TAR (rlcore at the commit the fetch script archived: the tree
# sent along may hold other sessions' unfinished work; without SRC_TAR, from this tree), then runs
# each part of PARTS in its own process group under its limit:
#   links             GPU0 -> GPU1 copy, NCCL broadcast and all-gather (scripts/gpu/two_gpu_links.py)
#   disagg_broadcast  (b) hf trainer on GPU 0, one vLLM replica on GPU 1, weights by NCCL broadcast
#                     (examples/gpu_two_disagg.yaml, vllm.transport=broadcast)
#   disagg_shm        the same through Ray's object store and shared memory (vllm.transport=shm)
#   tp2_colocated     (a) megatron TP=2, a vLLM replica beside each rank (examples/gpu_two_tp2_colocated.yaml)
#   tp_logprobs       megatron log-probs and gradients, TP=2 vs TP=1 and EP=2 vs EP=1
#                     (plugins/megatron/bench/two_gpu.py --part logprobs; fp32)
#   dp2_colocated     (c) DP=2 (hf engine), a vLLM replica beside each rank (examples/gpu_two_dp2_colocated.yaml)
#   dp2_megatron      (c) the same with rlcore-megatron's data parallelism
#   disagg_big        item 3: disagg_broadcast with a 1.03 B-parameter model (2.07 GB in bfloat16)
# Each part runs under run_limited (scripts/gpu/lib.sh): its stacks (every process in its group and
# tree: the driver, the Ray actors, vLLM's engine cores) are dumped 15 s before its limit (SIGUSR1,
# faulthandler via sitecustomize), then it is killed with everything it started, and Ray is stopped
# before the next part (RUN_STOP_RAY=0: not; RUN_FREE_GPU=1: whatever still holds a GPU killed too, as
# before lib.sh; it would kill another part sharing the host). Results: $OUT/log.txt,
# $OUT/summary.md (the per-part table), $OUT/parts.tar.gz (per part: JSON with the step table,
# the run log, metrics.jsonl, cluster.json, GPU memory every 500 ms).
#   STEPS (default 5) training steps per rlcore run; LIMIT_RUN (default 200) s per run; EXTRA:
#   overrides added to every rlcore run (a CPU dry run: scripts/gpu/two_gpu_ray_dry.sh).
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/lib.sh"
export RUN_STOP_RAY="${RUN_STOP_RAY:-1}"
OUT="$(realpath -m "${OUT:-runs/two-gpu-ray}")"
WORK="${WORK:-/tmp/rlcore-two-gpu-ray}"
SITE="${SITE:-/tmp/site}"
WHEEL_DIR="$(realpath -m "${WHEEL_DIR:-/tmp/carry}")"
PARTS="${PARTS:-links disagg_broadcast disagg_shm tp2_colocated tp_logprobs dp2_colocated}"
STEPS="${STEPS:-5}"
LIMIT_RUN="${LIMIT_RUN:-200}"
mkdir -p "$OUT" "$WORK/parts" "$WORK/runs"
# NVLink multicast stays off (KINDS.md: it can take the host's shared GPUs out of service); every
# process of a part inherits these
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
# no network: vLLM cannot find an address of its own (it asks the route to 8.8.8.8); loopback serves one host
export VLLM_HOST_IP="${VLLM_HOST_IP:-127.0.0.1}"
# FlashInfer's sampling kernels are JIT-compiled (ninja, minutes) at first use: vLLM's own instead
export VLLM_USE_FLASHINFER_SAMPLER="${VLLM_USE_FLASHINFER_SAMPLER:-0}"
log() { echo "$*" | tee -a "$OUT/log.txt"; }
t0=$(date +%s)

if [ -n "${SRC_TAR:-}" ]; then
  src=$(realpath "$SRC_TAR")
  rm -rf /tmp/rlsrc && mkdir -p /tmp/rlsrc && tar -xzf "$src" -C /tmp/rlsrc && cd /tmp/rlsrc || exit 1
  HERE=/tmp/rlsrc/scripts/gpu
  log "code: $(cat /tmp/rlsrc/COMMIT 2>/dev/null || echo "$SRC_TAR")"
fi
if [ ! -f "$SITE/.two-gpu-ray-wheels" ]; then
  n=$(ls "$WHEEL_DIR"/*.whl 2>/dev/null | wc -l)
  [ "$n" -ge 70 ] || { log "only $n wheels in $WHEEL_DIR: run every carry folder's stash.sh first"; exit 1; }
  python3 -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHEEL_DIR"/*.whl 2>&1 | grep -v "already exists" | tee -a "$OUT/log.txt"
  # compiled once, on every core: each part's processes (Ray actors, vLLM's engine cores) import vLLM,
  # and the first run on a fresh machine otherwise compiles it import by import (seen: ~30 s more)
  timeout 90 python3 -m compileall -q -j 0 "$SITE" > /dev/null 2>&1
  touch "$SITE/.two-gpu-ray-wheels"
fi
# rlcore itself every call (a later call may bring newer code)
python3 -m pip install -q --disable-pip-version-check --no-index --no-deps --no-build-isolation --no-cache-dir \
  --upgrade --target "$SITE" ./core ./plugins/enginekit ./plugins/vllm ./plugins/ray ./plugins/megatron 2>&1 | grep -v "already exists" \
  | tee -a "$OUT/log.txt"
stack_dump_site "$SITE"  # every Python process of a part (Ray actors, vLLM's engine cores) dumps on SIGUSR1
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
{ date -u; nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader; nvidia-smi topo -m
  python3 - <<'EOF'
import importlib.metadata as md, sys, torch
v = {d: md.version(d) for d in ("vllm", "ray", "megatron-core", "rlcore", "rlcore-vllm", "rlcore-ray", "rlcore-megatron")}
print("python", sys.version.split()[0], "torch", torch.__version__, "nccl", torch.cuda.nccl.version(),
      "gpus", torch.cuda.device_count(), v)
EOF
} 2>&1 | tee -a "$OUT/log.txt"
log "install: $(( $(date +%s) - t0 )) s"

run_part() {  # name limit command...
  local name=$1 limit=$2 p0 rc; shift 2
  p0=$(date +%s)
  log "=== part $name (limit $limit s): $*"
  : > "$WORK/parts/$name.log"
  run_limited --gpumem "$WORK/parts/$name.gpumem.csv" "$limit" "$WORK/parts/$name.log" "$@"; rc=$?
  local peak
  peak=$(awk -F', ' '{ if ($3 > m[$2]) m[$2] = $3 } END { for (g in m) printf "GPU%s %d MiB  ", g, m[g] }' \
    "$WORK/parts/$name.gpumem.csv" 2>/dev/null)
  log "=== part $name rc=$rc in $(( $(date +%s) - p0 )) s; peak memory used: $peak"
  if [ -d "$WORK/runs/$name" ]; then
    python3 "$HERE/two_gpu_ray_report.py" part "$name" "$WORK/runs/$name" "$rc" "$WORK/parts/$name.log" \
      "$WORK/parts/$name.json" 2>&1 | tee -a "$OUT/log.txt"
    cp "$WORK/runs/$name/metrics.jsonl" "$WORK/parts/$name.metrics.jsonl" 2>/dev/null
  fi
  [ -f "$WORK/parts/$name.json" ] || printf '{"part": "%s", "rc": %s, "log_tail": "see %s.log"}\n' "$name" "$rc" \
    "$name" > "$WORK/parts/$name.json"
  tail -n 5 "$WORK/parts/$name.log" | sed "s/^/[$name] /" | tee -a "$OUT/log.txt"
  # after every part: a call stopped at its limit still brings back what finished
  python3 "$HERE/two_gpu_ray_report.py" summary "$WORK/parts" "$OUT/summary.md" > /dev/null
  tar -czf "$OUT/parts.tar.gz" -C "$WORK" parts
}
train() {  # name config overrides...: one rlcore run
  local name=$1 config=$2; shift 2
  rm -rf "$WORK/runs/$name"
  # shellcheck disable=SC2086
  run_part "$name" "$LIMIT_RUN" python3 -m rlcore.cli train "$config" "training.steps=$STEPS" "$@" ${EXTRA:-} \
    --output "$WORK/runs/$name" --overwrite
}
gpu_host_cleanup
for part in $PARTS; do
  case "$part" in
    links) run_part links 120 python3 "$HERE/two_gpu_links.py" "$WORK/parts/links.json" ;;
    disagg_broadcast) train "$part" examples/gpu_two_disagg.yaml vllm.transport=broadcast ;;
    disagg_shm) train "$part" examples/gpu_two_disagg.yaml vllm.transport=shm ;;
    tp2_colocated) train "$part" examples/gpu_two_tp2_colocated.yaml ;;
    tp_logprobs) mkdir -p "$WORK/runs/tp_logprobs_models"
      run_part tp_logprobs 150 python3 plugins/megatron/bench/two_gpu.py --part logprobs --device cuda \
        --out "$WORK/runs/tp_logprobs_models" --results "$WORK/parts/tp_logprobs.json" ;;
    dp2_colocated) train "$part" examples/gpu_two_dp2_colocated.yaml ;;
    dp2_megatron) train "$part" examples/gpu_two_dp2_colocated.yaml "plugins=[megatron,vllm,ray]" engine.name=megatron ;;
    disagg_big)  # item 3: a verified push of a model over 2 GB (1.03 B parameters, 2.07 GB bf16) by broadcast
      train "$part" examples/gpu_two_disagg.yaml vllm.transport=broadcast engine.model.tiny.hidden_size=2048 \
        engine.model.tiny.num_layers=16 engine.model.tiny.num_heads=16 engine.model.tiny.num_kv_heads=4 \
        engine.model.tiny.head_dim=128 engine.model.tiny.intermediate_size=5632 data.prompts_per_step=8 \
        rollout.max_new_tokens=32 ;;
    *) log "unknown part $part" ;;
  esac
done
log "total: $(( $(date +%s) - t0 )) s"
cat "$OUT/summary.md"
