"""The fused-loss head (Cap.FUSED_LOSS) against the GEMM floors, today's fused head + torch loss
and Liger's fused linear GRPO loss, in one process on one GPU. Measures, never asserts.

Per T (--tokens), H=4096, V=151936, bf16, PPO-clip with dual-clip (ε 0.2/0.28, c=3) and an
entropy bonus 1e-3, token-mean aggregation:

* ``floor4``  cuBLAS X·Wᵀ, X·Wᵀ again (the backward's recompute), dZ·W, dZᵀ·X (fp32 reductions)
* ``floor3``  the same without the recompute: what a head that knows the loss needs
* ``fused_loss``  FusedHead(backend=triton) given the LossRequest: loss, dX, dW (autograd.grad)
* ``fused+torch_loss``  today's path: FusedHead log-probs/entropy, core's TokenObjective.value, autograd
* ``prev_fused_loss``  the fused-loss head at an earlier git revision (``rlcore_fused_prev``,
  written by make_prev_head.sh and carried), if present
* ``liger_grpo``  LigerFusedLinearGRPOLoss(beta=0, use_ref_model=False), [T/2048, 2048, H] (T=16384 only)

The floors and the heads are timed interleaved (``--rounds`` rounds of ``--reps`` calls each, the
order rotating), so that clock and power drift weighs on all alike; ``x_floor4`` is the median
over rounds of a method's round median divided by floor4's. Plus half the tokens masked, peak
extra memory, a per-kernel profile of one fused-loss call, and gradient accuracy against float64
(``--accuracy`` token counts: one and several token chunks). Writes $OUT/results.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import traceback
from pathlib import Path

import torch
from bench_measure import LOG, free_memory, log, make_inputs, peak_extra, rel_err, sync, time_fn
from rlcore.algorithms import PPOClip, TokenInputs, TokenObjective
from rlcore.algorithms.aggregation import step_weights
from rlcore.types import HeadInput, LossRequest, VocabShard
from rlcore_fused.head import FusedHead
from rlcore_fused.tuning import TritonConfig

try:  # the fused head as it was before this change (bench/run_on_gpu_loss.sh builds it from git)
    from rlcore_fused_prev.head import FusedHead as PrevFusedHead
except ImportError:
    PrevFusedHead = None

OBJECTIVE = TokenObjective(PPOClip(0.2, 0.28, 3.0), entropy_coef=1e-3)


def floor_fns(x, w):
    """The floors as callables over one shared [T, V] bf16 buffer (kept alive by the closures)."""
    T, V = x.shape[0], w.shape[0]
    z = torch.empty(T, V, device=x.device, dtype=x.dtype)
    dx = torch.empty_like(x)
    dw = torch.empty_like(w)
    m = torch.backends.cuda.matmul

    def seq(recompute):
        torch.mm(x, w.t(), out=z)
        if recompute:
            torch.mm(x, w.t(), out=z)
        torch.mm(z, w, out=dx)
        prev = m.allow_bf16_reduced_precision_reduction
        m.allow_bf16_reduced_precision_reduction = False
        torch.mm(z.t(), x, out=dw)
        m.allow_bf16_reduced_precision_reduction = prev

    return {"floor4": lambda: seq(True), "floor3": lambda: seq(False)}


def interleaved(fns: dict, device, rounds: int, reps: int) -> dict:
    """Every method timed ``reps`` calls per round, the methods in a rotating order, ``rounds``
    rounds: clock and power drift weighs on all alike. Median and min per method, and the median
    over rounds of each method's round median divided by floor4's."""
    for name in list(fns):  # warm-up (compiles, cuBLAS heuristics, allocator); a failing method is reported
        try:
            fns[name]()
        except Exception:  # noqa: BLE001
            log(f"  {name} failed, left out:\n{traceback.format_exc()}")
            del fns[name]
    sync(device)
    names = list(fns)
    times: dict[str, list[float]] = {k: [] for k in names}
    per_round: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            got = []
            for _ in range(reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fns[name]()
                b.record()
                b.synchronize()
                got.append(a.elapsed_time(b))
            times[name] += got
            per_round[name].append(statistics.median(got))
    out = {}
    for k in names:
        out[k] = {"ms": statistics.median(times[k]), "min_ms": min(times[k]), "max_ms": max(times[k]),
                  "reps": len(times[k])}
        if "floor4" in per_round:
            ratios = [a / b for a, b in zip(per_round[k], per_round["floor4"], strict=True)]
            out[k]["x_floor4_rounds"] = ratios
            out[k]["x_floor4"] = statistics.median(ratios)
        log(f"  {k}: {out[k]['ms']:.2f} ms (min {out[k]['min_ms']:.2f}, max {out[k]['max_ms']:.2f}, "
            f"{len(times[k])} calls) x floor4 {out[k].get('x_floor4', math.nan):.3f}")
    return out


def token_inputs(h, w, labels, mask, device):
    """Old log-probs = the current ones + N(0, 0.3²) noise: ratios spread around 1 (both clip
    branches active); advantages N(0, 1); token-mean weights."""
    T = h.shape[0]
    g = torch.Generator(device=device).manual_seed(3)
    with torch.no_grad():
        lp = FusedHead(backend="triton")(HeadInput(hidden=h, weight=w, labels=labels, vocab=VocabShard.full(w.shape[0]),
                                                   loss_mask=mask, compute_entropy=False)).logprobs
    m = torch.ones(T, dtype=torch.bool, device=device) if mask is None else mask
    sw = step_weights("token-mean", m, torch.zeros(T, dtype=torch.long, device=device), 1)
    old = torch.where(m, lp + 0.3 * torch.randn(T, device=device, generator=g), torch.zeros_like(lp))
    return TokenInputs(old_logprobs=old, rollout_logprobs=old, advantages=torch.randn(T, device=device, generator=g),
                       mask=m, weights=sw.numerator / sw.divisor, correction=None, ref_logprobs=None,
                       seq_index=torch.zeros(T, dtype=torch.long, device=device), seq_tokens=m.sum().float()[None])


def fused_loss_call(head, h, w, labels, mask, x):
    out = head(HeadInput(hidden=h, weight=w, labels=labels, vocab=VocabShard.full(w.shape[0]), loss_mask=mask,
                         loss=LossRequest(OBJECTIVE, x)))
    return torch.autograd.grad(out.loss, (h, w))


def torch_loss_call(head, h, w, labels, mask, x):
    out = head(HeadInput(hidden=h, weight=w, labels=labels, vocab=VocabShard.full(w.shape[0]), loss_mask=mask))
    loss = (OBJECTIVE.value(out.logprobs, out.entropy, x) * x.weights).sum()
    return torch.autograd.grad(loss, (h, w))


def liger_call(h, w, labels, x, seq_len=2048):
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    T, H = h.shape
    B = T // seq_len
    fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, epsilon_low=0.2, epsilon_high=0.28, loss_type="dapo")
    ids = labels.view(B, seq_len)
    am = x.mask.view(B, seq_len).long()
    adv = x.advantages.view(B, seq_len)[:, 0].contiguous()
    old = x.old_logprobs.view(B, seq_len)

    def call():
        res = fn(h.view(B, seq_len, H), w, ids, am, adv, old_per_token_logps=old)
        loss = res[0] if isinstance(res, tuple) else res
        return torch.autograd.grad(loss, (h, w))

    return call


def measure(name, fn, device, reps_budget=2.5):
    res = {"method": name}
    try:
        res.update(time_fn(fn, device, budget_s=reps_budget))
        res["extra_gib"] = peak_extra(fn, device)
        log(f"  {name}: {res['ms']:.2f} ms (min {res['min_ms']:.2f}, {res['reps']} reps), extra {res['extra_gib']:.3f} GiB")
    except Exception as exc:  # noqa: BLE001 - a failing method is reported, not fatal
        res["error"] = f"{type(exc).__name__}: {exc}"
        log(traceback.format_exc())
    free_memory(device)
    return res


def profile_parts(head, h, w, labels, mask, x, device, trace=None):
    """CUDA time per kernel name over one fused-loss call (all streams), their total, and the
    call's wall time under the profiler; ``trace``: also write the host and device timeline
    (Chrome trace, gzipped) there."""
    import gzip
    import os

    from torch.profiler import ProfilerActivity, profile

    fused_loss_call(head, h, w, labels, mask, x)
    sync(device)
    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if trace else [])
    with profile(activities=acts) as prof:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fused_loss_call(head, h, w, labels, mask, x)
        b.record()
        sync(device)
    parts: dict[str, float] = {}
    counts: dict[str, int] = {}
    if trace:
        tmp = f"{trace}.tmp.json"
        prof.export_chrome_trace(tmp)
        with open(tmp, "rb") as src, gzip.open(f"{trace}.json.gz", "wb") as dst:
            dst.write(src.read())
        os.remove(tmp)
    for e in prof.key_averages():
        if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CPU"):
            continue
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if t <= 0:
            continue
        parts[e.key[:90]] = parts.get(e.key[:90], 0.0) + t / 1e3
        counts[e.key[:90]] = counts.get(e.key[:90], 0) + int(e.count)
    top = dict(sorted(parts.items(), key=lambda kv: -kv[1])[:14])
    for k, v in top.items():
        log(f"    {v:9.2f} ms  ({counts[k]:4d}x) {k}")
    total = sum(parts.values())
    log(f"    kernels total {total:.2f} ms ({sum(counts.values())} launches), wall {a.elapsed_time(b):.2f} ms")
    return {"top": top, "counts": {k: counts[k] for k in top}, "total_ms": total, "launches": sum(counts.values()),
            "wall_ms": a.elapsed_time(b)}


def phase_times(head, h, w, labels, mask, x, device, reps=3):
    """Where one fused-loss call's time goes on the main stream, without the profiler: the head's
    kernels record a CUDA event after each phase of every chunk (``TritonKernels.phase_log``);
    per phase the sum over chunks of the time from the previous mark, the median over ``reps``
    calls. ``host_start``: call start to the first chunk (host setup, the mask's sync);
    ``tail``: the last GEMM's end to the call's end (outputs, autograd backward); a phase whose
    kernel had to wait (the ∂L/∂logits kernel for the side stream's objective) includes the wait."""
    kern = head.kernels_for(h.device)
    fused_loss_call(head, h, w, labels, mask, x)
    sync(device)
    runs = []
    for _ in range(reps):
        kern.phase_log = []
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fused_loss_call(head, h, w, labels, mask, x)
        b.record()
        b.synchronize()
        marks, kern.phase_log = kern.phase_log, None
        sums: dict[str, float] = {}
        prev = a
        for label, ev in marks:
            key = "host_start" if label == "setup" else label
            sums[key] = sums.get(key, 0.0) + prev.elapsed_time(ev)
            prev = ev
        sums["tail"] = prev.elapsed_time(b)
        sums["total"] = a.elapsed_time(b)
        runs.append(sums)
    out = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in runs[0]}
    log("    " + ", ".join(f"{k} {v:.2f}" for k, v in out.items()))
    return out


def grad_accuracy(device, H, V, T):
    """dX, dW, log-prob, entropy against float64 autograd of the same objective."""
    h, w, labels, _, _ = make_inputs(T, H, V, device, seed=7)
    x = token_inputs(h, w, labels, None, device)
    hd = h.double().requires_grad_(True)
    wd = w.double().requires_grad_(True)
    z = hd @ wd.t()
    lp_all = torch.log_softmax(z, dim=-1)
    lp = lp_all.gather(1, labels[:, None]).squeeze(1)
    ent = -(lp_all.exp() * lp_all).sum(-1)
    xd = TokenInputs(**{k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                        for k, v in x.__dict__.items()})
    loss = (OBJECTIVE.value(lp, ent, xd) * xd.weights).sum()
    gx, gw = torch.autograd.grad(loss, (hd, wd))
    lp, ent = lp.detach(), ent.detach()
    del z, lp_all
    free_memory(device)
    out = {"T": T, "rounded_to_bf16": {"dX": rel_err(gx.to(h.dtype), gx), "dW": rel_err(gw.to(w.dtype), gw)}}
    heads = {"fused_loss": FusedHead(backend="triton"), "fused+torch_loss": FusedHead(backend="triton"),
             "fused_loss_dw_fp32": FusedHead(backend="triton", triton_config=TritonConfig(loss_dw_fp32=True)),
             "fused_loss_eager_objective": FusedHead(backend="triton",
                                                     triton_config=TritonConfig(loss_compile_objective=False))}
    if PrevFusedHead is not None:
        heads["prev_fused_loss"] = PrevFusedHead(backend="triton")
    for name, head in heads.items():
        hh, ww = h.detach().requires_grad_(True), w.detach().requires_grad_(True)
        inp = HeadInput(hidden=hh, weight=ww, labels=labels, vocab=VocabShard.full(V))
        if "fused_loss" in name:
            inp.loss = LossRequest(OBJECTIVE, x)
        try:
            o = head(inp)
            loss_v = o.loss if o.loss is not None else (OBJECTIVE.value(o.logprobs, o.entropy, x) * x.weights).sum()
            a, b = torch.autograd.grad(loss_v, (hh, ww))
        except Exception:  # noqa: BLE001 - a failing head is reported, not fatal
            log(f"  accuracy T={T} {name} failed:\n{traceback.format_exc()}")
            continue
        out[name] = {"dX": rel_err(a, gx), "dW": rel_err(b, gw), "logprob": rel_err(o.logprobs.detach(), lp),
                     "entropy": rel_err(o.entropy.detach(), ent), "loss": abs(float(loss_v) - float(loss)) / abs(float(loss))}
        log(f"  accuracy T={T} {name}: {out[name]}")
    log(f"  accuracy T={T} float64 rounded to bf16: {out['rounded_to_bf16']}")
    return out


def parse_variant(spec: str) -> TritonConfig:
    """``block:warps:chunk_mib:dw_fp32[:overlap[:compile_objective[:pipeline]]]``"""
    f = spec.split(":")
    return TritonConfig(loss_block=int(f[0]), loss_warps=int(f[1]), loss_chunk_mib=float(f[2]),
                        loss_dw_fp32=f[3] == "1", loss_overlap=(f[4] != "0") if len(f) > 4 else True,
                        loss_compile_objective=(f[5] == "1") if len(f) > 5 else TritonConfig.loss_compile_objective,
                        **({"loss_pipeline": f[6]} if len(f) > 6 else {}))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="16384")
    ap.add_argument("--out", default="/tmp/bench-fused-loss")
    ap.add_argument("--liger", action="store_true")
    ap.add_argument("--masked", action="store_true")
    ap.add_argument("--accuracy", default="1024,4096")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--phases", action="store_true", help="per-phase CUDA-event times of one call (phase_times)")
    ap.add_argument("--variants-everywhere", action="store_true", help="time the variants at every T and case")
    ap.add_argument("--torch-loss", action="store_true", help="also time today's fused head + torch loss")
    ap.add_argument("--variants", default="",
                    help="at T=16384: ';'-separated block:warps:chunk_mib:dw_fp32[:overlap[:compile[:pipeline]]] configs")
    ap.add_argument("--rounds", default="4096:6,16384:5,65536:2", help="interleaved rounds per T (T:rounds,...)")
    ap.add_argument("--reps", type=int, default=3, help="calls per method per round")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    H, V = 4096, 151936
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "python": platform.python_version(), "H": H, "V": V, "runs": [],
           "argv": sys.argv, "prev_head": PrevFusedHead is not None}
    try:
        import triton
        res["triton"] = triton.__version__
    except ImportError:
        pass
    head = FusedHead(backend="triton")
    prev = PrevFusedHead(backend="triton") if PrevFusedHead is not None else None
    rounds = {int(k): int(r) for k, r in (p.split(":") for p in args.rounds.split(","))}

    def save():
        res["log"] = LOG
        (out_dir / "results.json").write_text(json.dumps(res, indent=1))

    def bench_tokens(T):
        log(f"== T={T}")
        h, w, labels, _, _ = make_inputs(T, H, V, device)
        h.requires_grad_(True)
        w.requires_grad_(True)
        run = {"T": T, "cases": {}}
        cases = [("all", None)]
        if args.masked:
            g = torch.Generator(device=device).manual_seed(5)
            cases.append(("half_masked", torch.rand(T, device=device, generator=g) < 0.5))
        fl = floor_fns(h.detach(), w.detach())
        for case, mask in cases:
            x = token_inputs(h.detach(), w.detach(), labels, mask, device)
            variant_heads = {}
            if (case == "all" and T == 16384) or args.variants_everywhere:
                variant_heads = {spec: FusedHead(backend="triton", triton_config=parse_variant(spec))
                                 for spec in filter(None, args.variants.split(";"))}
            if args.phases:
                log(f" case {case}: phases of one call (ms, main stream), median of 3 calls")
                run.setdefault("phases", {})[case] = {"fused_loss": phase_times(head, h, w, labels, mask, x, device)}
                for spec, vh in variant_heads.items():
                    log(f"   [{spec}]")
                    run["phases"][case][spec] = phase_times(vh, h, w, labels, mask, x, device)
                free_memory(device)
            fns = dict(fl)
            fns["fused_loss"] = lambda m=mask, x=x: fused_loss_call(head, h, w, labels, m, x)
            if prev is not None:
                fns["prev_fused_loss"] = lambda m=mask, x=x: fused_loss_call(prev, h, w, labels, m, x)
            if args.torch_loss:
                fns["fused+torch_loss"] = lambda m=mask, x=x: torch_loss_call(head, h, w, labels, m, x)
            for spec, vh in variant_heads.items():
                fns[f"fused_loss[{spec}]"] = lambda vh=vh, m=mask, x=x: fused_loss_call(vh, h, w, labels, m, x)
            log(f" case {case}: interleaved, {rounds.get(T, 2)} rounds x {args.reps} calls")
            timed = interleaved(fns, device, rounds.get(T, 2), args.reps)
            for name in fns:
                if not name.startswith("floor"):
                    timed[name]["extra_gib"] = peak_extra(fns[name], device)
                    log(f"  {name}: extra {timed[name]['extra_gib']:.3f} GiB")
            run["cases"][case] = timed
            if args.liger and case == "all" and T == 16384:
                r = measure("liger_grpo", liger_call(h, w, labels, x), device, reps_budget=1.0)
                f4 = timed["floor4"]["ms"]
                r["x_floor4"] = r.get("ms", math.nan) / f4
                run["liger"] = r
            save()
        del fl
        free_memory(device)
        if args.profile and T == 16384:
            x = token_inputs(h.detach(), w.detach(), labels, None, device)
            run["profile_ms"] = profile_parts(head, h, w, labels, None, x, device, out_dir / "trace_fused_loss")
            if prev is not None:
                log(" profile of the previous head:")
                run["profile_prev_ms"] = profile_parts(prev, h, w, labels, None, x, device,
                                                       out_dir / "trace_prev_fused_loss")
        res["runs"].append(run)
        save()
    for T in [int(t) for t in args.tokens.split(",")]:
        bench_tokens(T)  # its tensors are freed when it returns
        free_memory(device)
    for T in [int(t) for t in args.accuracy.split(",") if t]:
        res.setdefault("accuracy", []).append(grad_accuracy(device, H, V, T))
        free_memory(device)
        save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
