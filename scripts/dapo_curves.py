"""Learning curves of the embedded default (examples/tiny.yaml) with and without DAPO's dynamic
sampling (algorithm.dapo, docs/algorithms.md): ``.venv/bin/python scripts/dapo_curves.py --steps 40``.
Each run is the real CLI (``rlcore train examples/tiny.yaml ...``); the per-step numbers go to
``--plot`` with ``.json`` in place of ``.png``."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = {
    "grpo": [],
    "grpo + dynamic sampling": ["algorithm.dapo.dynamic_sampling.enable=true"],
    "grpo + dynamic sampling + overlong penalty": [
        "algorithm.dapo.dynamic_sampling.enable=true", "algorithm.dapo.overlong.buffer_tokens=2",
        "algorithm.dapo.overlong.penalty_factor=0.5"],
}
KEYS = ("reward_mean", "samples", "dynamic_sampling/rounds", "dynamic_sampling/groups_filtered",
        "dynamic_sampling/groups_generated", "dynamic_sampling/cap_hit", "dynamic_sampling/reward_generated",
        "response_len",
        "overlong/penalty_mean", "overlong/truncated", "step_seconds")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default="runs/dapo_curves")
    ap.add_argument("--plot", default="docs/algorithms/dapo_curves.png")
    ap.add_argument("--only", nargs="*", default=None, help="run these labels only (others are read from --out)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "core" / "src"))
    from rlcore.testing.runs import read_metrics

    result = {}
    for label, overrides in RUNS.items():
        out = ROOT / args.out / label.replace(" ", "_").replace("+", "")
        if args.only is None or label in args.only:
            shutil.rmtree(out, ignore_errors=True)  # metrics.jsonl appends across runs
            cmd = [str(Path(sys.executable).parent / "rlcore"), "train", "examples/tiny.yaml", "--output", str(out),
                   "--overwrite",
                   f"training.steps={args.steps}", "output.checkpoint_every=0", "output.plot=false",
                   "output.tensorboard=false", "output.progress=false", *overrides]
            # one intra-op thread: on a small shared CPU, oversubscribed torch threads cost ~10x
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            subprocess.run(cmd, cwd=ROOT, check=True, env=env)
        result[label] = {"overrides": overrides, "steps": [{k: r.get(k) for k in KEYS} for r in read_metrics(out)]}
    plot = ROOT / args.plot
    plot.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_len) = plt.subplots(1, 2, figsize=(11, 4))
    for label, run in result.items():
        # the reward of everything generated (the kept groups' mean is biased by the filter)
        gen = "dynamic_sampling/reward_generated"
        ax.plot([r["reward_mean"] if r.get(gen) is None else r[gen] for r in run["steps"]], label=label)
        ax_len.plot([r["response_len"] for r in run["steps"]], label=label)
    ax.set_ylabel("reward of every sample generated")
    ax_len.set_ylabel("response_len (tokens, max 4)")
    for a in (ax, ax_len):
        a.set_xlabel("step")
    ax.set_title("examples/tiny.yaml, seed 0")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(plot, dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
