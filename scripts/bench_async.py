"""Throughput and reward curves of the loop modes (docs/async.md): ``loop.mode`` sync vs
one_step_off vs async on the same work, in one process (the real CLI, one subprocess per run) and
with the rollout as Ray actors on simulated nodes (``--ray``: in this process, joined to the
simulated cluster, as the Ray tests run).

    .venv/bin/python scripts/bench_async.py --steps 150 --out runs/bench_async --plot docs/async/curves.png

Throughput: samples trained per second of wall time from the end of step 0 to the end of the
last step (step 0 pays model loading and warm-up in every mode). ``--max-new-tokens`` sets the
rollout length: the default 4 of examples/tiny.yaml makes generation ~5x shorter than training
here, 16 makes them comparable (the case overlap is for). The per-step numbers go to
``--plot`` with ``.json`` in place of ``.png``; the table is printed as markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = {
    "sync": ["loop.mode=sync"],
    "one_step_off": ["loop.mode=one_step_off"],
    "async k=2": ["loop.mode=async", "loop.max_staleness=2"],
}
COMMON = ["output.checkpoint_every=0", "output.plot=false", "output.tensorboard=false", "output.progress=false",
          "algorithm.mismatch.tis_cap=2.0"]
RAY = ["plugins=[ray]", "cluster.backend=ray", "cluster.rollout.replicas=1", "cluster.timeout_s=600",
       "cluster.trainer.resources.num_cpus=0.5", "cluster.rollout.resources.num_cpus=0.5"]


def summarize(rows: list[dict]) -> dict:
    """Samples/s after step 0, mean step time, the loop's waits and staleness."""
    after = rows[1:]
    wall = rows[-1]["wall_seconds"] - rows[0]["wall_seconds"]
    mean = lambda key: sum(r.get(key, 0.0) for r in after) / max(len(after), 1)  # noqa: E731
    return {"steps": len(rows), "samples_per_s": sum(r["samples"] for r in after) / wall, "wall_s": wall,
            "generate_s": mean("generate_seconds"), "train_s": mean("train_seconds"),
            "trainer_wait_s": mean("loop/trainer_wait_s"), "producer_wait_s": mean("loop/producer_wait_s"),
            "staleness_mean": mean("loop/staleness_mean"), "resumed_samples": mean("loop/resumed_samples"),
            "reward_first10": sum(r["reward_mean"] for r in rows[:10]) / min(10, len(rows)),
            "reward_last10": sum(r["reward_mean"] for r in rows[-10:]) / min(10, len(rows)),
            "reward": [r["reward_mean"] for r in rows]}


def run_cli(out: Path, overrides: list[str]) -> list[dict]:
    from rlcore.testing.runs import read_metrics

    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "rlcore.cli", "train", "examples/tiny.yaml", "--output", str(out), *overrides]
    # one intra-op thread per thread of work: the producer and the trainer each get a core
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    return read_metrics(out)


def run_ray(out: Path, overrides: list[str]) -> list[dict]:
    from rlcore.testing.runs import main, read_metrics

    shutil.rmtree(out, ignore_errors=True)
    assert main(["train", str(ROOT / "examples" / "tiny.yaml"), "--output", str(out), *overrides, *RAY]) == 0
    return read_metrics(out)


def table(results: dict[str, dict]) -> str:
    base = next(iter(results.values()))["samples_per_s"]
    lines = ["| run | samples/s | vs sync | generate s/step | train s/step | trainer waited s/step | "
             "producer waited s/step | staleness mean | reward, first 10 steps | reward, last 10 steps |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for label, r in results.items():
        lines.append(f"| {label} | {r['samples_per_s']:.0f} | {r['samples_per_s'] / base:.2f}x | {r['generate_s']:.3f} "
                     f"| {r['train_s']:.3f} | {r['trainer_wait_s']:.3f} | {r['producer_wait_s']:.3f} | "
                     f"{r['staleness_mean']:.2f} | {r['reward_first10']:.3f} | {r['reward_last10']:.3f} |")
    return "\n".join(lines)


def plot(results: dict[str, dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, r in results.items():
        y = r["reward"]
        k = 10  # a 10-step moving average: one step's mean reward of 128 samples is noisy
        smooth = [sum(y[max(0, i - k + 1): i + 1]) / len(y[max(0, i - k + 1): i + 1]) for i in range(len(y))]
        ax.plot(range(len(y)), smooth, label=f"{label} ({r['samples_per_s']:.0f} samples/s)")
    ax.set_xlabel("step")
    ax.set_ylabel("reward mean (10-step moving average)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--max-new-tokens", type=int, default=4, help="rollout.max_new_tokens (examples/tiny.yaml: 4)")
    ap.add_argument("--ray", action="store_true", help="the rollout as a Ray actor on simulated nodes")
    ap.add_argument("--modes", nargs="*", default=list(MODES))
    ap.add_argument("--out", default="runs/bench_async")
    ap.add_argument("--plot", default=None, help="a .png for the reward curves (and a .json beside it)")
    args = ap.parse_args()
    work = [f"training.steps={args.steps}", f"rollout.max_new_tokens={args.max_new_tokens}", *COMMON]
    load = os.getloadavg()
    results: dict[str, dict] = {}
    context = None
    if args.ray:
        from rlcore_ray.testing import simulated_ray_nodes

        context = simulated_ray_nodes(1, 2)
        context.__enter__()
    try:
        for label in args.modes:
            out = ROOT / args.out / f"{'ray_' if args.ray else ''}{label.replace(' ', '_').replace('=', '')}"
            t0 = time.perf_counter()
            rows = (run_ray if args.ray else run_cli)(out, [*work, *MODES[label]])
            results[label] = summarize(rows)
            print(f"{label}: {results[label]['samples_per_s']:.0f} samples/s ({time.perf_counter() - t0:.0f} s)",
                  file=sys.stderr)
    finally:
        if context is not None:
            context.__exit__(None, None, None)
    where = (f"{'rollout as a Ray actor (1 simulated node)' if args.ray else 'one process'}, "
             f"max_new_tokens={args.max_new_tokens}, {args.steps} steps")
    print(f"{where}; {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), load average before "
          f"{load[0]:.1f}, after {os.getloadavg()[0]:.1f}\n")
    print(table(results))
    if args.plot:
        plot(results, Path(args.plot), f"tiny GRPO, {where}")
        Path(args.plot).with_suffix(".json").write_text(json.dumps({"setup": where, "load_before": load[0],
                                                                     "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
