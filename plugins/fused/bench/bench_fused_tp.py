"""The fused head with the vocabulary sharded over 2 GPUs (NCCL), against the same head unsharded.

T=16384, H=4096, bf16, Qwen-style padded vocabulary: 152064 rows of which 151936 are real, so the
second rank's last 128 rows are padding that must stay out of the softmax. For tensor parallelism
with and without sequence parallelism it checks, on every rank, log-prob / entropy (against the
unsharded head and against float64 on a row subset) and the gradients of hidden and of this rank's
weight rows (against the unsharded head), then times forward and forward+backward.

Run on a machine with 2 GPUs:  python plugins/fused/bench/bench_fused_tp.py --out $OUT
Writes $OUT/tp_results.json; prints a short table last. Measures, never asserts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rlcore.types import HeadInput, VocabShard
from rlcore_fused.head import FusedHead

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_measure import float64_reference, make_inputs, rel_err, time_fn  # noqa: E402


def _worker(rank: int, world: int, init_file: str, args, queue) -> None:
    if args.dry_run:  # CPU tensors, gloo, the Triton interpreter: checks this script's logic
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    else:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                device_id=device)
    group = dist.group.WORLD
    try:
        T, H, rows, V = args.tokens, args.hidden, args.rows, args.vocab
        # identical inputs on every rank (same seed, same generator)
        h, w, labels, g_lp, g_ent = make_inputs(T, H, rows, device, seed=21)
        labels = labels % V  # targets are real tokens
        with torch.no_grad():
            w[V:] = 0.5  # padding rows with large logits: counted by mistake, they would dominate
        per = rows // world
        lo, hi = rank * per, (rank + 1) * per
        head = FusedHead(backend="triton")
        out: dict = {"rank": rank}

        # the unsharded head on this GPU: the reference for outputs and gradients
        hg, wg = h.detach().requires_grad_(), w.detach().requires_grad_()
        ref = head(HeadInput(hidden=hg, weight=wg, labels=labels, vocab=VocabShard.full(V, rows=rows)))
        ref_dh, ref_dw = torch.autograd.grad([ref.logprobs, ref.entropy], [hg, wg], [g_lp, g_ent])
        ref_dw = ref_dw[lo:hi]
        subset = torch.arange(0, T, max(1, T // 256), device=device)
        f64 = float64_reference(h[subset], w[:V], labels[subset], 1.0)

        for sp in (False, True):
            key = "tp+sp" if sp else "tp"
            w_local = w[lo:hi].detach().clone().requires_grad_()
            h_full = h.detach().clone().requires_grad_()

            def forward(h_full=h_full, w_local=w_local, sp=sp):
                h_in = h_full.chunk(world, dim=0)[rank] if sp else h_full
                return head(HeadInput(hidden=h_in, weight=w_local, labels=labels,
                                      vocab=VocabShard(lo, hi, V, group=group), sequence_parallel=sp))

            def fwd_bwd(forward=forward, h_full=h_full, w_local=w_local):
                o = forward()
                return torch.autograd.grad([o.logprobs, o.entropy], [h_full, w_local], [g_lp, g_ent])

            o = forward()
            dh, dw = torch.autograd.grad([o.logprobs, o.entropy], [h_full, w_local], [g_lp, g_ent])
            r = {
                "logprob_vs_unsharded_max_abs": float((o.logprobs - ref.logprobs).detach().abs().max()),
                "entropy_vs_unsharded_max_abs": float((o.entropy - ref.entropy).detach().abs().max()),
                "logprob_rel_err_vs_float64": rel_err(o.logprobs.detach()[subset], f64[0]),
                "entropy_rel_err_vs_float64": rel_err(o.entropy.detach()[subset], f64[1]),
                "dW_rel_vs_unsharded": rel_err(dw, ref_dw),
                "padding_rows_grad_zero": bool((dw[max(0, V - lo):] == 0).all()) if hi > V else None,
            }
            if sp:  # each rank holds the gradient of its own sequence slice
                r["dX_rel_vs_unsharded"] = rel_err(dh.chunk(world)[rank], ref_dh.chunk(world)[rank])
            else:
                r["dX_rel_vs_unsharded"] = rel_err(dh, ref_dh)
            del o, dh, dw
            dist.barrier()
            # fixed repetition counts: every rank must issue the same collectives
            r["fwd"] = time_fn(forward, device, min_reps=10, max_reps=10)
            dist.barrier()
            r["fwd_bwd"] = time_fn(fwd_bwd, device, min_reps=5, max_reps=5)
            out[key] = r
            dist.barrier()

        if rank == 0:  # the unsharded head alone on one GPU, for the speed-up
            def single_fwd():
                return head(HeadInput(hidden=hg, weight=wg, labels=labels, vocab=VocabShard.full(V, rows=rows)))

            def single_fwd_bwd():
                o = single_fwd()
                return torch.autograd.grad([o.logprobs, o.entropy], [hg, wg], [g_lp, g_ent])

            out["tp1"] = {"fwd": time_fn(single_fwd, device), "fwd_bwd": time_fn(single_fwd_bwd, device, budget_s=2.0)}
        dist.barrier()
        queue.put(out)
    finally:
        dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rows", type=int, default=152064, help="padded vocabulary rows (a multiple of 128·TP)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench-fused-tp"))
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, CPU, gloo, TRITON_INTERPRET=1")
    args = ap.parse_args()
    world = 2
    if args.dry_run:
        args.tokens, args.hidden, args.vocab, args.rows = 64, 64, 250, 256
    elif torch.cuda.device_count() < world:
        print(f"needs {world} GPUs, found {torch.cuda.device_count()}")
        return 1
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, os.path.join(d, "store"), args, queue), nprocs=world, join=True)
    ranks = sorted((queue.get() for _ in range(world)), key=lambda r: r["rank"])
    import triton

    res = {
        "env": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "command": " ".join(sys.argv), "torch": torch.__version__, "triton": triton.__version__,
                "device": "cpu (dry run)" if args.dry_run else f"{world}x {torch.cuda.get_device_name(0)}",
                "T": args.tokens, "H": args.hidden, "V": args.vocab, "rows": args.rows, "dtype": "bfloat16"},
        "ranks": ranks,
    }
    (out_dir / "tp_results.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res["env"]))
    tp1 = ranks[0]["tp1"]
    print(f"TP=1 (one GPU): fwd {tp1['fwd']['ms']:.1f} ms, fwd+bwd {tp1['fwd_bwd']['ms']:.1f} ms")
    for key in ("tp", "tp+sp"):
        worst = {k: max(r[key][k] for r in ranks) for k in ranks[0][key]
                 if isinstance(ranks[0][key][k], float)}
        fwd = max(r[key]["fwd"]["ms"] for r in ranks)
        fb = max(r[key]["fwd_bwd"]["ms"] for r in ranks)
        print(f"TP=2 {key:6s}: fwd {fwd:.1f} ms, fwd+bwd {fb:.1f} ms (slowest rank) | worst over ranks: "
              + ", ".join(f"{k} {v:.1e}" for k, v in worst.items())
              + f" | padding rows' grad zero: {[r[key]['padding_rows_grad_zero'] for r in ranks]}")
    print(f"median fwd+bwd speed-up TP=2 vs TP=1: {tp1['fwd_bwd']['ms'] / statistics.median([r['tp']['fwd_bwd']['ms'] for r in ranks]):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
