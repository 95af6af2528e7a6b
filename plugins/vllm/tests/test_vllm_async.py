"""The overlapped loop with a real vLLM engine as the rollout (docs/async.md): ``loop.mode:
one_step_off`` on examples/vllm_tiny.yaml. vLLM's offline engine does not resume requests across
a push (``resumes_in_flight`` is absent), so a push waits for the generate call in flight and
then lands (``loop.in_flight: keep`` in effect); every push is verified; samples of step n+1 come
from version n and the mismatch correction sees their log-probs (vLLM's, of that version)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine("vllm"), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
STEPS = 8


def test_one_step_off_with_vllm_rollouts(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "rlcore.cli", "train", str(ROOT / "examples" / "vllm_tiny.yaml"),
                           "--output", str(out), f"training.steps={STEPS}", "output.plot=false",
                           "output.checkpoint_every=0", "loop.mode=one_step_off", "algorithm.mismatch.tis_cap=2.0"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert [r["weight_version"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["sync_verified"] for r in rows)
    assert [r["loop/staleness_max"] for r in rows] == [0] + [1] * (STEPS - 1)
    assert all("loop/push_wait_s" in r for r in rows)  # keep: the push waited for requests in flight
    # step 0 on version 0 (as sync: vLLM's log-probs equal the trainer's), later steps one version old
    assert rows[0]["mismatch/abs_logprob_diff_max"] < 1e-4
    assert min(r["mismatch/abs_logprob_diff_max"] for r in rows[1:]) > 1e-3
    print(f"\n[figure] one_step_off with vLLM: reward {[round(r['reward_mean'], 3) for r in rows]}, "
          f"trainer waited {sum(r['loop/trainer_wait_s'] for r in rows[1:]) / (STEPS - 1):.3f} s/step")
