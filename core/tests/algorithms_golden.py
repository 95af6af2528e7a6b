"""Capture (``python core/tests/algorithms_golden.py``) or compare the per-step numbers of short
runs of the embedded default. The JSON next to this file was written by the GRPO + PPO-clip
trainer as it was before the ``algorithm`` hook (commit f52c778), so the test in
test_algorithms_trainer.py proves the new default reproduces it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
GOLDEN = HERE / "data" / "grpo_before_algorithm_hook.json"
ROOT = HERE.parent.parent
KEYS = ("reward_mean", "loss", "grad_norm", "clipfrac", "ratio", "entropy", "kl", "response_len")

#: name -> command-line overrides of examples/tiny.yaml
CASES = {
    "token-mean": ["training.steps=6"],
    "seq-mean-token-mean+kl": ["training.steps=4", "algorithm.kl_coef=0.05", "algorithm.loss_agg=seq-mean-token-mean",
                               "training.micro_batch_tokens=64"],
}


def run_case(overrides: list[str], out: Path) -> list[dict]:
    from rlcore.stack import load_config, resolve
    from rlcore.trainer import Trainer
    from rlcore.run_output import read_metrics

    cfg, pm = load_config(ROOT / "examples" / "tiny.yaml",
                          [*overrides, f"output.dir={out}", "output.plot=false", "output.tensorboard=false",
                           "output.progress=false", "output.checkpoint_every=0"])
    Trainer(resolve(cfg, pm)).run()
    return [{k: row.get(k) for k in KEYS} for row in read_metrics(out)]


if __name__ == "__main__":
    import tempfile

    result = {}
    for name, over in CASES.items():
        with tempfile.TemporaryDirectory() as d:
            result[name] = run_case(over, Path(d))
    GOLDEN.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result)[:400], file=sys.stderr)
