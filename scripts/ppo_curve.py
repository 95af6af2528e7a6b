"""PPO with a critic on the embedded default: reward, the critic's explained variance and value
loss per step, in one plot and a JSON summary::

    .venv/bin/python scripts/ppo_curve.py --steps 80 --out runs/ppo_curve --plot docs/algorithms/ppo_tiny.png

The run is the real CLI (``rlcore train examples/tiny.yaml algorithm.name=ppo``). GRPO's curve on
the same config and seed is drawn for reference from docs/algorithms/curves.json (made by
scripts/algorithm_curves.py), not rerun."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = {"ppo (GAE, critic)": ["algorithm.name=ppo"]}
GRPO_CURVES = ROOT / "docs" / "algorithms" / "curves.json"


def run(name: str, overrides: list[str], steps: int, out: Path) -> list[dict]:
    if out.exists():
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "rlcore.cli", "train", str(ROOT / "examples" / "tiny.yaml"), "--output", str(out),
           f"training.steps={steps}", "output.checkpoint_every=0", "output.plot=false", "output.progress=false",
           *overrides]
    print(name, ":", " ".join(cmd[3:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "ppo_curve")
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "algorithms" / "ppo_tiny.png")
    args = ap.parse_args()
    rows = {name: run(name, ov, args.steps, args.out / name.split()[0]) for name, ov in RUNS.items()}
    keys = ("reward_mean", "critic/explained_variance", "critic/vf_loss", "critic/values_mean", "critic/returns_mean")
    summary = {name: {k: [r.get(k) for r in rs] for k in keys if any(k in r for r in rs)} for name, rs in rows.items()}
    args.plot.with_suffix(".json").write_text(json.dumps({"steps": args.steps, "runs": summary}, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_c) = plt.subplots(1, 2, figsize=(11, 4))
    for name, s in summary.items():
        ax_r.plot(s["reward_mean"], label=name)
    if GRPO_CURVES.exists():
        grpo = json.loads(GRPO_CURVES.read_text()).get("grpo (PPO-clip)")
        if grpo:
            ax_r.plot(grpo["rewards"], label="grpo (docs/algorithms/curves.json)", alpha=0.6)
    ax_r.set(xlabel="step", ylabel="reward_mean", title="examples/tiny.yaml (successor task)")
    ax_r.legend()
    ppo = summary[next(iter(RUNS))]
    ax_c.plot(ppo["critic/explained_variance"], label="explained variance")
    ax_c.plot(ppo["critic/vf_loss"], label="value loss (clipped, ½ token-mean)")
    ax_c.set(xlabel="step", title="ppo's critic")
    ax_c.set_ylim(-1, 1)
    ax_c.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=80)
    for name, s in summary.items():
        r = s["reward_mean"]
        print(f"{name}: reward first 5 {sum(r[:5]) / 5:.3f}, last 10 {sum(r[-10:]) / 10:.3f}")


if __name__ == "__main__":
    main()
