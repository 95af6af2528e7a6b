"""Weight sync at copy speed, on one GPU, in one call (issue 31 items 2-3, issue 32 item 3).

Three parts, each bounded in time, results in ``--out``:

1. ``kernels`` (this process): the device-to-device copy bandwidth of one buffer; then, over the
   tensors of a dense (111 tensors) and a MoE (1,651 tensors) model as the two-process bench lays
   them out: a plain copy (``_foreach_copy_``), the fused copy-and-checksum
   (:class:`rlcore.checksums.ChecksumSlots`, its chunk table prepared once, as a receiver with
   fixed destinations would run it), the copy followed by a separate checksum pass (what
   ``coverage+exact`` costs today), and the read-only checksum. The Triton values are checked
   equal to the torch path's and to ``tensor_checksum`` on every tensor; the kernels' warm-up
   (compile) and the first launch after it are timed.
2. ``mapped``: ``plugins/ray/bench/bench_transport_mapped_gpu.py`` (two processes, the trainer's
   parameters lent to a replica: unverified and ``coverage+exact`` pushes) on the dense and MoE
   models.
3. ``runs``: short real runs, ``rlcore train`` (hf engine on the device, local rollout, ``inproc``
   verified; ``sync.name=mapped`` needs Ray, which the GPU machine does not carry) with models of
   about 0.4, 2 and 8 GB created from configs (random weights, fp32), 3 steps of tiny batches;
   each step's push phases (``sync/<phase>_seconds``) from ``metrics.jsonl``.

Writes ``sync_speed.json`` and ``sync_speed.md`` (the per-phase push table) to ``--out``.

    python scripts/gpu/sync_speed.py --out DIR                       # the GPU call
    python scripts/gpu/sync_speed.py --out DIR --device cpu --tiny   # a CPU check of the script
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
PHASES = ("control", "sender_checksum", "copy", "wait", "receiver_checksum", "commit")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median seconds of ``fn`` (device synchronised around each call)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def kernels_part(dev: torch.device, tiny: bool, repeats: int) -> dict:
    sys.path.insert(0, str(ROOT / "plugins" / "ray" / "bench"))
    from bench_transport_mapped_gpu import model_shapes
    from rlcore.sync import warm_checksum_kernels

    res: dict = {}
    t0 = time.perf_counter()
    res["warm_did_compile"] = warm_checksum_kernels(dev)
    res["warm_s"] = time.perf_counter() - t0
    res["d2d"] = d2d_copy(dev, (64 << 20) if tiny else (2 << 30), 3 if tiny else 10)
    for kind in ("dense", "moe"):
        res[kind] = layout_row(dev, model_shapes(kind, 0.05 if tiny else 1.0), res["d2d"]["GBps"] * 1e9, repeats)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return res


def d2d_copy(dev: torch.device, nbytes: int, repeats: int) -> dict:
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev).random_()
    b = torch.empty_like(a)
    sec = timed(lambda: b.copy_(a), dev, repeats)
    return {"bytes": nbytes, "median_s": sec, "GBps": nbytes / sec / 1e9}


def layout_row(dev: torch.device, shapes: list, d2d: float, repeats: int) -> dict:
    """One model's tensors: plain copy, fused copy-and-checksum, copy then checksum, checksum alone."""
    from rlcore.sync import ChecksumPlan, ChecksumSlots, tensor_checksum

    g = torch.Generator(device=dev).manual_seed(0)
    src = [torch.randn(sh, generator=g, device=dev, dtype=torch.float32).to(torch.bfloat16) for _, sh in shapes]
    dst = [torch.empty_like(t) for t in src]
    total = sum(t.numel() * t.element_size() for t in src)
    slots = ChecksumSlots(dev, capacity=len(src))
    prep = slots.prepare(list(zip(dst, src, strict=True)), slots._take(src))  # a receiver's fixed destinations
    plan, dst_plan = ChecksumPlan(src), ChecksumPlan(dst)
    _sync(dev)
    t0 = time.perf_counter()
    slots.run_prepared(prep)  # the first launch after the warm-up (no compile expected)
    _sync(dev)
    first_launch = time.perf_counter() - t0

    def fused():
        slots._sums.zero_()
        slots.run_prepared(prep)
        return slots.values()

    def copy_then_sum():
        torch._foreach_copy_(dst, src)
        return dst_plan.compute()

    row = {"tensors": len(src), "bytes": total, "first_fused_launch_s": first_launch}
    for name, fn in (("copy_foreach", lambda: torch._foreach_copy_(dst, src)),
                     ("fused_copy_checksum", fused),
                     ("copy_then_checksum", copy_then_sum),
                     ("checksum_read_only", plan.compute)):
        sec = timed(fn, dev, repeats)
        row[name] = {"median_s": sec, "GBps": total / sec / 1e9, "pct_of_d2d": 100 * total / sec / d2d}
    row["fused_launches"] = slots.launches
    fused_vals = fused()
    torch_slots = ChecksumSlots(dev, capacity=len(src), use_triton=False)
    torch_slots.checksum(src)
    row["triton_equals_torch_path"] = fused_vals == torch_slots.values()
    row["equals_tensor_checksum"] = fused_vals == [tensor_checksum(t) for t in src]
    row["copied_bitwise"] = all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(dst, src, strict=True))
    row["backend"] = plan.backend
    return row


def mapped_part(out: Path, device: str, tiny: bool, timeout: float, repeats: int) -> dict:
    cmd = [sys.executable, str(ROOT / "plugins/ray/bench/bench_transport_mapped_gpu.py"), "--out", str(out / "mapped"),
           "--device", device, "--models", "dense,moe", "--repeats", str(repeats), "--timeout", str(timeout)]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 30)
        log = p.stdout + p.stderr
    except subprocess.TimeoutExpired as exc:
        log = f"TIMEOUT after {timeout + 30} s\n{exc.stdout or ''}{exc.stderr or ''}"
    (out / "mapped_log.txt").write_text(log if isinstance(log, str) else log.decode(errors="replace"))
    res: dict = {"wall_s": time.perf_counter() - t0}
    path = out / "mapped" / "results.json"
    if not path.exists():
        res["error"] = "no results.json (see mapped_log.txt)"
        return res
    full = json.loads(path.read_text())
    for kind in ("dense", "moe"):
        r = full.get(kind, {})
        row = {"d2d_GBps": r.get("d2d_copy", {}).get("GBps")}
        for name, v in list(r.get("mapped", {}).items()) + [("verified", r.get("mapped_verified"))]:
            if v:
                row[name] = {k: v.get(k) for k in ("median_s", "GBps_median", "pct_of_d2d_median", "level")}
        row["corrupted_push_caught"] = r.get("corrupted_push", {}).get("caught")
        for k in ("trainer_crash", "rollout_crash", "error"):
            if k in r:
                row[k] = str(r[k])[-800:]
        res[kind] = row
    return res


def model_for(gbytes: float, tiny: bool) -> dict:
    """A qwen2 config of about ``gbytes`` GB in fp32 (the tiny vocabulary makes the embedding negligible)."""
    if tiny:
        return {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "head_dim": 32,
                "intermediate_size": 128}
    if gbytes <= 1:
        h, i, nh, nkv, hd = 1024, 4096, 16, 4, 64
    elif gbytes <= 4:
        h, i, nh, nkv, hd = 2048, 8192, 16, 4, 128
    else:
        h, i, nh, nkv, hd = 4096, 14336, 32, 8, 128
    per_layer = 4 * (2 * h * nh * hd + 2 * h * nkv * hd + 3 * h * i + 2 * h)
    layers = max(1, round(gbytes * 1e9 / per_layer))
    return {"hidden_size": h, "num_layers": layers, "num_heads": nh, "num_kv_heads": nkv, "head_dim": hd,
            "intermediate_size": i}


def run_part(out: Path, device: str, label: str, gbytes: float, tiny: bool, steps: int, timeout: float,
             extra: list[str]) -> dict:
    model = model_for(gbytes, tiny)
    # the run's own directory (model dirs, the final checkpoint with the optimizer: ~5x the model) stays
    # out of --out and is deleted after; its metrics.jsonl and log come back
    work = Path(os.environ.get("SYNC_SPEED_WORK", "/tmp/sync-speed-work")) / label
    shutil.rmtree(work, ignore_errors=True)
    run_dir = out / "runs" / label
    cmd = [sys.executable, "-m", "rlcore.cli", "train", str(ROOT / "examples" / "tiny.yaml"), "--output", str(work),
           f"engine.device={device}", f"training.steps={steps}", "rollout.n=2", "data.prompts_per_step=2",
           "rollout.max_new_tokens=4", "sync.name=inproc", "sync.verify=true", "sync.bucket_mb=512",
           "output.checkpoint_every=0", "output.export_hf=never", "output.plot=false", "output.tensorboard=false",
           *[f"engine.model.tiny.{k}={v}" for k, v in model.items()], *extra]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        rc, log = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as exc:
        rc, log = "timeout", f"TIMEOUT after {timeout} s\n{exc.stdout or ''}{exc.stderr or ''}"
    if not isinstance(log, str):
        log = log.decode(errors="replace")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "log.txt").write_text(log[-20000:])
    res: dict = {"model": model, "target_GB": gbytes, "rc": rc, "wall_s": time.perf_counter() - t0, "extra": extra}
    if (work / "metrics.jsonl").exists():
        shutil.copy(work / "metrics.jsonl", run_dir / "metrics.jsonl")
    shutil.rmtree(work, ignore_errors=True)
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        res["steps"] = [{"step": r.get("step"), "sync_seconds": r.get("sync_seconds"), "sync_bytes": r.get("sync_bytes"),
                         "sync_buckets": r.get("sync_buckets"), "sync_level": r.get("sync_level"),
                         **{p: r.get(f"sync/{p}_seconds") for p in PHASES}} for r in rows]
    return res


def markdown(res: dict) -> str:
    lines = [f"# sync speed, {res['date_utc']}, {res['device_name']}, torch {res['torch']}", ""]
    k = res.get("kernels", {})
    d2d = k.get("d2d", {}).get("GBps")
    if d2d:
        lines += [f"D2D copy of one {k['d2d']['bytes'] / 2**30:.2f} GiB buffer: **{d2d:.0f} GB/s**; checksum kernels "
                  f"warmed in {k['warm_s']:.2f} s (compiled: {k['warm_did_compile']}).", "",
                  "| layout | tensors | GB | copy (foreach) | fused copy+checksum | copy, then checksum | checksum alone "
                  "| first fused launch ms | Triton = torch = tensor_checksum |", "|---|---|---|---|---|---|---|---|---|"]
        for kind in ("dense", "moe"):
            r = k.get(kind)
            if not r:
                continue
            cells = [f"{r[n]['GBps']:.0f} GB/s ({r[n]['pct_of_d2d']:.0f} %)" for n in
                     ("copy_foreach", "fused_copy_checksum", "copy_then_checksum", "checksum_read_only")]
            lines.append(f"| {kind} | {r['tensors']} | {r['bytes'] / 1e9:.2f} | " + " | ".join(cells) +
                         f" | {1e3 * r['first_fused_launch_s']:.2f} | {r['triton_equals_torch_path']} / "
                         f"{r['equals_tensor_checksum']} (bitwise copy {r['copied_bitwise']}) |")
        lines.append("")
    m = res.get("mapped", {})
    if m:
        lines += ["Two processes, `MappedSender`/`MappedReceiver` (median push):", "",
                  "| model | path | ms | GB/s | % of D2D | level |", "|---|---|---|---|---|---|"]
        for kind in ("dense", "moe"):
            for name, v in (m.get(kind) or {}).items():
                if isinstance(v, dict) and v.get("median_s"):
                    lines.append(f"| {kind} | {name} | {1e3 * v['median_s']:.2f} | {v['GBps_median']:.0f} | "
                                 f"{v['pct_of_d2d_median']:.0f} | {v.get('level')} |")
        lines.append("")
    runs = res.get("runs", {})
    if runs:
        lines += ["Real runs (`rlcore train`, hf engine, local rollout, inproc verified; host ms per phase):", "",
                  "| run | GB | step | push ms | GB/s | % of D2D | " + " | ".join(PHASES) + " | level |",
                  "|---|---|---|---|---|---|" + "---|" * len(PHASES) + "---|"]
        for label, r in runs.items():
            for s in r.get("steps", []):
                if not s.get("sync_seconds"):
                    continue
                gbps = s["sync_bytes"] / s["sync_seconds"] / 1e9
                pct = f"{100 * gbps / d2d:.0f}" if d2d else ""
                lines.append(f"| {label} | {s['sync_bytes'] / 1e9:.2f} | {s['step']} | {1e3 * s['sync_seconds']:.1f} | "
                             f"{gbps:.0f} | {pct} | " + " | ".join(f"{1e3 * (s[p] or 0):.1f}" for p in PHASES) +
                             f" | {s['sync_level']} |")
            if r.get("skipped"):
                lines.append(f"| {label} | skipped: {r['skipped']} |" + " |" * (5 + len(PHASES)))
            elif not r.get("steps"):
                lines.append(f"| {label} | FAILED (rc {r.get('rc')}, see runs/{label}/log.txt) |" + " |" * (5 + len(PHASES)))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small sizes: a CPU check of the script")
    ap.add_argument("--parts", default="kernels,mapped,runs")
    ap.add_argument("--sizes", default="0.4,2,8")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget", type=float, default=225.0, help="seconds for the whole script")
    args = ap.parse_args()
    t_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(args.device)
    res: dict = {"command": " ".join([sys.executable, *sys.argv]), "torch": torch.__version__,
                 "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                 "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}

    def save() -> None:
        (out / "sync_speed.json").write_text(json.dumps(res, indent=1, default=str))
        (out / "sync_speed.md").write_text(markdown(res))

    def left() -> float:
        return args.budget - (time.perf_counter() - t_start)

    parts = args.parts.split(",")
    if "kernels" in parts:
        try:
            res["kernels"] = kernels_part(dev, args.tiny, 3 if args.tiny else 5)
        except Exception as exc:  # noqa: BLE001 - the other parts still run
            res["kernels"] = {"error": f"{type(exc).__name__}: {exc}"}
        print("kernels", json.dumps(res["kernels"], default=str)[:3000], flush=True)
        save()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    if "mapped" in parts and left() > 60:
        res["mapped"] = mapped_part(out, args.device, args.tiny, min(70.0, left() - 40), 3)
        print("mapped", json.dumps(res["mapped"], default=str)[:3000], flush=True)
        save()
    if "runs" in parts:
        res["runs"] = {}
        sizes = [float(x) for x in args.sizes.split(",")]
        mid = sorted(sizes)[len(sizes) // 2]  # last: the sizes come first when the budget runs short
        plan = [(f"{g:g}GB", g, []) for g in sizes] + [(f"{mid:g}GB_in_place", mid, ["rollout.local_update=in_place"])]
        for label, g, extra in plan:
            if left() < 20:
                res["runs"][label] = {"skipped": f"{left():.0f} s left of --budget"}
                continue
            res["runs"][label] = run_part(out, args.device, label, g, args.tiny, args.steps, left() - 5, extra)
            print(label, json.dumps(res["runs"][label], default=str)[:2000], flush=True)
            save()
    res["wall_s"] = time.perf_counter() - t_start
    save()
    print(markdown(res), flush=True)


if __name__ == "__main__":
    main()
