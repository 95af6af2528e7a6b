#!/usr/bin/env bash
# rlcore GRPO with vLLM 0.26.0 generating on the same GPU (examples/gpu_vllm.yaml), for
# docs/benchmarks/gpu_e2e.md. Installs first (scripts/gpu/vllm_026_install.sh; the wheels in
# WHEEL_DIR, default /tmp/carry), then runs each entry of RUNS ("name|overrides ..."; default: a
# small model, then the 0.5 B one), sampling the card's memory every 200 ms, and measures the copy
# bandwidths a weight sync is compared against: device-to-device and pinned host-to-device copies
# of the pushed model's bytes, in the same call.
#   bash scripts/gpu/vllm_026_run.sh            results in $OUT (default runs/gpu-vllm)
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
OUT="${OUT:-runs/gpu-vllm}"
WORK="${WORK:-/tmp/rlcore-gpu-vllm}"
mkdir -p "$OUT" "$WORK"; export OUT
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# no network: vLLM cannot find an address of its own (it asks the route to 8.8.8.8); loopback serves one host
export VLLM_HOST_IP="${VLLM_HOST_IP:-127.0.0.1}"
# FlashInfer's top-k/top-p sampling kernels are JIT-compiled (ninja, minutes) on first use: vLLM's own instead
export VLLM_USE_FLASHINFER_SAMPLER="${VLLM_USE_FLASHINFER_SAMPLER:-0}"
log() { echo "$*" | tee -a "$OUT/log.txt"; }
if [ "${INSTALL:-1}" = 1 ]; then
  CHECK="${CHECK:-1}" bash scripts/gpu/vllm_026_install.sh "${WHEEL_DIR:-/tmp/carry}" 2>&1 | tee -a "$OUT/log.txt"
fi
export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; } | tee -a "$OUT/log.txt"

SMALL="engine.model.tiny.hidden_size=256 engine.model.tiny.num_layers=4 engine.model.tiny.num_heads=4 \
engine.model.tiny.num_kv_heads=2 engine.model.tiny.intermediate_size=512 engine.model.tiny.vocab_size=0 \
engine.model.tiny.tie_word_embeddings=false engine.model.tiny.init_std=0.08 training.lr=0.001 vllm.kv_cache_gib=2"
# the GPU path: buckets on the trainer's GPU opened by vLLM's worker through CUDA IPC, verified
# coverage+exact; vLLM asleep (level 1) while the trainer trains. Call 2 of gpu_e2e.md ran
# "small|$SMALL training.steps=8 rollout.max_new_tokens=8" and "qwen05b|training.steps=5" (shm, no sleep)
IPC="vllm.transport=cuda_ipc vllm.sleep_for_training=true"
RUNS="${RUNS:-small-ipc|$SMALL training.steps=8 rollout.max_new_tokens=8 $IPC
qwen05b-ipc|training.steps=5 $IPC
qwen05b-b64|training.steps=3 data.prompts_per_step=64 rollout.max_new_tokens=256 $IPC}"
run_one() {  # name overrides...: one rlcore run; its stacks are dumped if it outlives RUN_LIMIT
  local name=$1; shift
  log "=== run $name: rlcore train examples/gpu_vllm.yaml $* ${EXTRA:-}"
  local t0 rc
  t0=$(date +%s)
  # run_limited (scripts/gpu/lib.sh): stacks at RUN_LIMIT (only this process handles SIGUSR1), killed
  # 15 s later with vLLM's engine core
  # shellcheck disable=SC2086
  RUN_DUMP_LEAD=0 RUN_DUMP_WAIT=15 RUN_GPUMEM_MS=200 run_limited --gpumem "$OUT/$name.gpumem.csv" "${RUN_LIMIT:-420}" \
    /dev/stdout python3 -c 'import faulthandler, signal, sys
faulthandler.register(signal.SIGUSR1, all_threads=True)
from rlcore.cli import main
sys.exit(main())' train examples/gpu_vllm.yaml "$@" ${EXTRA:-} --output "$WORK/$name" --overwrite 2>&1 | tee "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  log "run $name: rc=$rc in $(( $(date +%s) - t0 )) s; peak GPU memory used (MiB, whole card): $(cut -d, -f3 "$OUT/$name.gpumem.csv" | sort -n | tail -1)"
  cp "$WORK/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null
  return "$rc"
}
while IFS='|' read -r name overrides; do
  [ -z "$name" ] && continue
  # shellcheck disable=SC2086
  run_one "$name" $overrides && continue
  # FALLBACK: overrides for one more try of a failed run (e.g. vllm.multiprocessing=false)
  # shellcheck disable=SC2086
  [ -n "${FALLBACK:-}" ] && run_one "$name-fallback" $overrides $FALLBACK
done <<< "$RUNS"

# the bandwidths a sync is compared against, for the bytes of the 0.5 B model (bf16)
python3 - <<'EOF' 2>&1 | tee -a "$OUT/log.txt"
import json, os, torch
nbytes = int(os.environ.get("COPY_BYTES", 988_065_664))
src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
dst = torch.empty_like(src)
host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
res = {}
for name, (d, s) in {"d2d": (dst, src), "h2d_pinned": (dst, host), "d2h_pinned": (host, src)}.items():
    times = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); d.copy_(s, non_blocking=True); b.record(); torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    t = sorted(times)[len(times) // 2]
    res[name] = {"bytes": nbytes, "seconds": t, "GB_per_s": nbytes / t / 1e9}
print("copy bandwidth:", json.dumps(res))
json.dump(res, open(os.environ.get("OUT", "runs/gpu-vllm") + "/copy_bandwidth.json", "w"), indent=1)
EOF
