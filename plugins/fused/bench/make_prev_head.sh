#!/usr/bin/env bash
# Writes the rlcore_fused package as it was at a git revision into DEST/rlcore_fused_prev (its
# imports renamed), so that bench_fused_loss.py can time it side by side with the working tree's
# head in one process (the GPU machine gets no git history: run this here, carry DEST).
# Usage: bash plugins/fused/bench/make_prev_head.sh REV DEST
set -euo pipefail
REV="$1"
DEST="$2/rlcore_fused_prev"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
mkdir -p "$DEST"
for f in $(git -C "$ROOT" ls-tree --name-only "$REV" plugins/fused/src/rlcore_fused/ | grep '\.py$'); do
  git -C "$ROOT" show "$REV:$f" | sed 's/rlcore_fused\b/rlcore_fused_prev/g' > "$DEST/$(basename "$f")"
done
echo "rlcore_fused at $(git -C "$ROOT" rev-parse --short "$REV") -> $DEST" | tee "$DEST/REVISION"
