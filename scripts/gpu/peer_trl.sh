#!/usr/bin/env bash
# rlcore against TRL's GRPOTrainer (vLLM colocated, sleep mode on) on the same work, one GPU, one
# call (issue 25 item 4). Both read examples/gpu_peer_rlcore.yaml (CONFIG): same model directory
# (saved once by rlcore's save_tiny), batch, max new tokens, sampling, AdamW, bf16, steps, TIS cap.
#
# Needs on the machine: the tworay wheels of scripts/gpu/two_gpu_ray_fetch.sh (vLLM 0.26.0 ...)
# either installed in SITE already (marker $SITE/.two-gpu-ray-wheels, left by one_gpu_vllm.sh or
# two_gpu_ray.sh on a warm machine) or assembled in /tmp/carry by the carry calls
# (`bash .device-carry/tworay/cNN/stash.sh`); and TRL's wheels (scripts/gpu/peer_trl_fetch.sh:
# .device-carry/peer_trl, 1.6 MB, carried in the same call). Installs TRL's wheels and rlcore (core
# and the plugins, from this tree) into SITE, then, in order:
#   d2d      the device-to-device copy bandwidth of 1 GiB (peer_trl.py d2d)
#   model    the model directory both load (peer_trl.py model)
#   trl      TRL's GRPO (peer_trl.py trl), limited to LIMIT_TRL seconds (default 160)
#   rlcore   `rlcore train CONFIG engine.model.path=<the model>`, limited to LIMIT_RLCORE (160)
#   sglang   (SGLANG=1) the same job with SGLang as rlcore's engine (SGLANG_CONFIG, default
#            examples/gpu_peer_rlcore_sglang.yaml), limited to LIMIT_SGLANG (200): SGLang 0.5.17 from
#            SGLANG_SITE (default /tmp/site-sglang, installed there by an earlier call of
#            scripts/gpu/sglang_0517_run.sh with SITE=/tmp/site-sglang), this tree's core, rlcore-sglang and
#            rlcore-fused installed into it first; its own PYTHONPATH (vLLM's SITE left out)
#   report   $OUT/peer_summary.md (peer_trl.py report)
# Each run is limited by run_limited (scripts/gpu/lib.sh): one that reaches its limit has the stacks
# of its processes dumped (SIGUSR1, faulthandler) 15 s before it, then is killed with everything it
# started (RUN_FREE_GPU=1: whatever still holds the GPU killed too before the next run, as before lib.sh).
# Writes $OUT/peer_summary.md, $OUT/log.txt and $OUT/parts.tar.gz (the TRL JSON, rlcore's
# metrics.jsonl, every run's log, the card's memory every RUN_GPUMEM_MS, 50 ms).
#
# Device call (warm machine with the tworay wheels; about 4-5 min, at most ~6.5 with both limits hit):
#   bash scripts/gpu/peer_trl.sh        carry [".device-carry/peer_trl"]
# OVERRIDES="key=value ..." changes the config for both sides; SKIP_TRL=1 runs rlcore's side only (a
# variant of rlcore beside a full call's table); SKIP_RLCORE=1 leaves out rlcore's main run (a call of
# variants only: ~130 s of start-up and steps saved on a call that compares them with an earlier one); VARIANTS="name: key=value ...; name2: ..." runs rlcore
# once more per variant after its main run, in the same call (a table of A/Bs beside the same TRL); PYTHON (default python3) and
# NO_INSTALL=1 (use PYTHON's own packages) serve the CPU check, scripts/gpu/peer_trl_dry.sh.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/lib.sh"
ROOT="$(cd "$HERE/../.." && pwd)"
OUT="$(realpath -m "${OUT:-runs/peer-trl}")"
WORK="${WORK:-/tmp/rlcore-peer-trl}"
SITE="${SITE:-/tmp/site}"
CONFIG="${CONFIG:-$ROOT/examples/gpu_peer_rlcore.yaml}"
PARTS="$WORK/parts"
MODEL="$WORK/model"
rm -rf "$PARTS"; mkdir -p "$OUT" "$PARTS"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_HOST_IP="${VLLM_HOST_IP:-127.0.0.1}" VLLM_USE_FLASHINFER_SAMPLER="${VLLM_USE_FLASHINFER_SAMPLER:-0}"
# the card's memory sampled every 50 ms (lib.sh's default 500 ms missed short peaks: TRL's torch peak
# was 36.9 GiB while the 500 ms samples said 29.5)
export RUN_GPUMEM_MS="${RUN_GPUMEM_MS:-50}"
log() { echo "$*" | tee -a "$OUT/log.txt"; }
t0=$(date +%s)
cd "$ROOT" || exit 1

pip_logged() { pip_target "$@" > >(tee -a "$OUT/log.txt"); }  # lib.sh's, its output kept in the log
PY="${PYTHON:-python3}"
read -r -a OVR <<< "${OVERRIDES:-}"
peer() { "$PY" "$HERE/peer_trl.py" --config "$CONFIG" "${OVR[@]/#/--override=}" "$@"; }
if [ -z "${NO_INSTALL:-}" ]; then
  if [ ! -f "$SITE/.two-gpu-ray-wheels" ]; then
    n=$(ls /tmp/carry/*.whl 2>/dev/null | wc -l)
    [ "$n" -ge 70 ] || { log "only $n tworay wheels in /tmp/carry: run .device-carry/tworay/cNN/stash.sh first"; exit 1; }
    pip_logged /tmp/carry/*.whl && touch "$SITE/.two-gpu-ray-wheels"
  fi
  if [ ! -f "$SITE/.peer-trl-wheels" ]; then
    bash "$ROOT/.device-carry/peer_trl/stash.sh" | tee -a "$OUT/log.txt" || exit 1
    pip_logged /tmp/carry-peer-trl/*.whl && touch "$SITE/.peer-trl-wheels"
  fi
  # every plugin one_gpu_vllm.sh puts in SITE, from this tree: none left from another commit
  pip_logged --no-build-isolation ./core ./plugins/enginekit ./plugins/vllm ./plugins/fused ./plugins/ray ./plugins/megatron \
    ./plugins/replay ./plugins/mtp
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
stack_dump_site "$WORK/sitecustomize"  # every Python process of a run (vLLM's engine core too) dumps on SIGUSR1
export PYTHONPATH="$WORK/sitecustomize${PYTHONPATH:+:$PYTHONPATH}"
{ date -u; nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())'
} 2>&1 | tee -a "$OUT/log.txt"
log "install: $(( $(date +%s) - t0 )) s"

limited() {  # name limit command...
  local name=$1 limit=$2 rc p0; shift 2
  p0=$(date +%s)
  log "=== $name (limit $limit s): $*"
  run_limited --gpumem "$PARTS/$name.gpumem.csv" "$limit" "$PARTS/$name.log" "$@"; rc=$?
  log "=== $name rc=$rc in $(( $(date +%s) - p0 )) s"
  tail -n 4 "$PARTS/$name.log" | sed "s/^/[$name] /" | tee -a "$OUT/log.txt"
}
report() {
  peer report "$PARTS" "$OUT/peer_summary.md" > /dev/null 2>> "$OUT/log.txt"
  tar -czf "$OUT/parts.tar.gz" -C "$WORK" --exclude='parts/rlcore-run/checkpoints' --exclude='parts/trl-output' \
    --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' parts  # logs, JSON and metrics only
}

gpu_host_cleanup
peer d2d "$PARTS/d2d.json" ${D2D_BYTES:+--bytes "$D2D_BYTES"} 2>&1 | tee -a "$OUT/log.txt"
peer model "$MODEL" 2>&1 | tee -a "$OUT/log.txt"
if [ -z "${SKIP_TRL:-}" ]; then
  limited trl "${LIMIT_TRL:-160}" peer trl "$MODEL" "$PARTS/trl.json"
  report  # a call stopped later still brings back TRL's half
else
  log "=== trl skipped (SKIP_TRL): the TRL column of this summary is empty"
fi
if [ -z "${SKIP_RLCORE:-}" ]; then
  limited rlcore "${LIMIT_RLCORE:-160}" "$PY" -m rlcore.cli train "$CONFIG" "engine.model.path=$MODEL" "${OVR[@]}" \
    --output "$PARTS/rlcore-run" --overwrite
  report
else
  log "=== rlcore skipped (SKIP_RLCORE): only the variants run; the rlcore column of this summary is empty"
fi
# VARIANTS="name: key=value ...; name2: ...": rlcore again per variant (OVERRIDES, then the variant's own),
# each limited to LIMIT_VARIANT (default LIMIT_RLCORE), its column in the summary's variants table
IFS=';' read -r -a VARS <<< "${VARIANTS:-}"
for v in "${VARS[@]}"; do
  vname=$(echo "${v%%:*}" | tr -d ' '); [ -n "$vname" ] || continue
  read -r -a VOVR <<< "${v#*:}"
  gpu_host_cleanup
  limited "variant-$vname" "${LIMIT_VARIANT:-${LIMIT_RLCORE:-160}}" "$PY" -m rlcore.cli train "$CONFIG" \
    "engine.model.path=$MODEL" "${OVR[@]}" "${VOVR[@]}" --output "$PARTS/variant-$vname-run" --overwrite
  echo "${v#*:}" > "$PARTS/variant-$vname.overrides"
  report
done
if [ -n "${SGLANG:-}" ]; then
  SGLANG_SITE="${SGLANG_SITE:-/tmp/site-sglang}"
  if [ ! -f "$SGLANG_SITE/.rlcore-sglang-installed" ]; then
    log "=== sglang skipped: no SGLang in $SGLANG_SITE (run scripts/gpu/sglang_0517_run.sh with SITE=$SGLANG_SITE first)"
  else
    SITE="$SGLANG_SITE" pip_logged --no-build-isolation ./core ./plugins/enginekit ./plugins/sglang ./plugins/fused
    gpu_host_cleanup
    PYTHONPATH="$WORK/sitecustomize:$SGLANG_SITE" limited sglang "${LIMIT_SGLANG:-200}" "$PY" -m rlcore.cli train \
      "${SGLANG_CONFIG:-$ROOT/examples/gpu_peer_rlcore_sglang.yaml}" "engine.model.path=$MODEL" "${OVR[@]}" \
      --output "$PARTS/rlcore-sglang-run" --overwrite
    [ -f "$PARTS/rlcore-sglang-run/sglang_server.log" ] && tail -n 30 "$PARTS/rlcore-sglang-run/sglang_server.log" \
      | sed 's/^/[sglang server] /' | tee -a "$OUT/log.txt"
    report
  fi
fi
log "total: $(( $(date +%s) - t0 )) s"
cat "$OUT/peer_summary.md"
