#!/usr/bin/env bash
# Fetch what scripts/gpu/two_gpu_ray.sh needs on a two-GPU machine WITHOUT network (run this where
# pip reaches PyPI), split into carry folders for calls of at most 64 MiB (scripts/gpu/lib.sh):
#
#   bash scripts/gpu/two_gpu_ray_fetch.sh [OUT_DIR]      (default .device-carry/tworay, git-ignored)
#
# * vLLM 0.26.0 and the wheels it needs beside the machine's image: scripts/gpu/vllm_026_fetch.sh's
#   (fetched by it into .device-carry/vllm026/wheels unless already there), with the vLLM wheel
#   repacked without vllm_flash_attn/_vllm_fa2_C.abi3.so (FlashAttention 2: 129 MB of the wheel's
#   304; on Hopper vLLM prefers FlashAttention 3, and the module imports FA2 in a try/except) and
#   vllm-rs (the optional Rust frontend, 16 MB), their RECORD lines removed: 5 carry folders instead of 8;
# * Ray 2.60.0 (its jsonschema, referencing and rpds-py are among vLLM's) and megatron-core 0.19.x;
# * rlcore's code as OUT_DIR/src/rlcore-src.tar.gz: `git archive` of RLCORE_FROM (default HEAD),
#   core, plugins/{vllm,ray,megatron}, scripts/gpu, examples, so the machine runs one commit.
#   RLCORE_ONLY=1 remakes only that.
# Calls (device tool, kind nvidia-h100-x2 or nvidia-h200-x2, back to back: the machine keeps /tmp
# only ~30 s after a call): `bash OUT_DIR/cNN/stash.sh` with carry [OUT_DIR/cNN] for each folder,
# the last one followed by the run with carry [OUT_DIR/cNN, OUT_DIR/src] (docs/benchmarks/two_gpu.md).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
source "$ROOT/scripts/gpu/lib.sh"
OUT="$(realpath -m "${1:-$ROOT/.device-carry/tworay}")"
# 50M: a call carries the working tree too (7.8 MB tracked on 2026-12-06) within 64 MiB; at 56M the
# chunk of many small wheels (c05, 17 parts) was refused as too large that day
CHUNK_SIZE="${CHUNK_SIZE:-50M}"
VLLM_CARRY="$ROOT/.device-carry/vllm026"
WHEELS="$OUT/wheels"

mkdir -p "$OUT/src"
rev=$(git -C "$ROOT" rev-parse --short "${RLCORE_FROM:-HEAD}")
git -C "$ROOT" archive --format=tar "$rev" core plugins/enginekit plugins/vllm plugins/ray plugins/megatron scripts/gpu examples \
  | gzip -9 > "$OUT/src/rlcore-src.tar.gz.tmp"
# the commit, readable on the machine (two_gpu_ray.sh logs it)
tmp=$(mktemp -d); echo "rlcore $rev: $(git -C "$ROOT" log -1 --format=%s "$rev" | cut -c1-120)" > "$tmp/COMMIT"
gunzip -c "$OUT/src/rlcore-src.tar.gz.tmp" > "$tmp/src.tar" && tar -rf "$tmp/src.tar" -C "$tmp" COMMIT
gzip -9 -c "$tmp/src.tar" > "$OUT/src/rlcore-src.tar.gz"; rm -rf "$tmp" "$OUT/src/rlcore-src.tar.gz.tmp"
echo "[fetch] rlcore $rev -> $OUT/src/rlcore-src.tar.gz ($(du -h "$OUT/src/rlcore-src.tar.gz" | cut -f1))" >&2
[ -n "${RLCORE_ONLY:-}" ] && exit 0

if ! ls "$VLLM_CARRY"/wheels/vllm-0.26.0-*.whl > /dev/null 2>&1; then
  CHUNK_SIZE=0 bash "$ROOT/scripts/gpu/vllm_026_fetch.sh" "$VLLM_CARRY"
fi
rm -rf "$WHEELS"; mkdir -p "$WHEELS"
for f in "$VLLM_CARRY"/wheels/*.whl; do
  case "$(basename "$f")" in vllm-0.26.0-*) ;; *) ln "$f" "$WHEELS/" 2>/dev/null || cp "$f" "$WHEELS/" ;; esac
done
vllm_whl=$(ls "$VLLM_CARRY"/wheels/vllm-0.26.0-*.whl)
cp "$vllm_whl" "$WHEELS/"
repacked="$WHEELS/$(basename "$vllm_whl")"
drop=(vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs)
zip -q -d "$repacked" "${drop[@]}"
tmp=$(mktemp -d); record=vllm-0.26.0.dist-info/RECORD
(cd "$tmp" && unzip -q "$repacked" "$record" && grep -v -F -e "${drop[0]}," -e "${drop[1]}," "$record" > "$record.new" \
  && mv "$record.new" "$record" && zip -q "$repacked" "$record")
rm -rf "$tmp"
echo "[fetch] vLLM repacked without ${drop[*]}: $(du -h "$repacked" | cut -f1)" >&2

platforms=()
for n in $(seq 17 39); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64)
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d "$WHEELS" "ray==2.60.0" "megatron-core>=0.19,<0.20"
check_one_version "$WHEELS"
echo "[fetch] $(ls "$WHEELS"/*.whl | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1) in $WHEELS" >&2
split_carry "$OUT" "$WHEELS" "$CHUNK_SIZE"
