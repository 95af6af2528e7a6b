"""Per-run results, the Ray/local comparison and the summary of scripts/gpu/one_gpu_vllm.sh.

    python3 scripts/gpu/one_gpu_vllm_report.py run NAME RUN_DIR RC LOG GPUMEM.csv OUT.json
    python3 scripts/gpu/one_gpu_vllm_report.py compare RAY_RUN_DIR LOCAL_RUN_DIR OUT.json
    python3 scripts/gpu/one_gpu_vllm_report.py summary PARTS_DIR OUT.md

``run``: one rlcore run's step table from its metrics.jsonl: the phases core times (generate,
old-log-prob recomputation, train, weight sync with bytes, GB/s and verification level, vLLM's
sleep and wake, whole step), tokens/s, the trainer-vLLM log-prob mismatch and TIS metrics, R3's
replay coverage and agreement (first and last step in the table, every step on a line of its own), MTP acceptance per draft position, the medians of the steps after
the first, the peak GPU memory (whole card, from nvidia-smi every 500 ms), the end of the log when
the run failed.

``compare``: reward per step of the Ray run against the single-process run. The reward of a
step is a count of correct samples over the step's samples, so two runs that sampled the same
tokens have the same reward exactly; COMPARE_TOL (default 0) allows a difference, for when the
trainer's kernels differ between the two processes' layouts (the step where the curves first part
is reported either way, with the log-prob mismatch of both runs at that step).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

PHASES = ["generate_seconds", "old_logprob_seconds", "train_seconds", "sync_seconds", "rollout/sleep_seconds",
          "rollout/wake_seconds", "rollout/wake_weights_seconds", "rollout/wake_kv_seconds", "step_seconds"]
ALSO = ["reward_mean", "tokens", "tokens_per_second", "logprob_mismatch_max", "logprob_mismatch_mean",
        "mismatch/kl_k3", "mismatch/weight_mean", "mismatch/truncated_frac", "sync_bytes", "sync_buckets",
        "sync_level", "sync_verified", "rollout/sleep_freed_bytes", "rollout/kv_cache_freed_bytes", "weight_version",
        "replay/coverage", "replay/agreement", "replay/missing_samples", "rollout/spec/acceptance_rate",
        "rollout/spec/draft_lag", "rollout/spec/drafts", "rollout/draft_weight_version", "mtp/acceptance_d1"]
PREFIXES = ("rollout/spec/acceptance_pos", "rollout/replica")


def read_rows(run_dir: str) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_table(rows: list[dict]) -> list[dict]:
    table = []
    for r in rows:
        row = {"step": r.get("step")}
        row.update({k: r[k] for k in PHASES + ALSO if k in r})
        # under Ray the replica's own metrics come as rollout/replica{i}_<name>: one replica here
        row.update({k: r[f"rollout/replica0_{k.removeprefix('rollout/')}"] for k in PHASES + ALSO
                    if k.startswith("rollout/") and k not in r and f"rollout/replica0_{k.removeprefix('rollout/')}" in r})
        row.update({k: v for k, v in r.items() if k.startswith(PREFIXES)})
        if r.get("sync_seconds"):
            row["sync_GB_per_s"] = r.get("sync_bytes", 0) / r["sync_seconds"] / 1e9
        table.append(row)
    return table


def medians(table: list[dict]) -> dict:
    later = table[1:] or table  # step 0 pays for warm-up (engine graphs, allocator, first connections)
    out = {}
    for key in PHASES + ["tokens_per_second", "sync_GB_per_s"]:
        values = [row[key] for row in later if isinstance(row.get(key), (int, float))]
        if values:
            out[key] = statistics.median(values)
    return out


def peak_mib(gpumem_csv: str) -> float | None:
    try:
        lines = Path(gpumem_csv).read_text().splitlines()
    except OSError:
        return None
    used = [float(parts[2]) for parts in (line.split(", ") for line in lines) if len(parts) >= 3
            and parts[2].strip().replace(".", "", 1).isdigit()]
    return max(used) if used else None


def run(name: str, run_dir: str, rc: str, log: str, gpumem_csv: str, out: str) -> None:
    table = step_table(read_rows(run_dir))
    result = {"run": name, "rc": int(rc), "steps": len(table), "medians_after_step0": medians(table),
              "peak_gpu_mib": peak_mib(gpumem_csv), "table": table}
    if table:
        first, last = table[0], table[-1]
        result["first_last"] = {k: [first.get(k), last.get(k)] for k in sorted(set(first) | set(last))
                                if k.startswith(("reward_mean", "rollout/spec/acceptance", "replay/"))}
        result["every_push_verified"] = all(row.get("sync_verified") is True for row in table if "sync_level" in row)
        result["sync_levels"] = sorted({str(row["sync_level"]) for row in table if "sync_level" in row})
    cluster = Path(run_dir) / "cluster.json"
    if cluster.exists():
        result["cluster"] = json.loads(cluster.read_text())
    if int(rc) != 0:
        try:
            result["log_tail"] = Path(log).read_text(errors="replace").splitlines()[-40:]
        except OSError:
            pass
    Path(out).write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: result.get(k) for k in ("run", "rc", "steps", "peak_gpu_mib", "every_push_verified",
                                                   "sync_levels", "first_last", "medians_after_step0")}, default=str))


def compare(ray_dir: str, local_dir: str, out: str) -> None:
    tol = float(os.environ.get("COMPARE_TOL", "0"))
    ray_rows, local_rows = read_rows(ray_dir), read_rows(local_dir)
    steps = []
    for a, b in zip(ray_rows, local_rows, strict=False):
        steps.append({"step": a.get("step"), "reward_ray": a.get("reward_mean"), "reward_local": b.get("reward_mean"),
                      "diff": abs(a.get("reward_mean", float("nan")) - b.get("reward_mean", float("nan"))),
                      "mismatch_max_ray": a.get("logprob_mismatch_max"), "mismatch_max_local": b.get("logprob_mismatch_max"),
                      "verified_ray": a.get("sync_verified"), "verified_local": b.get("sync_verified"),
                      # beyond the reward: the same tokens sampled, the same gradient
                      "tokens_ray": a.get("tokens"), "tokens_local": b.get("tokens"),
                      "grad_norm_rel_diff": abs(a.get("grad_norm", 0.0) - b.get("grad_norm", 0.0))
                      / max(abs(b.get("grad_norm", 0.0)), 1e-30)})
    first_apart = next((s["step"] for s in steps if not s["diff"] <= tol), None)
    result = {"steps_compared": len(steps), "steps_ray": len(ray_rows), "steps_local": len(local_rows),
              "tolerance": tol, "equal_within_tolerance": bool(steps) and first_apart is None
              and len(ray_rows) == len(local_rows),
              "first_step_apart": first_apart, "max_diff": max((s["diff"] for s in steps), default=None),
              "same_tokens_every_step": bool(steps) and all(s["tokens_ray"] == s["tokens_local"] for s in steps),
              "max_grad_norm_rel_diff": max((s["grad_norm_rel_diff"] for s in steps), default=None),
              "every_push_verified": bool(steps) and all(s["verified_ray"] is True and s["verified_local"] is True
                                                         for s in steps),
              "steps": steps}
    Path(out).write_text(json.dumps(result, indent=1))
    print("ray vs local:", json.dumps({k: v for k, v in result.items() if k != "steps"}))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return "" if v is None else str(v)


def summary(parts_dir: str, out: str) -> None:
    lines = ["| run | rc | steps | generate s | old-lp s | train s | sync s | sync GB/s | sleep s | wake s | "
             "tok/s | peak GiB | mismatch max | TIS w | verified | first→last |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    compares = []
    for f in sorted(Path(parts_dir).glob("*.json")):
        r = json.loads(f.read_text())
        if f.name.endswith(".compare.json"):
            compares.append((f.name.removesuffix(".compare.json"), r))
            continue
        m, table = r.get("medians_after_step0", {}), r.get("table", [])
        later = table[1:] or table
        wake = sum(m.get(k, 0.0) for k in ("rollout/wake_seconds", "rollout/wake_weights_seconds", "rollout/wake_kv_seconds"))
        mismatch = max((row["logprob_mismatch_max"] for row in table if "logprob_mismatch_max" in row), default=None)
        tis = statistics.median([row["mismatch/weight_mean"] for row in later if "mismatch/weight_mean" in row] or [0]) \
            if any("mismatch/weight_mean" in row for row in later) else None
        peak = r.get("peak_gpu_mib")
        first_last = "; ".join(f"{k.removeprefix('rollout/spec/')} {_fmt(a)}→{_fmt(b)}"
                               for k, (a, b) in (r.get("first_last") or {}).items())
        lines.append(f"| {r.get('run')} | {r.get('rc')} | {r.get('steps')} | {_fmt(m.get('generate_seconds'))} | "
                     f"{_fmt(m.get('old_logprob_seconds'))} | {_fmt(m.get('train_seconds'))} | "
                     f"{_fmt(m.get('sync_seconds'))} | {_fmt(m.get('sync_GB_per_s'))} | "
                     f"{_fmt(m.get('rollout/sleep_seconds'))} | {_fmt(wake or None)} | "
                     f"{_fmt(m.get('tokens_per_second'))} | {_fmt(peak / 1024 if peak else None)} | {_fmt(mismatch)} | "
                     f"{_fmt(tis)} | {','.join(r.get('sync_levels', []))} {r.get('every_push_verified', '')} | "
                     f"{first_last} |")
    for f in sorted(Path(parts_dir).glob("*.json")):  # R3/R2: replay coverage and agreement of every step
        r = json.loads(f.read_text())
        replay_rows = [row for row in r.get("table", []) if "replay/coverage" in row or "replay/agreement" in row]
        if replay_rows:
            lines += ["", f"{r['run']} replay per step (coverage / agreement / samples without routes): "
                      + ", ".join(f"{row.get('step')}: {_fmt(row.get('replay/coverage'))} / "
                                  f"{_fmt(row.get('replay/agreement'))} / {_fmt(row.get('replay/missing_samples'))}"
                                  for row in replay_rows)]
    for f in sorted(Path(parts_dir).glob("*.json")):  # why a run failed: the last line of its log
        r = json.loads(f.read_text())
        if r.get("rc") and r.get("log_tail"):
            lines += ["", f"{r['run']} (rc {r['rc']}): {r['log_tail'][-1][:400]}"]
    for name, c in compares:
        lines.append("")
        lines.append(f"{name}: Ray vs single process, {c['steps_compared']} steps: equal within {c['tolerance']}: "
                     f"{c['equal_within_tolerance']} (max |Δ reward| {_fmt(c['max_diff'])}, first step apart: "
                     f"{c['first_step_apart']}); same token counts every step: {c.get('same_tokens_every_step')}; max relative "
                     f"grad-norm difference {_fmt(c.get('max_grad_norm_rel_diff'))}; every push verified in both: "
                     f"{c['every_push_verified']}")
        lines.append("rewards (ray / local): " + ", ".join(f"{_fmt(s['reward_ray'])}/{_fmt(s['reward_local'])}"
                                                           for s in c["steps"]))
    Path(out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    {"run": run, "compare": compare, "summary": summary}[cmd](*args)
