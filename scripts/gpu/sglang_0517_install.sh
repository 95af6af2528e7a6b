#!/usr/bin/env bash
# On the GPU machine (no network): install SGLang 0.5.17 and rlcore from the wheels that
# scripts/gpu/sglang_0517_fetch.sh fetched, without touching the machine's torch 2.11, then check
# that SGLang, its kernels and rlcore-sglang import. docs/benchmarks/weight_sync_sglang.md.
#
#   bash scripts/gpu/sglang_0517_install.sh [WHEEL_DIR] [RLCORE_WHEEL_DIR]
#       WHEEL_DIR: the engine's wheels (default /tmp/carry, where the carry folders' stash.sh put
#                  them; or a copy of .device-carry/sglang0517/wheels)
#       RLCORE_WHEEL_DIR: rlcore's own wheels (default .device-carry/sglang0517/rlcore)
#   SITE=/tmp/site (the install target; put it on PYTHONPATH). Everything goes in with --no-deps
#   --target, so SGLang's transformers 5.12.1 shadows the machine's only under PYTHONPATH=SITE and
#   the machine's torch 2.11.0 (what SGLang 0.5.17 pins) is the one used. A venv works the same:
#   `python3 -m venv --system-site-packages V && V/bin/pip install --no-index --no-deps WHEELS`.
# The engine itself starts in scripts/gpu/sglang_0517_run.sh (the tiny check and rlcore's runs).
set -euo pipefail
WHEEL_DIR="${1:-/tmp/carry}"
RLCORE_WHEEL_DIR="${2:-.device-carry/sglang0517/rlcore}"
SITE="${SITE:-/tmp/site}"
t0=$(date +%s)
n=$(ls "$WHEEL_DIR"/*.whl 2>/dev/null | wc -l)
if [ "$n" -lt 95 ]; then
  echo "[install] $WHEEL_DIR holds $n wheels, expected 100: run every carry folder's stash.sh first" >&2; exit 1
fi
python3 -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" "$WHEEL_DIR"/*.whl "$RLCORE_WHEEL_DIR"/*.whl 2>&1 | grep -v -E "^WARNING: Target directory .* already exists" || true
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
echo "[install] $n + $(ls "$RLCORE_WHEEL_DIR"/*.whl | wc -l) wheels into $SITE in $(( $(date +%s) - t0 )) s" >&2
python3 - <<'EOF'
import importlib.metadata as md
import time
t = time.perf_counter()
import torch, transformers
import sglang
from sglang.srt.server_args import ServerArgs  # noqa: F401 - the config/model registry import chain
import sgl_kernel  # noqa: F401
import rlcore_sglang.sync  # noqa: F401
print("[install] torch", torch.__version__, "transformers", transformers.__version__, "sglang", sglang.__version__,
      "sglang-kernel", md.version("sglang-kernel"), "flashinfer", md.version("flashinfer-python"),
      "rlcore", md.version("rlcore"), "rlcore-sglang", md.version("rlcore-sglang"),
      *[f"{d} {md.version(d)}" for d in ("rlcore-replay", "rlcore-mtp")
        if any(x.metadata["Name"] == d for x in md.distributions())],
      "gpu", torch.cuda.get_device_name(0), f"(imports {time.perf_counter() - t:.1f} s)")
EOF
