"""Σπ² (HeadInput.compute_sum_pi_squared, for the optimal-token baseline) from the compiled Triton
kernels on a GPU: against a float64 softmax over the real vocabulary (padding rows present), for
TMA and pointer operands, bf16 and fp32 inputs, scalar and per-token temperature, ordinary and
peaked logits; and what asking for it costs in the no-grad forward (the old-log-prob pass).

On the GPU machine (repository root)::

    PYTHONPATH=core/src:plugins/fused/src python3 plugins/fused/bench/gpu_sum_pi_squared.py --out $OUT

writes ``$OUT/sum_pi_squared.json`` and exits 1 if a check fails. CPU check of the script itself
(tiny shapes, Triton interpreter): ``TRITON_INTERPRET=1 .venvs/fused-triton/bin/python
plugins/fused/bench/gpu_sum_pi_squared.py --small --out /tmp/sps``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from rlcore.types import HeadInput, VocabShard
from rlcore_fused.head import FusedHead
from rlcore_fused.tuning import TritonConfig


def float64_sum_pi_squared(h, w, vocab_size, temp, chunk=256):
    out = torch.empty(h.shape[0], dtype=torch.float64, device=h.device)
    wv = w[:vocab_size].double()
    for lo in range(0, h.shape[0], chunk):
        z = h[lo:lo + chunk].double() @ wv.t()
        t = temp[lo:lo + chunk, None].double() if isinstance(temp, torch.Tensor) else float(temp)
        out[lo:lo + chunk] = (torch.softmax(z / t, -1) ** 2).sum(-1)
    return out


def inputs(T, H, V, dtype, device, scale, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    rows = -(-V // 128) * 128 + (128 if V % 128 == 0 else 0)  # padding rows, as Megatron pads
    h = (torch.randn(T, H, generator=g) * scale).to(device, dtype)
    w = (torch.randn(rows, H, generator=g) * (1.0 / H ** 0.5) * 4).to(device, dtype)
    w[V:] = 1.0  # padding rows with large logits: counted by mistake, they dominate
    labels = torch.randint(0, V, (T,), generator=g).to(device)
    return h, w, labels


def head_sum_sq(head, h, w, labels, V, temp):
    with torch.no_grad():
        out = head(HeadInput(hidden=h, weight=w, labels=labels, vocab=VocabShard.full(V, rows=w.shape[0]),
                             temperature=temp, compute_entropy=False, compute_sum_pi_squared=True))
    return out.sum_pi_squared


def time_forward(head, h, w, labels, V, sum_sq, reps):
    def once():
        with torch.no_grad():
            head(HeadInput(hidden=h, weight=w, labels=labels, vocab=VocabShard.full(V, rows=w.shape[0]),
                           temperature=1.0, compute_entropy=False, compute_sum_pi_squared=sum_sq))
    once()
    times = []
    for _ in range(reps):
        if h.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        once()
        if h.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU, Triton interpreter)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.small:
        shapes = [(37, 32, 70, torch.float32), (37, 32, 70, torch.bfloat16)]
        timing = (37, 32, 70, torch.bfloat16)
        small = TritonConfig(use_tma=False)
        heads = {"pointers": FusedHead(backend="triton", triton_config=small)}
    else:
        shapes = [(2048, 1024, 32000, torch.float32), (4096, 2048, 151936, torch.bfloat16)]
        timing = (8192, 4096, 151936, torch.bfloat16)
        heads = {"tma": FusedHead(backend="triton", triton_config=TritonConfig()),
                 "pointers": FusedHead(backend="triton", triton_config=TritonConfig(use_tma=False))}
    rows, failed = [], 0
    for T, H, V, dtype in shapes:
        for peaked in (False, True):
            h, w, labels = inputs(T, H, V, dtype, device, 30.0 if peaked else 1.0, seed=T + V)
            per_token = torch.rand(T, generator=torch.Generator().manual_seed(1)).to(device) + 0.5
            for temp_label, temp in (("0.7", 0.7), ("per-token", per_token)):
                ref = float64_sum_pi_squared(h, w, V, temp)
                for op, head in heads.items():
                    got = head_sum_sq(head, h, w, labels, V, temp).double()
                    rel = float(((got - ref).abs() / ref).max())
                    # fp32 products: logit error ~1e-6·|z|; bf16 operands: exact products, fp32 accumulation
                    ok = bool(torch.isfinite(got).all()) and rel < 1e-3
                    failed += not ok
                    rows.append({"T": T, "H": H, "V": V, "dtype": str(dtype).replace("torch.", ""),
                                 "peaked": peaked, "temperature": temp_label, "operands": op,
                                 "max_rel_error": rel, "mean_sum_pi_squared": float(ref.mean()), "passed": ok})
                    print(json.dumps(rows[-1]), flush=True)
    T, H, V, dtype = timing
    h, w, labels = inputs(T, H, V, dtype, device, 1.0, seed=7)
    reps = 3 if args.small else 20
    timings = {op: {"without_s": time_forward(head, h, w, labels, V, False, reps),
                    "with_s": time_forward(head, h, w, labels, V, True, reps)} for op, head in heads.items()}
    for t in timings.values():
        t["overhead"] = t["with_s"] / t["without_s"] - 1
    print(json.dumps({"timing_shape": [T, H, V, str(dtype)], **timings}), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (interpreter)"
    (out / "sum_pi_squared.json").write_text(json.dumps(
        {"device": device_name, "torch": torch.__version__, "checks": rows, "failed": failed,
         "timing_shape": [T, H, V, str(dtype)], "no_grad_forward": timings}, indent=1) + "\n")
    print(f"{len(rows) - failed}/{len(rows)} checks passed; forward timings: {timings}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
