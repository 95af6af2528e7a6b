#!/usr/bin/env bash
# Fetch TRL (the peer of issue 25 item 4) for a GPU machine WITHOUT network; run this where pip
# reaches PyPI. Into ONE carry folder (< 60 MiB, one device call):
#
#   bash scripts/gpu/peer_trl_fetch.sh [OUT_DIR]        (default .device-carry/peer_trl, git-ignored)
#
# What and why (the GPU image: Python 3.12, torch 2.11, transformers 5.17, accelerate 1.15, peft,
# pandas, pyarrow, xxhash, fsspec, huggingface_hub 1.33, aiohttp, requests, psutil, jinja2, pyyaml;
# the tworay wheels of scripts/gpu/two_gpu_ray_fetch.sh add vLLM 0.26.0 and dill 0.4.1):
# * trl 1.16.0: the newest release; it declares `vllm>=0.22.0,<=0.31.0` for its vllm extra (0.26.0
#   inside) and `transformers>=4.56.2` (5.17 inside);
# * datasets 4.8.5 (trl needs >=4.7.0): 4.8.x asks pyarrow>=21 and huggingface-hub<2, which the
#   image meets; 5.x asks pyarrow>=24, a version the image's pyarrow was not seen to reach;
# * multiprocess 0.70.19 (datasets: <0.70.20; it needs dill>=0.4.1, the tworay wheel).
# All `--no-deps`, cp312 / py3 wheels. On the machine, the carry call runs
# `bash OUT_DIR/stash.sh`, which copies the wheels to /tmp/carry-peer-trl (scripts/gpu/peer_trl.sh
# installs them into /tmp/site beside the tworay wheels).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
source "$ROOT/scripts/gpu/lib.sh"
OUT="$(realpath -m "${1:-$ROOT/.device-carry/peer_trl}")"
WHEELS=(trl==1.16.0 datasets==4.8.5 multiprocess==0.70.19)

rm -rf "$OUT"; mkdir -p "$OUT"
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 -d "$OUT" "${WHEELS[@]}"
check_one_version "$OUT"
(cd "$OUT" && sha256sum ./*.whl > SHA256SUMS)
cat > "$OUT/stash.sh" <<'STASH'
#!/usr/bin/env bash
# scripts/gpu/peer_trl_fetch.sh: checks this folder's wheels and copies them to /tmp/carry-peer-trl
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
(cd "$here" && sha256sum -c --quiet SHA256SUMS)
mkdir -p /tmp/carry-peer-trl && cp "$here"/*.whl /tmp/carry-peer-trl/
echo "PEER TRL CARRY COMPLETE: $(ls /tmp/carry-peer-trl/*.whl | wc -l) wheels in /tmp/carry-peer-trl"
STASH
chmod +x "$OUT/stash.sh"
size=$(du -sm "$OUT" | cut -f1)
[ "$size" -lt 60 ] || { echo "[fetch] $OUT is $size MiB: over the 60 MiB of one carry call" >&2; exit 1; }
echo "[fetch] $(ls "$OUT"/*.whl | wc -l) wheels, $(du -sh "$OUT" | cut -f1) in $OUT" >&2
