#!/usr/bin/env bash
# Fetch everything a GPU machine WITHOUT network needs to run rlcore with SGLang 0.5.17 as its
# rollout engine (run this where pip can reach PyPI; the GPU machine installs with
# scripts/gpu/sglang_0517_install.sh). docs/benchmarks/weight_sync_sglang.md has the whole recipe.
#
#   bash scripts/gpu/sglang_0517_fetch.sh [OUT_DIR]      (default .device-carry/sglang0517, git-ignored)
#
# The GPU machine is assumed to hold Python 3.12 (x86-64, glibc >= 2.28) with torch 2.11.0 (CUDA 13),
# triton, numba, numpy, requests, pyyaml, rich, pluggy, safetensors: SGLang 0.5.17 pins torch==2.11.0
# exactly (0.5.18-0.5.21 pin 2.13, 0.5.23 pins 2.14.1), so it is the SGLang release for such a machine.
# What is fetched (all --no-deps, so nothing the machine already has is replaced):
#   * scripts/gpu/sglang_0517_wheels.txt: SGLang 0.5.17, sglang-kernel 0.4.5, flashinfer 0.6.15.post1
#     and the packages they need beside that image, transformers 5.12.1 (SGLang's own pin; the
#     image's 5.17 registers qwen3_asr, which SGLang 0.5.17's config import then fails on);
#   * sglang-kernel 0.4.5 REPACKED without sgl_kernel/flash_ops.abi3.so (FlashAttention-3, 1.1 GB of
#     its 1.2 GB, imported only inside sgl_kernel/flash_attn.py in a try/except) and sgl_kernel/sm100/
#     (Blackwell), their RECORD lines removed: 383 MB -> about 24 MB. rlcore runs SGLang with the
#     triton attention backend (examples/gpu_sglang.yaml), which needs neither;
#   * what rlcore needs beside the image: omegaconf (+ antlr4-python3-runtime, built here: sdist only);
#   * rlcore's own wheels (bin/wheels): rlcore, rlcore-enginekit, rlcore-sglang, and rlcore-replay and rlcore-mtp (the R3
#     and MTP runs, scripts/gpu/sglang_0517_r3_mtp.sh), in OUT_DIR/rlcore (RLCORE_ONLY=1 rebuilds only
#     them; RLCORE_FROM=HEAD builds them from the last commit).
# Then the wheels are split into OUT_DIR/c01, c02, ... of at most CHUNK_SIZE (default 55M) each, for
# machines reached through calls of at most 64 MiB (this workplace's device tool): call k runs
# `bash OUT_DIR/cNN/stash.sh`, which gathers the parts in /tmp/carry-parts and, once all arrived,
# reassembles and sha256-checks every wheel into /tmp/carry (the split of scripts/gpu/vllm_026_fetch.sh).
# CHUNK_SIZE=0 skips the split (copy OUT_DIR/wheels to the machine any other way: a USB disk, scp).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
source "$ROOT/scripts/gpu/lib.sh"
OUT="$(realpath -m "${1:-$ROOT/.device-carry/sglang0517}")"
CHUNK_SIZE="${CHUNK_SIZE:-55M}"
PY="${PYTHON:-python3}"
WHEELS="$OUT/wheels"
mkdir -p "$WHEELS"
platforms=()
# pip matches manylinux_2_N exactly: list every glibc from 2.17 to 2.39
for n in $(seq 17 39); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64)
download() {  # binary wheels for CPython 3.12 on x86-64 Linux, no dependencies
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$WHEELS" "$@"
}

if [ -z "${RLCORE_ONLY:-}" ]; then
echo "[fetch] SGLang 0.5.17 and its wheels -> $WHEELS" >&2
mapfile -t pins < <(grep -v -E '^\s*(#|$)' "$ROOT/scripts/gpu/sglang_0517_wheels.txt")
download "${pins[@]}"
echo "[fetch] rlcore's dependencies missing from the GPU image" >&2
download "omegaconf==2.3.0"
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$WHEELS" "antlr4-python3-runtime==4.9.3"
rm -f "$WHEELS"/*.tar.gz

kernel=$(ls "$WHEELS"/sglang_kernel-0.4.5-*.whl)
# grep -c reads the whole listing (grep -q could end unzip with SIGPIPE, which pipefail reports as "absent")
if [ "$(unzip -l "$kernel" | grep -c 'sgl_kernel/flash_ops.abi3.so')" -gt 0 ]; then
  echo "[fetch] repacking $(basename "$kernel") without flash_ops.abi3.so and sm100/" >&2
  tmp=$(mktemp -d)
  (cd "$tmp" && unzip -q "$kernel")
  rm -rf "$tmp/sgl_kernel/flash_ops.abi3.so" "$tmp/sgl_kernel/sm100"
  record=$(ls "$tmp"/sglang_kernel-*.dist-info/RECORD)
  grep -v -E '^sgl_kernel/(flash_ops\.abi3\.so|sm100/)' "$record" > "$record.new" && mv "$record.new" "$record"
  rm -f "$kernel"
  (cd "$tmp" && "$PY" - "$kernel" <<'EOF'
import os, sys, zipfile
# dist-info last, as wheels are written; deflate everything
with zipfile.ZipFile(sys.argv[1], "w", zipfile.ZIP_DEFLATED) as z:
    files = sorted(os.path.join(r, f)[2:] for r, _, fs in os.walk(".") for f in fs)
    for f in sorted(files, key=lambda p: (".dist-info/" in p, p)):
        z.write(f, f)
EOF
  )
  rm -rf "$tmp"
fi
fi

echo "[fetch] rlcore's own wheels (bin/wheels)" >&2
build_root="$ROOT"
if [ "${RLCORE_FROM:-}" != "" ]; then
  build_root="$(mktemp -d)"
  git -C "$ROOT" archive "$RLCORE_FROM" | tar -x -C "$build_root"
fi
dist="$(mktemp -d)"
RLCORE_BUILD_VENV="${RLCORE_BUILD_VENV:-$ROOT/.venvs/build}" bash "$build_root/bin/wheels" "$dist" > /dev/null
rm -rf "$OUT/rlcore"; mkdir -p "$OUT/rlcore"
cp "$dist"/rlcore-[0-9]*.whl "$dist"/rlcore_enginekit-*.whl "$dist"/rlcore_sglang-*.whl "$dist"/rlcore_replay-*.whl "$dist"/rlcore_mtp-*.whl "$OUT/rlcore/"
rm -rf "$dist"
[ "$build_root" != "$ROOT" ] && rm -rf "$build_root"
ls -1 "$OUT/rlcore" | sed 's/^/[fetch] rlcore wheel: /' >&2
[ -n "${RLCORE_ONLY:-}" ] && exit 0

n=$(ls "$WHEELS"/*.whl | wc -l)
echo "[fetch] $n wheels, $(du -sh "$WHEELS" | cut -f1) in $WHEELS" >&2
check_one_version "$WHEELS"

[ "$CHUNK_SIZE" = 0 ] && exit 0
split_carry "$OUT" "$WHEELS" "$CHUNK_SIZE"
