#!/usr/bin/env bash
# Issue 26 item 4 on one GPU with SGLang 0.5.17: R3 (examples/gpu_sglang_r3.yaml: SGLang's routed experts
# replayed by rlcore-replay) and MTP (examples/gpu_sglang_mtp.yaml: the policy's MTP layer as SGLang's
# EAGLE draft, pushed with the target), each under its own limit, through scripts/gpu/sglang_0517_run.sh
# (which installs SGLang first when this machine has not: the carry folders' stash.sh must have run).
# $OUT gets log.txt, metrics.jsonl and summary.txt (per step: push seconds, sync level, coverage and
# agreement for R3, acceptance per draft position, accept length and the draft's version for MTP).
#   bash scripts/gpu/sglang_0517_r3_mtp.sh
# Limits (seconds): R3_LIMIT (default 330: it holds the machine's first SGLang start and the first
# compile of its MoE kernels; on the H200 of 2026-12-04 R3 spent ~70 s before step 0 and 155 s stopped
# a run with no step, 330 s gave its 4 steps), MTP_LIMIT (default 160, which gave MTP's 8 steps), each
# plus up to 7 s to stop a run that outlives it; with the install (~35 s) the call stays under 540 s. A run stopped at
# its limit keeps the steps it logged (metrics.jsonl, summary.txt). Each run has its own port, so a run
# stopped at its limit cannot hold the next one's.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
RUNS="r3|examples/gpu_sglang_r3.yaml sglang.port=30011|${R3_LIMIT:-330}
mtp|examples/gpu_sglang_mtp.yaml sglang.port=30012|${MTP_LIMIT:-160}" MOE=0 bash scripts/gpu/sglang_0517_run.sh
