#!/usr/bin/env bash
# rlcore GRPO with SGLang 0.5.17 generating on the same GPU (examples/gpu_sglang.yaml) and the seed's
# MoE measurement (plugins/sglang/benchmarks/engine_moe_sync.py), for docs/benchmarks/weight_sync_sglang.md.
# Installs first unless already installed in this machine's $SITE (default /tmp/site; scripts/gpu/sglang_0517_install.sh;
# the wheels in WHEEL_DIR, default /tmp/carry), then runs each entry of RUNS, one per line:
#   name|[config.yaml] overrides ...|[limit seconds]
# (default config examples/gpu_sglang.yaml, default limit RUN_LIMIT; default RUNS: the 0.5 B model through
# sglang-tensor), sampling the card's memory every 200 ms, then (MOE=1) the MoE measurement. Each runs
# under run_limited (scripts/gpu/lib.sh): a run past its limit gets its stacks dumped (SIGUSR1) and is
# stopped 7 s later, with the SGLang server it launched (its own session, a descendant of the run), so
# the next run starts on a free card; a measurement past MOE_LIMIT is stopped with its server. Everything lands in $OUT (default runs/gpu-sglang):
# log.txt, metrics.jsonl (every run's steps, each line tagged with its run), summary.txt (one table per
# run: scripts/gpu/sglang_0517_summary.py), <name>.json per MoE measurement (MOE_RUNS); at most 8 files,
# as the device tool returns. RUNS="" skips the training runs, MOE=0 the measurements.
#   bash scripts/gpu/sglang_0517_run.sh        (R3 and MTP: scripts/gpu/sglang_0517_r3_mtp.sh)
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
OUT="${OUT:-runs/gpu-sglang}"
WORK="${WORK:-/tmp/rlcore-gpu-sglang}"
mkdir -p "$OUT" "$WORK"; export OUT
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false SGLANG_DISABLE_REQUEST_LOGGING=1
log() { echo "$*" | tee -a "$OUT/log.txt"; }
SITE="${SITE:-/tmp/site}"; export SITE
if [ ! -f "$SITE/.rlcore-sglang-installed" ] || [ "${INSTALL:-0}" = 1 ]; then
  bash scripts/gpu/sglang_0517_install.sh "${WHEEL_DIR:-/tmp/carry}" 2>&1 | tee -a "$OUT/log.txt"
  [ "${PIPESTATUS[0]}" = 0 ] && touch "$SITE/.rlcore-sglang-installed"
elif [ -d .device-carry/sglang0517/rlcore ]; then  # a newer rlcore build travelled with this call
  python3 -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --upgrade --target "$SITE" \
    .device-carry/sglang0517/rlcore/*.whl 2>&1 | grep -v "already exists" | tee -a "$OUT/log.txt"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; } | tee -a "$OUT/log.txt"

SMALL="engine.model.tiny.hidden_size=256 engine.model.tiny.num_layers=4 engine.model.tiny.num_heads=4 \
engine.model.tiny.num_kv_heads=2 engine.model.tiny.intermediate_size=512 engine.model.tiny.vocab_size=0 \
engine.model.tiny.tie_word_embeddings=false engine.model.tiny.init_std=0.08 training.lr=0.001"
RUNS="${RUNS-qwen05b-tensor|training.steps=3}"
run_one() {  # name limit config overrides...: one rlcore run, stopped with its server past its limit
  local name=$1 limit=$2 config=$3; shift 3
  log "=== run $name (limit $limit s): rlcore train $config $* ${EXTRA:-}"
  local t0 rc
  t0=$(date +%s)
  : > "$WORK/$name.log"
  # stacks at the limit (only this process handles SIGUSR1), stopped 7 s later with its server
  # shellcheck disable=SC2086
  RUN_DUMP_LEAD=0 RUN_DUMP_WAIT=7 RUN_GPUMEM_MS=200 run_limited --gpumem "$WORK/$name.gpumem.csv" "$limit" "$WORK/$name.log" \
    python3 -c 'import faulthandler, signal, sys
faulthandler.register(signal.SIGUSR1, all_threads=True)
from rlcore.cli import main
sys.exit(main())' train "$config" "$@" ${EXTRA:-} --output "$WORK/$name" --overwrite
  rc=$?
  [ "$rc" = 124 ] && log "run $name: past its $limit s limit: stacks dumped (end of its log), stopped with its SGLang server"
  tail -n 60 "$WORK/$name.log" | tee -a "$OUT/log.txt"
  if [ "$rc" != 0 ] && [ -f "$WORK/$name/sglang_server.log" ]; then
    log "--- last lines of $name's SGLang server log"; tail -n 40 "$WORK/$name/sglang_server.log" | tee -a "$OUT/log.txt"
  fi
  log "run $name: rc=$rc in $(( $(date +%s) - t0 )) s; GPU memory used (MiB, whole card): peak $(cut -d, -f3 "$WORK/$name.gpumem.csv" | sort -n | tail -1), samples $(wc -l < "$WORK/$name.gpumem.csv")"
  python3 - "$WORK/$name.gpumem.csv" "$name" <<'EOF' | tee -a "$OUT/log.txt"
import sys
vals = [int(l.split(",")[2]) for l in open(sys.argv[1]) if l.count(",") == 2 and l.split(",")[2].strip().isdigit()]
if vals:  # the card's memory over the run: the dips are SGLang's releases while the trainer trains
    step = max(1, len(vals) // 40)
    print(f"memory trace {sys.argv[2]} (MiB, every {step * 0.2:.1f} s):", " ".join(str(v) for v in vals[::step]))
EOF
  if [ -f "$WORK/$name/metrics.jsonl" ]; then
    python3 -c 'import json,sys
for l in open(sys.argv[1]):
    d=json.loads(l); d["run"]=sys.argv[2]; print(json.dumps(d))' "$WORK/$name/metrics.jsonl" "$name" >> "$OUT/metrics.jsonl"
  fi
  return "$rc"
}
while IFS='|' read -r name overrides limit; do
  [ -z "$name" ] && continue
  config=examples/gpu_sglang.yaml
  # shellcheck disable=SC2086
  set -- $overrides
  case "${1:-}" in *.yaml) config=$1; shift ;; esac
  run_one "$name" "${limit:-${RUN_LIMIT:-300}}" "$config" "$@"
done <<< "$RUNS"
[ -n "$RUNS" ] && python3 scripts/gpu/sglang_0517_summary.py "$OUT" > /dev/null

# the MoE measurements: "name|benchmark args" per line, each into $OUT/<name>.json
MOE_RUNS="${MOE_RUNS:-moe|--verify-once}"
[ "${MOE:-1}" = 1 ] || MOE_RUNS=""
while IFS='|' read -r name args; do
  [ -z "$name" ] && continue
  log "=== MoE measurement $name: python3 plugins/sglang/benchmarks/engine_moe_sync.py $args"
  : > "$WORK/$name.log"
  # killed at its limit with the SGLang server it started (it handles no SIGUSR1: no stacks)
  # shellcheck disable=SC2086
  RUN_DUMP_LEAD=0 RUN_DUMP_WAIT=0 run_limited "${MOE_LIMIT:-300}" "$WORK/$name.log" python3 -X faulthandler \
    plugins/sglang/benchmarks/engine_moe_sync.py $args --work "$WORK/$name" --out "$OUT/$name.json"
  rc=$?
  grep -v -E "^\s*$|Loading weights|SyntaxWarning|Configuration class for applying" "$WORK/$name.log" | tail -n 40 | tee -a "$OUT/log.txt"
  [ "$rc" != 0 ] && [ -f "$WORK/$name/sglang_server.log" ] && tail -n 40 "$WORK/$name/sglang_server.log" | tee -a "$OUT/log.txt"
  log "MoE measurement $name: rc=$rc"
done <<< "$MOE_RUNS"
