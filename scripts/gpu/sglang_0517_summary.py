"""One table per run from what scripts/gpu/sglang_0517_run.sh collected: $OUT/metrics.jsonl (every
run's steps, tagged with the run's name) and $OUT/log.txt (each run's exit code and seconds).

    python3 scripts/gpu/sglang_0517_summary.py OUT_DIR        (writes OUT_DIR/summary.txt, prints it)

Columns appear when a run logged them: push seconds and sync level for every run; for R3,
replay/coverage next to what full coverage is for that batch (``1 - samples / tokens``: the last
token of each sample has no next token and so no route) and replay/agreement; for MTP, SGLang's
acceptance per draft position, its accept length, the draft's weight version after the push, and
the trainer's own MTP acceptance (mtp/acceptance_d1) for comparison.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

#: (header, metric key or a function of the step's row), in the order shown
COLUMNS = [
    ("step", "step"),
    ("reward", "reward_mean"),
    ("gen s", "generate_seconds"),
    ("train s", "train_seconds"),
    ("push s", "sync_seconds"),
    ("buckets", "sync_buckets"),
    ("sync level", "sync_level"),
    ("verified", "sync_verified"),
    ("version", "weight_version"),
    ("coverage", "replay/coverage"),
    ("full coverage", lambda r: 1 - r["samples"] / r["tokens"] if "replay/coverage" in r and r.get("tokens") else None),
    ("agreement", "replay/agreement"),
    ("accept pos1", "rollout/spec/acceptance_pos1"),
    ("accept pos2", "rollout/spec/acceptance_pos2"),
    ("accept pos3", "rollout/spec/acceptance_pos3"),
    ("accept length", "rollout/accept_length"),
    ("draft version", "rollout/draft_weight_version"),
    ("trainer mtp acc d1", "mtp/acceptance_d1"),
    ("mismatch mean", "logprob_mismatch_mean"),
    ("mismatch max", "logprob_mismatch_max"),
    ("released GiB", lambda r: r["rollout/training_release_bytes"] / 2**30 if "rollout/training_release_bytes" in r else None),
]


def cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return f"{value:.0f}" if value.is_integer() and abs(value) < 1e6 else f"{value:.4g}"
    return str(value)


def table(rows: list[dict]) -> list[str]:
    values = [[(key(r) if callable(key) else r.get(key)) for _, key in COLUMNS] for r in rows]
    shown = [i for i in range(len(COLUMNS)) if any(v[i] is not None for v in values)]
    grid = [[COLUMNS[i][0] for i in shown]] + [[cell(v[i]) for i in shown] for v in values]
    widths = [max(len(line[j]) for line in grid) for j in range(len(shown))]
    return ["  ".join(text.rjust(w) for text, w in zip(line, widths, strict=True)) for line in grid]


def run_outcomes(log: Path) -> dict[str, str]:
    """``run NAME: rc=N in S s`` lines of log.txt, by run name."""
    found = {}
    if log.exists():
        for line in log.read_text(errors="replace").splitlines():
            m = re.match(r"^run (\S+): (rc=.*)$", line)
            if m:
                found[m.group(1)] = m.group(2)
    return found


def main(out_dir: str) -> int:
    out = Path(out_dir)
    runs: dict[str, list[dict]] = {}
    metrics = out / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                runs.setdefault(row.get("run", "?"), []).append(row)
    outcomes = run_outcomes(out / "log.txt")
    lines = []
    for name in dict.fromkeys([*outcomes, *runs]):
        lines.append(f"== {name}: {outcomes.get(name, 'no exit line in log.txt')}; {len(runs.get(name, []))} steps logged")
        lines += table(runs[name]) if name in runs else ["(no metrics: see log.txt)"]
        lines.append("")
    text = "\n".join(lines) if lines else "no runs found\n"
    (out / "summary.txt").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "runs/gpu-sglang"))
