#!/usr/bin/env bash
# rlcore's code for scripts/gpu/one_gpu_vllm.sh as one tarball (the wheels are two_gpu_ray_fetch.sh's
# carry folders): `git archive` of RLCORE_FROM (default HEAD) of core, the plugins its parts load
# (vllm, ray, megatron, fused, replay, mtp), scripts/gpu and examples, plus a COMMIT file.
#   bash scripts/gpu/one_gpu_vllm_src.sh [OUT_DIR]     (default .device-carry/onegpu/src, git-ignored)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="$(realpath -m "${1:-$ROOT/.device-carry/onegpu/src}")"
mkdir -p "$OUT"
rev=$(git -C "$ROOT" rev-parse --short "${RLCORE_FROM:-HEAD}")
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
git -C "$ROOT" archive --format=tar -o "$tmp/src.tar" "$rev" core plugins/enginekit plugins/vllm plugins/ray plugins/megatron \
  plugins/fused plugins/replay plugins/mtp scripts/gpu examples
echo "rlcore $rev: $(git -C "$ROOT" log -1 --format=%s "$rev" | cut -c1-120)" > "$tmp/COMMIT"
tar -rf "$tmp/src.tar" -C "$tmp" COMMIT
gzip -9 -c "$tmp/src.tar" > "$OUT/rlcore-src.tar.gz"
echo "[src] rlcore $rev -> $OUT/rlcore-src.tar.gz ($(du -h "$OUT/rlcore-src.tar.gz" | cut -f1))" >&2
