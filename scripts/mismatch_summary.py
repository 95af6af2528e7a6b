"""Step-averaged mismatch metrics of runs (``mismatch/*`` in metrics.jsonl): means, except the
``_min``/``_max`` keys (extremes over the run). ``python scripts/mismatch_summary.py runs/a runs/b``."""

import json
import sys

KEYS = ["mismatch/kl_k1", "mismatch/kl_k3", "mismatch/ratio_min", "mismatch/ratio_max", "mismatch/ratio_std",
        "mismatch/seq_ratio_max", "mismatch/abs_logprob_diff_max", "mismatch/truncated_frac", "mismatch/masked_frac",
        "mismatch/masked_seq_frac", "mismatch/weight_mean"]


def summary(run: str) -> dict:
    with open(f"{run}/metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    out = {"steps": len(rows), "reward_first5": sum(r["reward_mean"] for r in rows[:5]) / 5,
           "reward_last5": sum(r["reward_mean"] for r in rows[-5:]) / 5,
           "sync_verified": all(r["sync_verified"] for r in rows)}
    for k in KEYS:
        vals = [r[k] for r in rows if r.get(k) is not None]
        if not vals:
            continue
        if k.endswith("_min"):
            out[k] = min(vals)
        elif k.endswith("_max"):
            out[k] = max(vals)
        else:
            out[k] = sum(vals) / len(vals)
    return out


if __name__ == "__main__":
    for run in sys.argv[1:]:
        print(run, json.dumps({k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in summary(run).items()}))
