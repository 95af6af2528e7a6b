#!/usr/bin/env bash
# Fetch everything a GPU machine WITHOUT network needs to run rlcore with vLLM 0.26.0 as its
# rollout engine (run this where pip can reach PyPI; the GPU machine installs with
# scripts/gpu/vllm_026_install.sh). docs/benchmarks/gpu_e2e.md has the whole recipe.
#
#   bash scripts/gpu/vllm_026_fetch.sh [OUT_DIR]          (default .device-carry/vllm026, git-ignored)
#
# The GPU machine is assumed to hold Python 3.12 (x86-64, glibc >= 2.28) with torch 2.11.0 (CUDA 13),
# transformers >= 5.5.3, numba, triton, numpy, requests, pyyaml, rich, pluggy, matplotlib: vLLM
# 0.26.0 pins torch==2.11.0 exactly, so it is the one vLLM release for such a machine. What is
# fetched (all --no-deps, so nothing the machine already has is replaced):
#   * scripts/gpu/vllm_026_wheels.txt: vLLM 0.26.0 and the 74 packages it needs beside that image
#     (342 MB; xgrammar 0.2.6, not 0.2.8, whose apache-tvm-ffi clashes with vLLM's pin; pycountry
#     for transformers' Mistral tokenizer backend; tilelang, z3-solver, tokenspeed-triton and
#     pynvvideocodec left out: big, and not needed to serve dense and MoE Qwen-style models);
#   * what rlcore needs beside the image: omegaconf (+ antlr4-python3-runtime);
#   * rlcore's own wheels (bin/wheels): rlcore and rlcore-vllm, in OUT_DIR/rlcore. RLCORE_FROM=HEAD
#     builds them from the last commit (git archive) instead of the working tree; RLCORE_ONLY=1
#     rebuilds only them.
# Then, for machines reached through calls of at most 64 MiB (this workplace's device tool), the
# wheels are split into OUT_DIR/c01, c02, ... of at most CHUNK_SIZE (default 55M) each, with a
# MANIFEST and a stash.sh (scripts/gpu/lib.sh's split_carry, the scheme of ../shared/tools/carry-chunks): call k runs
# `bash OUT_DIR/cNN/stash.sh`, which gathers the parts in /tmp/carry-parts and, once all arrived,
# reassembles and sha256-checks every wheel into /tmp/carry. CHUNK_SIZE=0 skips the split
# (copy OUT_DIR/wheels to the machine any other way).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
source "$ROOT/scripts/gpu/lib.sh"
OUT="$(realpath -m "${1:-$ROOT/.device-carry/vllm026}")"
CHUNK_SIZE="${CHUNK_SIZE:-55M}"
PY="${PYTHON:-python3}"
WHEELS="$OUT/wheels"
mkdir -p "$WHEELS"
platforms=()
# pip matches manylinux_2_N exactly: list every glibc from 2.17 to 2.39 (the wheels use 17..35)
for n in $(seq 17 39); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64)
download() {  # binary wheels for CPython 3.12 on x86-64 Linux, no dependencies
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$WHEELS" "$@"
}

if [ -z "${RLCORE_ONLY:-}" ]; then
echo "[fetch] vLLM 0.26.0 and its wheels -> $WHEELS" >&2
mapfile -t pins < <(grep -v -E '^\s*(#|$)' "$ROOT/scripts/gpu/vllm_026_wheels.txt")
download "${pins[@]}"
echo "[fetch] rlcore's dependencies missing from the GPU image" >&2
download "omegaconf==2.3.0"
# antlr4-python3-runtime 4.9.3 (omegaconf's parser runtime) is published as an sdist only: build
# its pure-Python wheel here, so the GPU machine installs wheels only
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$WHEELS" "antlr4-python3-runtime==4.9.3"
rm -f "$WHEELS"/*.tar.gz
fi

echo "[fetch] rlcore's own wheels (bin/wheels)" >&2
build_root="$ROOT"
if [ "${RLCORE_FROM:-}" != "" ]; then
  build_root="$(mktemp -d)"
  git -C "$ROOT" archive "$RLCORE_FROM" | tar -x -C "$build_root"
fi
dist="$(mktemp -d)"
RLCORE_BUILD_VENV="${RLCORE_BUILD_VENV:-$ROOT/.venvs/build}" bash "$build_root/bin/wheels" "$dist" > /dev/null
# kept apart from the engine's wheels (OUT_DIR/rlcore, about 1 MB): a new rlcore build travels alone
rm -rf "$OUT/rlcore"; mkdir -p "$OUT/rlcore"
cp "$dist"/rlcore-[0-9]*.whl "$dist"/rlcore_vllm-*.whl "$OUT/rlcore/"
rm -rf "$dist"
[ "$build_root" != "$ROOT" ] && rm -rf "$build_root"

ls -1 "$OUT/rlcore" | sed 's/^/[fetch] rlcore wheel: /' >&2
[ -n "${RLCORE_ONLY:-}" ] && exit 0
n=$(ls "$WHEELS"/*.whl | wc -l)
echo "[fetch] $n wheels, $(du -sh "$WHEELS" | cut -f1) in $WHEELS" >&2
check_one_version "$WHEELS"
[ "$CHUNK_SIZE" = 0 ] && exit 0
split_carry "$OUT" "$WHEELS" "$CHUNK_SIZE"
