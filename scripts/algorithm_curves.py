"""Learning curves of the embedded default (examples/tiny.yaml) under each built-in algorithm,
in one plot: ``.venv/bin/python scripts/algorithm_curves.py --steps 60 --out runs/curves``.
Every run is the real CLI (``rlcore train examples/tiny.yaml algorithm.name=...``); the plot and a
JSON summary go to docs/algorithms/ (``--plot``)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: one run per loss (PPO-clip, GSPO, CISPO); --estimators adds the other advantage estimators
LOSSES = {
    "grpo (PPO-clip)": ["algorithm.name=grpo"],
    "gspo": ["algorithm.name=gspo"],
    "cispo": ["algorithm.name=cispo"],
}
ESTIMATORS = {
    "dr_grpo (PPO-clip)": ["algorithm.name=dr_grpo"],
    "rloo (PPO-clip)": ["algorithm.name=rloo"],
    "reinforce_pp (PPO-clip)": ["algorithm.name=reinforce_pp"],
}

#: --more: the losses and estimators added for issue 30 (grpo as the reference curve)
MORE = {
    "grpo (PPO-clip)": ["algorithm.name=grpo"],
    "sapo": ["algorithm.name=sapo"],
    "gpg": ["algorithm.name=gpg"],
    "clip_cov": ["algorithm.name=clip_cov"],
    "kl_cov": ["algorithm.name=kl_cov"],
    "gmpo": ["algorithm.name=gmpo"],
    "dppo_tv": ["algorithm.name=dppo_tv"],
    "dppo_kl": ["algorithm.name=dppo_kl"],
    "dro": ["algorithm.name=dro"],
    "opo (PPO-clip)": ["algorithm.name=opo"],
    "grpo_passk (PPO-clip)": ["algorithm.name=grpo_passk"],
    "remax (PPO-clip)": ["algorithm.name=remax"],
    "optimal_token_baseline (PPO-clip)": ["algorithm.name=optimal_token_baseline"],
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", default="runs/curves")
    ap.add_argument("--plot", default="docs/algorithms/curves.png")
    ap.add_argument("--only", nargs="*", default=None, help="run these labels only (others are read from --out)")
    ap.add_argument("--estimators", action="store_true", help="also dr_grpo, rloo, reinforce_pp")
    ap.add_argument("--updates", type=int, default=1, help="algorithm.updates_per_step (PPO epochs per step)")
    ap.add_argument("--more", action="store_true", help="instead: grpo and the algorithms added in issue 30")
    args = ap.parse_args()
    runs = MORE if args.more else {**LOSSES, **(ESTIMATORS if args.estimators else {})}
    out = ROOT / args.out
    rlcore = str(Path(sys.executable).parent / "rlcore")
    summary = {}
    for label, overrides in runs.items():
        run_dir = out / overrides[0].split("=")[1]
        if args.only is None or any(o in label for o in args.only):
            t0 = time.time()
            shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl appends across runs
            cmd = [rlcore, "train", "examples/tiny.yaml", "--output", str(run_dir), f"training.steps={args.steps}",
                   "output.plot=false", "output.checkpoint_every=0", "output.progress=false",
                   f"algorithm.updates_per_step={args.updates}", "plugins=[algorithms]", *overrides]  # rlcore-algorithms
            # one intra-op thread: on a small shared CPU, oversubscribed torch threads cost ~10x
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            subprocess.run(cmd, cwd=ROOT, check=True, env=env)
            print(f"{label}: {time.time() - t0:.0f} s", flush=True)
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
        summary[label] = {
            "steps": len(rows),
            "reward_first5": sum(r["reward_mean"] for r in rows[:5]) / 5,
            "reward_last5": sum(r["reward_mean"] for r in rows[-5:]) / 5,
            "rewards": [r["reward_mean"] for r in rows],
        }
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, s in summary.items():
        r = s["rewards"]
        k = 5
        smooth = [sum(r[max(0, i - k + 1): i + 1]) / len(r[max(0, i - k + 1): i + 1]) for i in range(len(r))]
        ax.plot(range(len(r)), smooth, label=f"{label}: {s['reward_first5']:.2f} -> {s['reward_last5']:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("reward_mean (5-step moving average)")
    ax.set_title(f"examples/tiny.yaml (successor task), {args.steps} steps, {args.updates} update(s) per step")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    plot = ROOT / args.plot
    plot.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(plot, dpi=110)
    (plot.with_suffix(".json")).write_text(json.dumps(
        {k: {kk: vv for kk, vv in v.items() if kk != "rewards"} | {"rewards": [round(x, 4) for x in v["rewards"]]}
         for k, v in summary.items()}, indent=1) + "\n")
    for k, v in summary.items():
        print(f"{k:28s} reward {v['reward_first5']:.3f} -> {v['reward_last5']:.3f} ({v['steps']} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
