#!/usr/bin/env bash
# The SGLang suite: plugins/sglang's tests in their own venv, .venvs/sglang, where SGLang's own code
# (sglang 0.5.23) is importable on CPU, so the tests check rlcore's payloads and request bodies with
# SGLang's deserializer, bucket classes, request structs, HTTP routes and receiving code. SGLang's
# engine itself cannot run here (it needs its CUDA kernel stack); no test starts it.
#
# The venv: torch==2.13.0 (the CPU build from the machine's find-links) first, with
# scripts/constraints.txt on every install so nothing replaces it; then sglang with --no-deps (it
# pins torch 2.14.1, CUDA kernels and flashinfer) and only the small packages its imports need;
# torchvision 0.28.0 with --no-deps too (PyPI's build is a CUDA build: SGLang's request structs
# import it, and the tests' conftest makes that import work on CPU torch); then rlcore and
# rlcore-sglang editable. Idempotent: a stamp of the inputs' hash makes an unchanged venv cost a
# second.
# Usage: bash scripts/suites/sglang.sh [pytest args...]     (default: every test of plugins/sglang)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${RLCORE_SGLANG_VENV:-$ROOT/.venvs/sglang}"
cd "$ROOT"
source scripts/lib/cpu_venv.sh

SGLANG_VERSION=0.5.23
SGLANG_OLD_VERSION=0.5.20
# What `import sglang`, its request structs (io_struct), its HTTP server module and its routed-experts
# and weight-checker modules import, found by importing them in a bare venv. Versions pinned where
# sglang 0.5.23 pins them; triton is any build (SGLang's utils import it; nothing here runs a kernel).
SGLANG_IMPORT_DEPS=(
  "numpy" "orjson" "psutil" "pybase64" "requests" "packaging" "pillow" "msgspec" "pydantic" "pyzmq"
  "tqdm" "IPython" "aiohttp" "dill" "einops" "jsonschema" "partial_json_parser" "setproctitle"
  "starlette" "fastapi" "uvicorn" "uvloop" "python-multipart" "httpx" "gguf"
  "triton==3.8.0" "transformers==5.19.0" "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1"
  "compressed-tensors==0.18.0" "openai==2.8.0" "soundfile==0.13.1" "xgrammar==0.2.7"
)
# rlcore's own small deps (torch, transformers, tokenizers, safetensors, numpy come from above)
RLCORE_DEPS=("pluggy>=1.5" "omegaconf>=2.3" "rich>=13" "pytest>=8" "hypothesis>=6.100")

inputs=(scripts/suites/sglang.sh scripts/lib/cpu_venv.sh scripts/constraints.txt core/pyproject.toml
        plugins/sglang/pyproject.toml plugins/enginekit/pyproject.toml)
hash="$(venv_inputs_hash "${inputs[@]}" -- "${SGLANG_IMPORT_DEPS[@]}" "${RLCORE_DEPS[@]}")"

if venv_is_current "$VENV" "$hash"; then
  echo "[sglang] reusing $VENV"
else
  t0=$(date +%s)
  echo "[sglang] preparing $VENV (first run: about 2 minutes with an empty pip cache, 2.5 GB)" >&2
  venv_create_cpu_torch "$VENV"
  "${PIP[@]}" "${SGLANG_IMPORT_DEPS[@]}" "${RLCORE_DEPS[@]}"
  # last and without its dependencies, so pip has no unmet sglang requirements to report
  "${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION" "torchvision==0.28.0"
  "${PIP[@]}" --no-deps --no-build-isolation -e core -e plugins/enginekit -e plugins/sglang
  # the 0.5.20 wheel (not installed): the tests read its request structs' field names, the last
  # release before the weight-update session, to check the bodies rlcore sends to older servers
  "$VENV/bin/python" -m pip download -q --disable-pip-version-check --no-deps "sglang==$SGLANG_OLD_VERSION" -d "$VENV/wheels"
  "$VENV/bin/python" - <<'PYEOF'
import sys, torch
if torch.version.cuda is not None:
    sys.exit(f"a dependency replaced torch with {torch.__version__}")
sys.path.insert(0, "plugins/sglang/tests")
from sglang_env import import_sglang_on_cpu
sglang = import_sglang_on_cpu()
import rlcore, rlcore_sglang  # noqa: F401
print(f"[sglang] sglang {sglang.__version__}, torch {torch.__version__}, rlcore {rlcore.__version__}")
PYEOF
  venv_stamp "$VENV" "$hash"
  echo "[sglang] $VENV ready in $(( $(date +%s) - t0 ))s" >&2
fi

export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export RLCORE_SGLANG_OLD_WHEEL_DIR="$VENV/wheels"
# the suite's tests unless an argument names a test path (`-k expr` alone would collect the whole checkout)
has_path=0; for a in "$@"; do [ -e "${a%%::*}" ] && has_path=1; done
[ "$has_path" = 1 ] || set -- plugins/sglang/tests "$@"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
