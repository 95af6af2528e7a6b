"""Per-part results of scripts/gpu/two_gpu_ray.sh, and the summary table printed at its end.

    python3 scripts/gpu/two_gpu_ray_report.py part NAME RUN_DIR RC LOG OUT.json
    python3 scripts/gpu/two_gpu_ray_report.py summary PARTS_DIR OUT.md

``part``: one rlcore run's step table from its metrics.jsonl (the phases core times: generate;
train, which holds the old-log-prob recomputation; the weight sync with its bytes and GB/s and
verification level; vLLM's sleep and wake when the replicas sleep for training), the medians of
the steps after the first, where the ranks and replicas ran (cluster.json), and the end of the
log when the run failed. ``summary``: every part's JSON in PARTS_DIR as one markdown table.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

PHASES = ["generate_seconds", "train_seconds", "sync_seconds", "rollout/sleep_seconds",
          "rollout/wake_weights_seconds", "rollout/wake_kv_seconds", "step_seconds"]
ALSO = ["reward_mean", "logprob_mismatch_max", "sync_bytes", "sync_buckets", "sync_level", "sync_verified",
        "rollout/sleep_freed_bytes", "weight_version"]


def step_table(rows: list[dict]) -> list[dict]:
    table = []
    for r in rows:
        row = {"step": r.get("step")}
        row.update({k: r[k] for k in PHASES + ALSO if k in r})
        if r.get("sync_seconds"):
            row["sync_GB_per_s"] = r.get("sync_bytes", 0) / r["sync_seconds"] / 1e9
        row.update({k: v for k, v in r.items() if k.startswith("rollout/replica") and k.endswith("weight_version")})
        table.append(row)
    return table


def medians(table: list[dict]) -> dict:
    later = table[1:] or table  # step 0 pays for warm-up (engine graphs, allocator, first connections)
    out = {}
    for k in PHASES + ["sync_GB_per_s"]:
        vals = [r[k] for r in later if isinstance(r.get(k), (int, float))]
        if vals:
            out[k] = statistics.median(vals)
    return out


def part(name: str, run_dir: str, rc: str, log: str, out: str) -> None:
    run = Path(run_dir)
    metrics = run / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.is_file() else []
    res: dict = {"part": name, "rc": int(rc), "steps": len(rows)}
    if rows:
        table = step_table(rows)
        res.update(table=table, medians_after_step0=medians(table),
                   levels=sorted({str(r.get("sync_level")) for r in rows}),
                   logprob_mismatch_max=max(r.get("logprob_mismatch_max", 0.0) for r in rows))
    cluster = run / "cluster.json"
    if cluster.is_file():
        res["cluster"] = json.loads(cluster.read_text())
    if int(rc) != 0 and Path(log).is_file():
        lines = Path(log).read_text(errors="replace").splitlines()
        res["log_tail"] = lines[-60:]
        res["errors"] = [x for x in lines if "Error" in x or "error:" in x][-10:]
    Path(out).write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps({k: v for k, v in res.items() if k not in ("table", "cluster", "log_tail")}, default=str))


def _fmt(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def summary(parts_dir: str, out: str) -> None:
    lines = ["| part | rc | steps | generate s | train s | sync s | sync GB/s | sleep s | wake w/kv s | step s | "
             "levels | mismatch max |", "|---" * 12 + "|"]
    extra = []
    for f in sorted(Path(parts_dir).glob("*.json")):
        res = json.loads(f.read_text())
        name = res.get("part", f.stem)
        med = res.get("medians_after_step0")
        if med is None:  # not an rlcore run: links, log-prob equality
            brief = {k: v for k, v in res.items() if k not in ("log_tail",)}
            extra.append(f"- `{name}`: " + json.dumps(brief, default=str)[:1500])
            continue
        g = med.get
        lines.append(f"| {name} | {res['rc']} | {res['steps']} | {_fmt(g('generate_seconds'))} | "
                     f"{_fmt(g('train_seconds'))} | {_fmt(g('sync_seconds'))} | {_fmt(g('sync_GB_per_s'))} | "
                     f"{_fmt(g('rollout/sleep_seconds'))} | {_fmt(g('rollout/wake_weights_seconds'))}/"
                     f"{_fmt(g('rollout/wake_kv_seconds'))} | {_fmt(g('step_seconds'))} | "
                     f"{','.join(res.get('levels', []))} | {_fmt(res.get('logprob_mismatch_max'))} |")
        if res.get("errors"):
            extra.append(f"- `{name}` errors: " + " / ".join(res["errors"])[:1500])
    text = "\n".join(lines + [""] + extra) + "\n"
    Path(out).write_text(text)
    print(text)


if __name__ == "__main__":
    if sys.argv[1] == "part":
        part(*sys.argv[2:7])
    else:
        summary(*sys.argv[2:4])
