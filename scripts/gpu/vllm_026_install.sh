#!/usr/bin/env bash
# On the GPU machine (no network): install vLLM 0.26.0 and rlcore from the wheels that
# scripts/gpu/vllm_026_fetch.sh fetched, then check that vLLM imports and that a tiny engine starts,
# generates with log-probs, sleeps (freeing GPU memory) and wakes. docs/benchmarks/gpu_e2e.md.
#
#   bash scripts/gpu/vllm_026_install.sh [WHEEL_DIR] [RLCORE_WHEEL_DIR]
#       WHEEL_DIR: the engine's wheels (default /tmp/carry, where the carry folders' stash.sh put
#                  them; or a copy of .device-carry/vllm026/wheels)
#       RLCORE_WHEEL_DIR: rlcore's own wheels (default .device-carry/vllm026/rlcore)
#   SITE=/tmp/site (the install target; put it on PYTHONPATH), CHECK=0 skips the engine check.
# Installing with --no-deps --target keeps the machine's torch 2.11 / transformers untouched: vLLM
# 0.26.0 pins torch==2.11.0, which is what the machine has.
set -euo pipefail
WHEEL_DIR="${1:-/tmp/carry}"
RLCORE_WHEEL_DIR="${2:-.device-carry/vllm026/rlcore}"
SITE="${SITE:-/tmp/site}"
t0=$(date +%s)
n=$(ls "$WHEEL_DIR"/*.whl 2>/dev/null | wc -l)
if [ "$n" -lt 70 ]; then
  echo "[install] $WHEEL_DIR holds $n wheels, expected 77: run every carry folder's stash.sh first" >&2; exit 1
fi
python3 -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" "$WHEEL_DIR"/*.whl "$RLCORE_WHEEL_DIR"/*.whl 2>&1 | grep -v -E "^WARNING: Target directory .* already exists" || true
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
echo "[install] $n + $(ls "$RLCORE_WHEEL_DIR"/*.whl | wc -l) wheels into $SITE in $(( $(date +%s) - t0 )) s" >&2
python3 - <<'EOF'
import importlib.metadata as md
import torch, transformers
print("[install] torch", torch.__version__, "transformers", transformers.__version__, "vllm", md.version("vllm"),
      "rlcore", md.version("rlcore"), "rlcore-vllm", md.version("rlcore-vllm"), "gpu", torch.cuda.get_device_name(0))
EOF
[ "${CHECK:-1}" = 0 ] && exit 0

# the check (scripts/gpu/vllm_026_check.py): a tiny Qwen2 created locally (random weights), greedy
# generation from token ids with log-probs, sleep level 1 (weights to host, KV cache dropped), wake,
# the same tokens again. The engine runs in this process (a stuck start then shows its stacks).
# VLLM_HOST_IP: on a machine without network vLLM cannot find an address of its own (it asks the
# route to 8.8.8.8); loopback serves one host.
export VLLM_HOST_IP="${VLLM_HOST_IP:-127.0.0.1}"
# VLLM_USE_FLASHINFER_SAMPLER=0: its top-k/top-p kernels are JIT-compiled (ninja, minutes) at the
# first warm-up; vLLM samples with its own kernels instead
VLLM_USE_FLASHINFER_SAMPLER="${VLLM_USE_FLASHINFER_SAMPLER:-0}" VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_NO_USAGE_STATS=1 timeout -k 5 "${CHECK_LIMIT:-240}" \
  python3 "$(dirname "${BASH_SOURCE[0]}")/vllm_026_check.py" --dump-after "${CHECK_DUMP_AFTER:-100}"
