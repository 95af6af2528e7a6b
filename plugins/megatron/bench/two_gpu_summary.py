"""summary.md from the JSON files of scripts/gpu/two_gpu_019.sh's parts (two_gpu.py's results).

Usage: ``python plugins/megatron/bench/two_gpu_summary.py OUT_DIR`` (writes OUT_DIR/summary.md and
prints it). Parts missing or failed are listed with their errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

PHASE_KEYS = ("generate_seconds", "train_seconds", "sync_seconds", "step_seconds")


def _f(x: Any, digits: int = 3) -> str:
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1e-2 or abs(x) >= 1e4 else f"{x:.{digits}f}"
    return "–" if x is None else str(x)


def _errors(res: dict) -> list[str]:
    errs = [str(e).splitlines()[0][:300] for e in res.get("errors") or []]
    return [f"- error: {e}" for e in errs]


def d2d(res: dict) -> list[str]:
    lines = ["## d2d: the link", ""]
    copy = res.get("copy_gpu0_to_gpu1") or {}
    if "GBps" in copy:
        lines.append(f"- 1 GiB copy GPU0 → GPU1 (peer access {copy.get('peer_access')}): **{copy['GBps']:.0f} GB/s**")
    ag = res.get("all_gather_2_ranks")
    if isinstance(ag, list) and ag:
        lines.append(f"- NCCL all_gather_into_tensor, {ag[0]['shard_bytes'] >> 20} MiB a rank: received "
                     f"**{ag[0]['received_GBps']:.0f} GB/s** per rank (correct {all(a['correct'] for a in ag)})")
    return lines + _errors(res)


def sync(res: dict) -> list[str]:
    lines = [f"## {res.get('part')}: the push", ""]
    if res.get("ranks_so_far") and not res.get("pushes"):  # stopped at its limit: what the ranks wrote
        sys.path.insert(0, str(Path(__file__).parent))
        from two_gpu import push_summary

        res = dict(res, ranks=res["ranks_so_far"], metrics=res.get("partial_metrics") or [])
        res["pushes"] = push_summary(res)
        lines += ["(the part stopped at its limit: the pushes its ranks recorded before)", ""]
    pushes = res.get("pushes") or {}
    rows = pushes.get("rows") or []
    if rows:
        gb = (pushes.get("model_bytes") or 0) / 1e9
        lines += [f"Model {gb:.2f} GB, {rows[0]['buckets']} buckets of {res.get('bucket_MiB')} MiB, TP=2, "
                  f"in place. Levels: {', '.join(pushes.get('levels') or [])}.", "",
                  "| push | verified | level | all-gathers | push s | GB/s | sync_seconds | GB/s (sync_seconds) "
                  "| sync phases (ms) |", "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            ph = r.get("sync_phases") or {}
            phs = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in ph.items()) or "–"
            ag = r.get("all_gathers") or {}
            lines.append(f"| {r['version']} | {r['verified']} | {r['level']} | {ag.get('into')} (+{ag.get('list')} per tensor) "
                         f"| {_f(r['push_s'], 4)} | {_f(r['GBps'])} | "
                         f"{_f(r.get('sync_seconds'), 4)} | {_f(r.get('GBps_sync_seconds'))} | {phs} |")
        lines += ["", f"- verified, median after the first: **{_f(pushes.get('verified_after_first_GBps_median'))} GB/s**",
                  f"- unverified, median: **{_f(pushes.get('unverified_GBps_median'))} GB/s**"]
        for rank, peaks in (pushes.get("peak_extra_MiB") or {}).items():
            lines.append(f"- {rank} peak extra memory per push (MiB): {peaks}")
    for g in res.get("ranks") or []:
        e = g.get("export_only")
        if e and e.get("seconds"):
            lines.append(f"- rank {g.get('rank')}: export alone (the gathers) {e['bytes'] / 1e9:.2f} GB in "
                         f"{e['seconds']:.4f} s = {e['bytes'] / e['seconds'] / 1e9:.0f} GB/s")
    s = res.get("summary") or {}
    if s:
        lines.append(f"- steps {s.get('steps')}, medians after the first: " + ", ".join(
            f"{k} {_f(v, 4)}" for k, v in (s.get("median_after_first") or {}).items()))
    return lines + _errors(res)


def dp_equal(res: dict) -> list[str]:
    lines = ["## dp2_equal: megatron DP=2 vs one rank with the whole batch", ""]
    c = res.get("compare")
    if c:
        lines += [f"fp32, TF32 off, {c['tokens']} tokens, {c['tensors']} gradient tensors; tolerance "
                  f"{res.get('tolerance')}: **{'equal' if res.get('equal_within_tolerance') else 'NOT equal'}**", "",
                  f"- max |Δ log-prob| {c['max_abs_logprob_diff']:.2e}, max |Δ grad| {c['max_abs_grad_diff']:.2e}",
                  f"- loss {c['loss'][0]:.7f} / {c['loss'][1]:.7f} (|Δ| {c['loss_abs_diff']:.1e}); grad norm "
                  f"{c['grad_norm'][0]:.7f} / {c['grad_norm'][1]:.7f} (relative {c['grad_norm_rel_diff']:.1e})",
                  f"- the replicas' sequences: {c['shares']}; layout {c['layout']}"]
    return lines + _errors(res)


def train(res: dict) -> list[str]:
    lines = [f"## {res.get('part')}: training", ""]
    rows = res.get("metrics") or []
    if rows:
        lines += ["| step | reward | " + " | ".join(k.replace("_seconds", " s") for k in PHASE_KEYS)
                  + " | sync level | log-prob mismatch |", "|---" * (len(PHASE_KEYS) + 4) + "|"]
        for i, r in enumerate(rows, 1):
            lines.append(f"| {i} | {_f(r.get('reward_mean'))} | " + " | ".join(_f(r.get(k), 4) for k in PHASE_KEYS)
                         + f" | {r.get('sync_level')} | {_f(r.get('logprob_mismatch_max'))} |")
        s = res.get("summary") or {}
        lines += ["", "- medians after the first step: " + ", ".join(
            f"{k} {_f(v, 4)}" for k, v in (s.get("median_after_first") or {}).items())]
        layout = next((g.get("layout") for g in res.get("ranks") or [] if g.get("layout")), None)
        lines.append(f"- layout {layout}; all pushes verified {s.get('sync_all_verified')}")
    return lines + _errors(res)


SECTIONS = {"d2d": d2d, "sync_large": sync, "sync_large_in_place": sync, "sync_big_in_place": sync, "dp2_equal": dp_equal, "dp2_train": train}


def main(out_dir: str) -> str:
    out = Path(out_dir)
    lines = ["# two GPUs: gather per bucket, sync, megatron DP=2", ""]
    for part, fn in SECTIONS.items():
        path = out / f"{part}.json"
        if not path.is_file():
            continue
        res = json.loads(path.read_text())
        lines += fn(res)
        lines += [f"- part seconds {_f(res.get('part_seconds'), 4)}; megatron-core {res.get('megatron_core')}, "
                  f"torch {res.get('torch')}, python {res.get('python')}", ""]
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


if __name__ == "__main__":
    print(main(sys.argv[1]))
