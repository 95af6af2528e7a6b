"""Step-averaged mismatch metrics of runs (``mismatch/*`` in metrics.jsonl): means, except the
``_min``/``_max`` keys (extremes over the run). ``python scripts/mismatch_summary.py runs/a runs/b``."""
import json, sys
keys = ["mismatch/kl_k1", "mismatch/kl_k3", "mismatch/ratio_min", "mismatch/ratio_max", "mismatch/ratio_std",
        "mismatch/seq_ratio_max", "mismatch/abs_logprob_diff_max", "mismatch/truncated_frac", "mismatch/masked_frac",
        "mismatch/masked_seq_frac", "mismatch/weight_mean"]
for run in sys.argv[1:]:
    rows = [json.loads(l) for l in open(f"{run}/metrics.jsonl")]
    out = {"steps": len(rows), "reward_first5": sum(r["reward_mean"] for r in rows[:5]) / 5,
           "reward_last5": sum(r["reward_mean"] for r in rows[-5:]) / 5,
           "sync_verified": all(r["sync_verified"] for r in rows)}
    for k in keys:
        vals = [r[k] for r in rows if r.get(k) is not None]
        if not vals: continue
        agg = min if k.endswith("_min") else max if k.endswith("_max") else (lambda v: sum(v) / len(v))
        out[k] = agg(vals)
    print(run, json.dumps({k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in out.items()}))
