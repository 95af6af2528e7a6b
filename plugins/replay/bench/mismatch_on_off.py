"""GRPO on the tiny MoE (examples/tiny_moe.yaml, hf engine fp32) with the local rollout serving in
bfloat16, so that rollout and trainer route some tokens differently; R3 replay with
``replay.mismatch_off: true`` reports, per step, the trainer-vs-rollout log-prob mismatch with
replay on (the old-log-prob pass, replaying the rollout's routes) and off (one extra native forward
of the same micro-batches, same weights).

    .venv/bin/python plugins/replay/bench/mismatch_on_off.py [steps]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from rlcore.stack import load_stack
from rlcore.testing.runs import Trainer

ROOT = Path(__file__).resolve().parents[3]


def run(steps: int, out: Path, prompts: int = 8, extra: tuple[str, ...] = (), head_calls: list | None = None
        ) -> list[dict]:
    """``extra``: more overrides (another plugin stack); ``head_calls`` collects every head input."""
    s = load_stack(str(ROOT / "examples" / "tiny_moe.yaml"), [
        "plugins=[replay]", f"training.steps={steps}", "output.plot=false", "output.tensorboard=false",
        "output.progress=false", f"data.prompts_per_step={prompts}", f"output.dir={out}", "sync.verify=false",
        "replay.mode=R3", "replay.agreement=true", "replay.mismatch_off=true", *extra])
    t = Trainer(s)
    if head_calls is not None:
        head = t.forward_fn

        def recording_head(inp):
            head_calls.append(inp)
            return head(inp)

        t.forward_fn = recording_head
    t.backend.dtype = torch.bfloat16  # the rollout serves in bf16, the trainer computes in fp32
    t.backend._check_tensor = lambda name, x: None  # fp32 pushes are cast into the bf16 copy (unverified)
    t.run()
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


if __name__ == "__main__":
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    with tempfile.TemporaryDirectory() as d:
        rows = run(steps, Path(d))
    print("step  mismatch off: mean    max    | on (R3): mean    max    | agreement")
    for i, r in enumerate(rows):
        print(f"{i:4d}  {r['replay/logprob_mismatch_off_mean']:19.5f} {r['replay/logprob_mismatch_off_max']:7.4f}"
              f" | {r['replay/logprob_mismatch_on_mean']:14.5f} {r['replay/logprob_mismatch_on_max']:7.4f}"
              f" | {r['replay/agreement']:.4f}")
    mean = {k: sum(r[f"replay/logprob_mismatch_{k}_mean"] for r in rows) / len(rows) for k in ("off", "on")}
    worst = {k: max(r[f"replay/logprob_mismatch_{k}_max"] for r in rows) for k in ("off", "on")}
    print(f"over {len(rows)} steps: mean {mean['off']:.5f} -> {mean['on']:.5f}, max {worst['off']:.4f} -> "
          f"{worst['on']:.4f} (replay off -> on)")
