"""The benchmark's measuring tools, shared by bench_fused.py and bench_fused_tp.py: the log, timing
(CUDA events on GPU, wall clock on CPU), peak extra memory, errors against a float64 reference,
and the inputs every run uses."""

from __future__ import annotations

import gc
import math
import statistics
import time

import torch

GiB = 2**30
LOG: list[str] = []


def log(msg: str) -> None:
    print(msg, flush=True)
    LOG.append(msg)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def time_fn(fn, device, budget_s: float = 1.5, min_reps: int = 3, max_reps: int = 25) -> dict:
    """Median wall time of ``fn`` (CUDA events on GPU) after one warm-up call."""
    fn()
    sync(device)
    times = []

    def once():
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    first = once()
    times.append(first)
    reps = max(min_reps, min(max_reps, int(budget_s * 1e3 / max(first, 1e-3))))
    for _ in range(reps - 1):
        times.append(once())
    return {"ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "reps": len(times)}


def peak_extra(fn, device) -> float | None:
    """GiB allocated at peak during ``fn()`` beyond what was allocated before it and beyond the
    tensors it returns (the gradients every method must produce)."""
    if device.type != "cuda":
        return None
    free_memory(device)
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    result = fn()
    sync(device)
    peak = torch.cuda.max_memory_allocated(device)
    kept = sum(t.numel() * t.element_size() for t in result if isinstance(t, torch.Tensor)) if result else 0
    del result
    return (peak - base - kept) / GiB


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return float((got.double() - ref).norm() / ref.norm().clamp_min(1e-300))


def float64_reference(x, w, labels, temp, vocab_chunk=32768):
    """log-prob and entropy in float64 for the rows of ``x`` (weights upcast chunk by chunk)."""
    z = torch.empty(x.shape[0], w.shape[0], dtype=torch.float64, device=x.device)
    xd = x.double()
    for lo in range(0, w.shape[0], vocab_chunk):
        z[:, lo:lo + vocab_chunk] = xd @ w[lo:lo + vocab_chunk].double().t()
    t = temp.double()[:, None] if isinstance(temp, torch.Tensor) else float(temp)
    z /= t
    lp_all = torch.log_softmax(z, dim=-1)
    del z
    lp = lp_all.gather(1, labels[:, None]).squeeze(1)
    ent = -(lp_all.exp() * lp_all).sum(-1)
    return lp, ent


def make_inputs(T, H, V, device, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device=device).manual_seed(seed)
    # logits of standard deviation ~3 (peaked, as in RL fine-tuning)
    h = torch.randn(T, H, device=device, generator=g).to(dtype)
    w = (torch.randn(V, H, device=device, generator=g) * (3.0 / math.sqrt(H))).to(dtype)
    labels = torch.randint(0, V, (T,), device=device, generator=g)
    g_lp = torch.randn(T, device=device, generator=g)
    g_ent = torch.randn(T, device=device, generator=g)
    return h, w, labels, g_lp, g_ent
