"""GRPO on the tiny MoE (examples/tiny_moe.yaml, hf engine fp32) with the local rollout serving in
bfloat16, so that rollout and trainer route some tokens differently; reports the trainer-vs-rollout
log-prob mismatch with R3 replay off and on (same seed, same steps).

    .venv/bin/python plugins/replay/bench/mismatch_on_off.py [steps]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from rlcore.stack import load_stack
from rlcore.trainer import Trainer

ROOT = Path(__file__).resolve().parents[3]


def run(plugins: str, steps: int, out: Path) -> list[dict]:
    s = load_stack(str(ROOT / "examples" / "tiny_moe.yaml"), [
        f"plugins={plugins}", f"training.steps={steps}", "output.plot=false", "output.tensorboard=false",
        "output.progress=false", "data.prompts_per_step=8", f"output.dir={out}", "sync.verify=false"]
        + (["replay.mode=R3", "replay.agreement=true"] if "replay" in plugins else []))
    t = Trainer(s)
    t.backend.dtype = torch.bfloat16  # the rollout serves in bf16, the trainer computes in fp32
    t.backend._check_tensor = lambda name, x: None  # fp32 pushes are cast into the bf16 copy (unverified)
    t.run()
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


if __name__ == "__main__":
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    with tempfile.TemporaryDirectory() as d:
        for name, plugins in (("off", "[]"), ("on (R3)", "[replay]")):
            rows = run(plugins, steps, Path(d) / name.split()[0])
            mean = sum(r["logprob_mismatch_mean"] for r in rows) / len(rows)
            mx = max(r["logprob_mismatch_max"] for r in rows)
            extra = ""
            if "replay/agreement" in rows[0]:
                extra = f"  agreement {sum(r['replay/agreement'] for r in rows) / len(rows):.4f}"
            print(f"replay {name:8s} steps {len(rows)}  logprob_mismatch_mean {mean:.5f}  max {mx:.4f}{extra}")
