"""Side-by-side benchmark of the fused head (one process, one GPU, everything in one run).

For T in --tokens (default 4096, 16384, 65536), H=4096, V=151936, bf16, it measures

* ``fused``   rlcore-fused's Triton head (log-prob + entropy, gradients of both);
* ``naive``   torch: bf16 logits → fp32 → log_softmax → gather / entropy (skipped where it cannot fit);
* ``floor``   the bare cuBLAS GEMMs of the same shapes: forward X·Wᵀ; backward = recompute X·Wᵀ,
  dX = dZ·W, dW = dZᵀ·X (the 8·T·H·V FLOPs every exact method has to do);
* ``liger``   Liger's Triton fused linear cross-entropy (reduction="none"; no entropy);
* ``cce``     cut-cross-entropy (reduction="none"; no entropy; gradient filtering on, its default,
  and ``cce-exact`` with filtering off);
* ``verl``    verl's Triton linear_cross_entropy (log-prob + entropy), loaded from its wheel.

Per method: forward and forward+backward time (median of CUDA-event timings), peak extra memory
(peak allocated minus inputs and the returned gradients), relative error of log-prob and entropy
against float64 on a row subset. Then the fused head with half the tokens masked and with
temperature 0.7, the gradients' errors against float64 (T=1024), and a sweep of tile configs.

Writes $OUT/results.json and $OUT/bench.log; prints a short table last. Measures, never asserts.
``--dry-run`` runs the same code on tiny shapes on CPU (Triton interpreter) to check the script.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

# the benchmark's own modules, next to this script (which Python puts first on sys.path)
from bench_measure import (
    LOG,
    GiB,
    float64_reference,
    free_memory,
    log,
    make_inputs,
    peak_extra,
    rel_err,
    sync,
    time_fn,
)
from bench_methods import CCE, Fused, Liger, Method, Naive, Verl
from rlcore.types import HeadInput
from rlcore_fused.head import FusedHead
from rlcore_fused.tuning import TileConfig, TritonConfig

# --------------------------------------------------------------------------- runs ---------


def run_method(method: Method, h, w, labels, g_lp, g_ent, subset, ref, device, with_backward=True) -> dict:
    res: dict = {"method": method.name}
    hg = h.detach().requires_grad_()
    wg = w.detach().requires_grad_()

    def fwd():
        return method.forward(hg, wg, labels)

    def fwd_bwd():
        lp, ent = method.forward(hg, wg, labels)
        outs, grads = [lp], [g_lp]
        if ent is not None:
            outs.append(ent)
            grads.append(g_ent)
        return torch.autograd.grad(outs, [hg, wg], grads)

    try:
        lp, ent = fwd()
        sel = subset
        res["logprob_rel_err"] = rel_err(lp.detach()[sel], ref[0])
        res["logprob_max_abs_err"] = float((lp.detach()[sel].double() - ref[0]).abs().max())
        if ent is not None:
            res["entropy_rel_err"] = rel_err(ent.detach()[sel], ref[1])
            res["entropy_max_abs_err"] = float((ent.detach()[sel].double() - ref[1]).abs().max())
        del lp, ent
        free_memory(device)
        res["fwd"] = time_fn(fwd, device)
        res["fwd_extra_gib"] = peak_extra(lambda: [t for t in fwd() if t is not None], device)
        if with_backward:
            res["fwd_bwd"] = time_fn(fwd_bwd, device, budget_s=2.5)
            res["fwd_bwd_extra_gib"] = peak_extra(fwd_bwd, device)
    except torch.cuda.OutOfMemoryError as exc:
        res["error"] = f"out of memory: {str(exc).splitlines()[0]}"
    except Exception as exc:  # noqa: BLE001 - a competitor failing is a result, not a crash
        res["error"] = f"{type(exc).__name__}: {exc}"
        log(traceback.format_exc())
    free_memory(device)
    return res


def floor_sequence(x, w, z, dx, dw):
    """The GEMMs an exact fused head must run: forward X·Wᵀ, then in backward the recompute and
    dX = dZ·W, dW = dZᵀ·X (dW with fp32 reductions, as the fused head asks of cuBLAS)."""
    m = torch.backends.cuda.matmul
    prev = m.allow_bf16_reduced_precision_reduction
    torch.mm(x, w.t(), out=z)
    torch.mm(x, w.t(), out=z)
    torch.mm(z, w, out=dx)
    m.allow_bf16_reduced_precision_reduction = False
    torch.mm(z.t(), x, out=dw)
    m.allow_bf16_reduced_precision_reduction = prev


def floor_times(T, H, V, device, dtype=torch.bfloat16) -> dict:
    """The bare cuBLAS GEMMs of the same shapes (random operands): each timed alone, and the
    forward+backward sequence timed as one call, the way the methods are timed."""
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(T, H, device=device, generator=g).to(dtype)
    w = (torch.randn(V, H, device=device, generator=g) / math.sqrt(H)).to(dtype)
    z = torch.empty(T, V, device=device, dtype=dtype)
    dx = torch.empty(T, H, device=device, dtype=dtype)
    dw = torch.empty(V, H, device=device, dtype=dtype)
    out = {"fwd": time_fn(lambda: torch.mm(x, w.t(), out=z), device)}
    # z now holds logits: a realistic (non-zero) dZ operand for the gradient GEMMs
    out["dx"] = time_fn(lambda: torch.mm(z, w, out=dx), device)
    out["dw_default"] = time_fn(lambda: torch.mm(z.t(), x, out=dw), device)
    m = torch.backends.cuda.matmul if device.type == "cuda" else None
    if m is not None:
        prev = m.allow_bf16_reduced_precision_reduction
        m.allow_bf16_reduced_precision_reduction = False
        out["dw_fp32_reduction"] = time_fn(lambda: torch.mm(z.t(), x, out=dw), device)
        m.allow_bf16_reduced_precision_reduction = prev
    else:
        out["dw_fp32_reduction"] = out["dw_default"]
    out["sequence"] = time_fn(lambda: floor_sequence(x, w, z, dx, dw), device, budget_s=2.5)
    out["floor_fwd_ms"] = out["fwd"]["ms"]
    out["floor_fwd_bwd_ms"] = out["sequence"]["ms"]
    out["floor_fwd_bwd_sum_of_parts_ms"] = 2 * out["fwd"]["ms"] + out["dx"]["ms"] + out["dw_fp32_reduction"]["ms"]
    out["floor_fwd_bwd_default_reduction_ms"] = 2 * out["fwd"]["ms"] + out["dx"]["ms"] + out["dw_default"]["ms"]
    flops = 2 * T * H * V
    out["fwd_tflops"] = flops / out["fwd"]["ms"] / 1e9
    return out  # the operands are freed with this frame


def head_to_head(T, H, V, device, rounds=3, dtype=torch.bfloat16) -> dict:
    """The fused head and the floor timed alternately (``rounds`` times each, same inputs), so
    that clock and power drift over the run weighs on both alike; medians over the rounds."""
    h, w, labels, g_lp, g_ent = make_inputs(T, H, V, device, seed=17)
    z = torch.empty(T, V, device=device, dtype=dtype)
    dx = torch.empty(T, H, device=device, dtype=dtype)
    dw = torch.empty(V, H, device=device, dtype=dtype)
    hg, wg = h.detach().requires_grad_(), w.detach().requires_grad_()
    fused = Fused()

    def fused_fwd():
        return fused.forward(hg, wg, labels)

    def fused_fwd_bwd():
        lp, ent = fused.forward(hg, wg, labels)
        return torch.autograd.grad([lp, ent], [hg, wg], [g_lp, g_ent])

    samples: dict[str, list[float]] = {"floor_fwd": [], "fused_fwd": [], "floor_fwd_bwd": [], "fused_fwd_bwd": []}
    for _ in range(rounds):
        samples["floor_fwd"].append(time_fn(lambda: torch.mm(h, w.t(), out=z), device, budget_s=0.6)["ms"])
        samples["fused_fwd"].append(time_fn(fused_fwd, device, budget_s=0.6)["ms"])
        samples["floor_fwd_bwd"].append(time_fn(lambda: floor_sequence(h, w, z, dx, dw), device, budget_s=1.0)["ms"])
        samples["fused_fwd_bwd"].append(time_fn(fused_fwd_bwd, device, budget_s=1.0)["ms"])
    out = {k: statistics.median(v) for k, v in samples.items()}
    out["samples"] = samples
    out["fwd_ratio"] = out["fused_fwd"] / out["floor_fwd"]
    out["fwd_bwd_ratio"] = out["fused_fwd_bwd"] / out["floor_fwd_bwd"]
    return out


def gradient_accuracy(methods, H, V, device, T=1024) -> list[dict]:
    """dX and dW relative errors against float64 (T tokens, full vocab). The fused head is checked
    on log-prob + entropy gradients (with a mask and per-token temperature too); every method on
    log-prob-only gradients (what the cross-entropy kernels compute)."""
    h, w, labels, g_lp, g_ent = make_inputs(T, H, V, device, seed=7)
    rows = []

    def ref_grads(use_entropy, mask=None, temp=1.0):
        h64 = h.double().requires_grad_()
        w64 = w.double().requires_grad_()
        z = (h64 @ w64.t()) / (temp.double()[:, None] if isinstance(temp, torch.Tensor) else temp)
        lp_all = torch.log_softmax(z, -1)
        lp = lp_all.gather(1, labels[:, None]).squeeze(1)
        loss = (lp * g_lp * (mask if mask is not None else 1)).sum()
        if use_entropy:
            ent = -(lp_all.exp() * lp_all).sum(-1)
            loss = loss + (ent * g_ent * (mask if mask is not None else 1)).sum()
        dh, dw = torch.autograd.grad(loss, [h64, w64])
        return dh, dw

    def got_grads(method, use_entropy):
        hg, wg = h.detach().requires_grad_(), w.detach().requires_grad_()
        lp, ent = method.forward(hg, wg, labels)
        outs, grads = [lp], [g_lp]
        if use_entropy:
            outs.append(ent)
            grads.append(g_ent)
        return torch.autograd.grad(outs, [hg, wg], grads)

    ref_lp_only = ref_grads(False)
    # what rounding the exact gradients to bf16 alone costs: no bf16-output method can beat it
    rows.append({"method": "float64 rounded to bf16", "loss": "logprob",
                 "dX_rel_err": rel_err(ref_lp_only[0].to(h.dtype), ref_lp_only[0]),
                 "dW_rel_err": rel_err(ref_lp_only[1].to(h.dtype), ref_lp_only[1])})
    for m in methods:
        try:
            dh, dw = got_grads(m, False)
            rows.append({"method": m.name, "loss": "logprob", "dX_rel_err": rel_err(dh, ref_lp_only[0]),
                         "dW_rel_err": rel_err(dw, ref_lp_only[1])})
        except Exception as exc:  # noqa: BLE001
            rows.append({"method": m.name, "loss": "logprob", "error": f"{type(exc).__name__}: {exc}"})
    del ref_lp_only
    ref_both = ref_grads(True)
    for m in methods:
        if not m.has_entropy:
            continue
        try:
            dh, dw = got_grads(m, True)
            rows.append({"method": m.name, "loss": "logprob+entropy", "dX_rel_err": rel_err(dh, ref_both[0]),
                         "dW_rel_err": rel_err(dw, ref_both[1])})
        except Exception as exc:  # noqa: BLE001
            rows.append({"method": m.name, "loss": "logprob+entropy", "error": f"{type(exc).__name__}: {exc}"})
    del ref_both
    # masked + per-token temperature, fused only
    mask = torch.rand(T, device=device, generator=torch.Generator(device=device).manual_seed(3)) > 0.5
    temp = torch.rand(T, device=device, generator=torch.Generator(device=device).manual_seed(4)) + 0.5
    ref = ref_grads(True, mask=mask.double(), temp=temp)
    fm = Fused(mask=mask, temperature=temp)
    dh, dw = got_grads(fm, True)
    rows.append({"method": "fused", "loss": "logprob+entropy, half masked, per-token temperature",
                 "dX_rel_err": rel_err(dh, ref[0]), "dW_rel_err": rel_err(dw, ref[1]),
                 "masked_rows_grad_zero": bool((dh[~mask] == 0).all())})
    del ref
    free_memory(device)
    return rows


def gpu_conformance(device) -> list[dict]:
    """rlcore's ForwardFnConformance checks (float64 references, fp32 tolerance 2e-5, gradients,
    masks, temperatures, bf16) run against the Triton backend on the GPU: the suite builds CPU
    tensors, a thin wrapper moves them to the GPU and the outputs back (autograd follows)."""
    from rlcore.testing.conformance import ForwardFnConformance
    from rlcore_fused.plugin import CAPABILITIES

    class OnDevice:
        def __init__(self, head):
            self.head = head

        def __call__(self, inp):
            temp = inp.temperature.to(device) if isinstance(inp.temperature, torch.Tensor) else inp.temperature
            out = self.head(HeadInput(
                hidden=inp.hidden.to(device), weight=inp.weight.to(device), labels=inp.labels.to(device),
                vocab=inp.vocab, loss_mask=None if inp.loss_mask is None else inp.loss_mask.to(device),
                temperature=temp, sequence_parallel=inp.sequence_parallel, compute_entropy=inp.compute_entropy))
            return type(out)(logprobs=out.logprobs.cpu(), entropy=None if out.entropy is None else out.entropy.cpu())

    class Suite(ForwardFnConformance):
        capabilities = CAPABILITIES

    checks = ["test_forward_matches_float64", "test_gradients_match_float64", "test_masked_positions_are_zero",
              "test_everything_masked", "test_scalar_temperature", "test_per_token_temperature", "test_bf16_inputs"]
    rows = []
    for label, cfg in (("tma", TritonConfig()), ("pointers", TritonConfig(use_tma=False))):
        fn = OnDevice(FusedHead(backend="triton", triton_config=cfg))
        for name in checks:
            try:
                getattr(Suite(), name)(fn)
                rows.append({"operands": label, "check": name, "passed": True})
            except Exception as exc:  # noqa: BLE001
                rows.append({"operands": label, "check": name, "passed": False, "error": f"{type(exc).__name__}: {exc}"[:400]})
    return rows


def profile_breakdown(T, H, V, device) -> list[dict]:
    """CUDA time per kernel of one fused forward+backward (torch profiler)."""
    h, w, labels, g_lp, g_ent = make_inputs(T, H, V, device, seed=13)
    hg, wg = h.requires_grad_(), w.requires_grad_()
    m = Fused()

    def step():
        lp, ent = m.forward(hg, wg, labels)
        return torch.autograd.grad([lp, ent], [hg, wg], [g_lp, g_ent])

    step()
    sync(device)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        sync(device)
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        if t and t > 0:
            rows.append({"kernel": e.key[:120], "calls": e.count, "ms": t / 1e3})
    rows.sort(key=lambda r: -r["ms"])
    return rows[:14]


def sweep(T, H, V, device, backward=True) -> list[dict]:
    """Our kernels alone (no head overhead) under several tilings, at one size."""
    from rlcore_fused.softmax_stats import finalize
    from rlcore_fused.triton_backend import TritonKernels

    h, w, labels, g_lp, g_ent = make_inputs(T, H, V, device, seed=11)
    inv_t = torch.ones(T, device=device)
    rows = []
    fwd_cfgs = [
        ("f 256x128x64 w8 s3 split-auto (default)", TileConfig(256, 128, 64, 8, 8, 3), None, None),
        ("f 256x128x64 w8 s3 split16", TileConfig(256, 128, 64, 8, 8, 3), 16, None),
        ("f 128x256x64 w8 s3 split-auto", TileConfig(128, 256, 64, 8, 8, 3), None, None),
        ("f 128x256x64 w8 s3 split8", TileConfig(128, 256, 64, 8, 8, 3), 8, None),
        ("f 128x128x64 w8 s4 split-auto", TileConfig(128, 128, 64, 8, 8, 4), None, None),
        ("f 256x128x64 w8 s3 split-auto group4", TileConfig(256, 128, 64, 4, 8, 3), None, None),
        ("f 256x128x64 w8 s3 split-auto group16", TileConfig(256, 128, 64, 16, 8, 3), None, None),
        ("f 128x128x32 w8 s3 split-auto pointers", TileConfig(128, 128, 32, 8, 8, 3), None, False),
    ]
    record = None
    for label, tiles, split, tma in fwd_cfgs:
        k = TritonKernels(TritonConfig(forward=tiles, split_tiles=split, use_tma=tma))
        try:
            record = k.local_record(h, w, labels, inv_t, True)
            t = time_fn(lambda k=k: k.local_record(h, w, labels, inv_t, True), device)
            c = k.compiled.get("forward")
            rows.append({"kernel": "forward", "config": label, "T": T, "ms": t["ms"],
                         "tflops": 2 * T * H * V / t["ms"] / 1e9,
                         "n_regs": getattr(c, "n_regs", None), "n_spills": getattr(c, "n_spills", None)})
        except Exception as exc:  # noqa: BLE001
            rows.append({"kernel": "forward", "config": label, "error": f"{type(exc).__name__}: {exc}"})
        free_memory(device)
    if record is None or not backward:
        return rows
    _, _, lse, mu, _ = finalize(record, True)
    bwd_cfgs = [
        ("b 128x256x64 w8 s3 chunk512 (default)", TileConfig(128, 256, 64, 8, 8, 3), 512, None),
        ("b 128x256x64 w8 s3 chunk1024", TileConfig(128, 256, 64, 8, 8, 3), 1024, None),
        ("b 128x256x64 w8 s3 chunk256", TileConfig(128, 256, 64, 8, 8, 3), 256, None),
        ("b 128x256x64 w8 s3 chunk512 group4", TileConfig(128, 256, 64, 4, 8, 3), 512, None),
        ("b 128x128x64 w8 s4 chunk512", TileConfig(128, 128, 64, 8, 8, 4), 512, None),
        ("b 128x128x32 w8 s3 chunk512 pointers", TileConfig(128, 128, 32, 8, 8, 3), 512, False),
    ]
    for label, tiles, chunk, tma in bwd_cfgs:
        k = TritonKernels(TritonConfig(backward=tiles, chunk_mib=chunk, use_tma=tma))
        try:
            t = time_fn(lambda k=k: k.grads(h, w, labels, inv_t, lse, mu, g_lp, g_ent, True, True), device)
            c = k.compiled.get("backward")
            rows.append({"kernel": "backward (dlogits kernel + cuBLAS dX, dW)", "config": label, "ms": t["ms"],
                         "tflops": 6 * T * H * V / t["ms"] / 1e9,
                         "n_regs": getattr(c, "n_regs", None), "n_spills": getattr(c, "n_spills", None)})
        except Exception as exc:  # noqa: BLE001
            rows.append({"kernel": "backward", "config": label, "error": f"{type(exc).__name__}: {exc}"})
        free_memory(device)
    return rows


# --------------------------------------------------------------------------- main ---------


def fmt(v, spec="{:.1f}"):
    return "—" if v is None else spec.format(v)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="4096,16384,65536")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--subset", type=int, default=512, help="rows checked against float64 per size")
    ap.add_argument("--wheels", default=".whl", help="folder with the verl wheel")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench-fused"))
    ap.add_argument("--skip", default="", help="comma list of methods/sections to skip")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (Triton interpreter)")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))

    if args.dry_run:
        device = torch.device("cpu")
        tokens, H, V = [96], 64, 1000
        args.subset = 32
        skip |= {"liger", "cce", "cce-exact", "verl"}
    else:
        device = torch.device("cuda")
        tokens, H, V = [int(t) for t in args.tokens.split(",")], args.hidden, args.vocab

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
        "capability": list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None,
        "H": H, "V": V, "dtype": "bfloat16",
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    for pkg in ("liger_kernel", "cut_cross_entropy"):
        try:
            from importlib.metadata import version

            env[pkg] = version(pkg.replace("_", "-"))
        except Exception:  # noqa: BLE001
            env[pkg] = None
    log(json.dumps(env))
    results: dict = {"env": env, "sizes": [], "masked": None, "temperature": None, "gradients": None, "sweep": None}

    methods: list[Method] = [Fused()]
    if "naive" not in skip:
        methods.append(Naive())
    for name, make in (("liger", Liger), ("cce", lambda: CCE("high")), ("cce-exact", lambda: CCE(None)),
                       ("verl", lambda: Verl(next(Path(args.wheels).glob("verl-*.whl"))))):
        if name in skip:
            continue
        try:
            methods.append(make())
        except Exception as exc:  # noqa: BLE001
            log(f"[bench] {name} unavailable: {type(exc).__name__}: {exc}")
            results.setdefault("unavailable", {})[name] = f"{type(exc).__name__}: {exc}"

    def save():
        (out_dir / "results.json").write_text(json.dumps(results, indent=1))
        (out_dir / "bench.log").write_text("\n".join(LOG) + "\n")

    t_start = time.time()
    if "conformance" not in skip:
        results["conformance"] = gpu_conformance(device)
        ok = sum(r["passed"] for r in results["conformance"])
        log(f"[conformance] {ok}/{len(results['conformance'])} checks passed on {env['device']}")
        for r in results["conformance"]:
            if not r["passed"]:
                log(f"[conformance] FAILED {r}")
        save()
    # ---- gradient accuracy (float64, T=1024) first: it also compiles every kernel
    if "gradients" not in skip:
        results["gradients"] = gradient_accuracy(methods, H, V, device, T=1024 if not args.dry_run else 48)
        for r in results["gradients"]:
            log(f"[grad] {r}")
        save()

    def profile_and_sweep():
        # ---- where the fused head's time goes at 16k
        if "profile" not in skip and device.type == "cuda":
            results["profile"] = {}
            for pt in (4096, 16384):
                try:
                    results["profile"][str(pt)] = profile_breakdown(pt, H, V, device)
                    for r in results["profile"][str(pt)]:
                        log(f"[profile T={pt}] {r['ms']:9.2f} ms  x{r['calls']:<3} {r['kernel']}")
                except Exception as exc:  # noqa: BLE001
                    results["profile"][str(pt)] = f"{type(exc).__name__}: {exc}"
            save()

        # ---- tile sweep at 16k
        if "sweep" not in skip:
            T = 16384 if not args.dry_run else tokens[0]
            results["sweep"] = sweep(T, H, V, device)
            for r in results["sweep"]:
                log(f"[sweep T={T}] {r}")
            results["sweep_4096"] = sweep(4096 if not args.dry_run else tokens[0], H, V, device, backward=False)
            for r in results["sweep_4096"]:
                log(f"[sweep T=4096] {r}")

    # ---- the size table (the tile sweep and profile run right after T=16384, before the largest size)
    for T in tokens:
        free_memory(device)
        h, w, labels, g_lp, g_ent = make_inputs(T, H, V, device)
        subset = torch.randperm(T, device=device, generator=torch.Generator(device=device).manual_seed(5))[: args.subset]
        ref = float64_reference(h[subset], w, labels[subset], 1.0)
        size: dict = {"T": T, "methods": []}
        size["floor"] = floor_times(T, H, V, device)
        log(f"[T={T}] floor fwd {size['floor']['floor_fwd_ms']:.2f} ms, fwd+bwd {size['floor']['floor_fwd_bwd_ms']:.2f} ms "
            f"(sum of parts {size['floor']['floor_fwd_bwd_sum_of_parts_ms']:.2f})")
        if device.type == "cuda" and "h2h" not in skip:
            size["head_to_head"] = head_to_head(T, H, V, device)
            hh = size["head_to_head"]
            log(f"[T={T}] interleaved: fused fwd {hh['fused_fwd']:.2f} / floor {hh['floor_fwd']:.2f} = {hh['fwd_ratio']:.3f}; "
                f"fused fwd+bwd {hh['fused_fwd_bwd']:.2f} / floor {hh['floor_fwd_bwd']:.2f} = {hh['fwd_bwd_ratio']:.3f}")
            free_memory(device)
        for m in methods:
            need = T * V * 4 * 3.2 / GiB  # naive: fp32 logits, log-softmax, its exp
            if isinstance(m, Naive) and device.type == "cuda":
                free = torch.cuda.mem_get_info(device)[0] / GiB
                if need > 0.9 * free:
                    size["methods"].append({"method": m.name, "error": f"skipped: needs ~{need:.0f} GiB, {free:.0f} GiB free"})
                    continue
            r = run_method(m, h, w, labels, g_lp, g_ent, subset, ref, device)
            size["methods"].append(r)
            log(f"[T={T}] {r}")
            save()
        results["sizes"].append(size)
        if T == 16384 or (args.dry_run and T == tokens[0]):
            # half the tokens masked, and temperature 0.7, fused only, same inputs
            mask = torch.rand(T, device=device, generator=torch.Generator(device=device).manual_seed(6)) > 0.5
            kept = mask[subset]
            rm = run_method(Fused(mask=mask), h, w, labels, g_lp, g_ent, subset[kept], (ref[0][kept], ref[1][kept]), device)
            rm["masked_fraction"] = float(1 - mask.float().mean())
            results["masked"] = rm
            log(f"[T={T} half masked] {rm}")
            ref_t = float64_reference(h[subset], w, labels[subset], 0.7)
            rt = run_method(Fused(temperature=0.7), h, w, labels, g_lp, g_ent, subset, ref_t, device)
            results["temperature"] = rt
            log(f"[T={T} temperature 0.7] {rt}")
            save()
        del h, w, labels, g_lp, g_ent, ref
        free_memory(device)
        if T == 16384 or (args.dry_run and T == tokens[0]):
            profile_and_sweep()

    results["wall_s"] = time.time() - t_start
    save()

    # ---- the short table (last, so it is in the reply's tail)
    log("")
    log(f"device {env['device']} | torch {env['torch']} | triton {env['triton']} | H={H} V={V} bf16 | {env['date']}")
    log(f"{'T':>6} {'method':<10} {'fwd ms':>8} {'fwd+bwd':>8} {'xfloor f':>8} {'xfloor fb':>9} {'mem GiB':>8} {'lp err':>8} {'ent err':>8}")
    for size in results["sizes"]:
        fl = size["floor"]
        log(f"{size['T']:>6} {'floor':<10} {fl['floor_fwd_ms']:>8.1f} {fl['floor_fwd_bwd_ms']:>8.1f} {'1.00':>8} {'1.00':>9} "
            f"{'':>8} {'':>8} {'':>8}   (sum of separately timed GEMMs {fl['floor_fwd_bwd_sum_of_parts_ms']:.1f})")
        hh = size.get("head_to_head")
        if hh:
            log(f"{size['T']:>6} {'fused/floor interleaved':<10} {hh['fused_fwd']:.1f}/{hh['floor_fwd']:.1f} = {hh['fwd_ratio']:.3f} fwd, "
                f"{hh['fused_fwd_bwd']:.1f}/{hh['floor_fwd_bwd']:.1f} = {hh['fwd_bwd_ratio']:.3f} fwd+bwd")
        for r in size["methods"]:
            if "error" in r:
                log(f"{size['T']:>6} {r['method']:<10} {r['error'][:90]}")
                continue
            f = r.get("fwd", {}).get("ms")
            fb = r.get("fwd_bwd", {}).get("ms")
            log(f"{size['T']:>6} {r['method']:<10} {fmt(f):>8} {fmt(fb):>8} {fmt(f and f / fl['floor_fwd_ms'], '{:.2f}'):>8} "
                f"{fmt(fb and fb / fl['floor_fwd_bwd_ms'], '{:.2f}'):>9} {fmt(r.get('fwd_bwd_extra_gib'), '{:.2f}'):>8} "
                f"{fmt(r.get('logprob_rel_err'), '{:.1e}'):>8} {fmt(r.get('entropy_rel_err'), '{:.1e}'):>8}")
    for key in ("masked", "temperature"):
        r = results.get(key)
        if r and "error" not in r:
            log(f"fused {key}: fwd {fmt(r['fwd']['ms'])} ms, fwd+bwd {fmt(r['fwd_bwd']['ms'])} ms, "
                f"lp err {r['logprob_rel_err']:.1e}, ent err {r.get('entropy_rel_err', float('nan')):.1e}")
        elif r:
            log(f"fused {key}: {r['error']}")
    if results.get("conformance"):
        log(f"conformance checks on device: {sum(r['passed'] for r in results['conformance'])}/{len(results['conformance'])} passed")
    if results["gradients"]:
        log("gradients vs float64 (T=1024): " + "; ".join(
            f"{r['method']}[{r['loss'][:14]}] dX {r.get('dX_rel_err', float('nan')):.1e} dW {r.get('dW_rel_err', float('nan')):.1e}"
            for r in results["gradients"] if "error" not in r))
    for key in ("sweep", "sweep_4096"):
        best = {}
        for r in results.get(key) or []:
            if "ms" in r and (r["kernel"] not in best or r["ms"] < best[r["kernel"]]["ms"]):
                best[r["kernel"]] = r
        for k, r in best.items():
            log(f"{key} best {k[:8]}: {r['config']} {r['ms']:.1f} ms ({r['tflops']:.0f} TF/s, regs {r['n_regs']}, spills {r['n_spills']})")
    save()
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
