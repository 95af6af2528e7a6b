"""rlcore-megatron's tensor/expert-parallel ranks on two GPUs (issue 16; scripts/gpu/two_gpu_016.sh
runs every part on the 2x H200 machine, docs/benchmarks/two_gpu.md records what came back).

A benchmark script, not part of the ``rlcore_megatron`` package. Ray's wheel is over what the GPU
machine can be sent, so the ranks are started WITHOUT Ray: two processes from
``torch.multiprocessing`` (spawn), each with its own ``CUDA_VISIBLE_DEVICES`` (so
``rlcore.parallel.worker.init_distributed``'s device 0 is its own GPU), each calling the worker code
the Ray actors call, ``rlcore.parallel.worker.run_rank`` (NCCL on CUDA, gloo on CPU), which runs
``rlcore.trainer.Trainer`` with the model-parallel rank strategy
(``rlcore.parallel.model_parallel.ModelParallel``, picked from the engine's capabilities). The writer (rank 0) holds the local
rollout; every push gathers the TP/EP shards over the trainer group (NCCL; one all-gather per
~bucket of tensors since issue 32, tensor by tensor before) and streams them bucket by bucket into
it (inproc sync, verified coverage+exact).

The only thing added to the worker path is measurement: ``rlcore.trainer.Trainer`` is replaced in
its module (``run_rank`` imports it from there when called) by a subclass whose ``_push`` reads the
GPU allocator's peak around each push (every rank) and which, after the run, times one more
export drain (the NCCL gather alone).

Parts (``--part``), each independent, each writing one JSON file (``--results``):

* ``d2d``: a device-to-device copy GPU0 -> GPU1 (one process, both GPUs visible) and an NCCL
  all-gather between the two ranks, the speeds the sync is compared with;
* ``logprobs``: per-token log-probs (fp32) of the dense tiny model at TP=2 vs TP=1 and of the MoE at
  EP=2 vs EP=1, max abs difference, as ``plugins/megatron/tests/test_parallel.py`` on CPU;
* ``tp_train``: GRPO with TP=2 on a dense model (local rollout, reference head);
* ``ep_mtp_train``: GRPO with EP=2 on a MoE with one MTP layer, ``plugins: [megatron, mtp]``;
* ``fused_tp_train``: GRPO with TP=2 and the fused head, the vocabulary sharded over the two ranks;
* ``sync_big``: a dense 0.72 GB bf16 model (362 M parameters) at TP=2, three steps, 64 MiB buckets: the
  push's GB/s, its per-rank peak extra GPU memory against the bucket and the model size, and the
  gather-only export time; ``sync_big_in_place`` the same with ``rollout.local_update=in_place``
  (no staged copy of the model on the writer), ``sync_big_unverified`` in place without checksums,
  ``sync_big_breakdown`` in place with every phase of the push timed (a GPU sync after each),
  ``sync_large_in_place`` in place on 3x the layers (2.2 GB);
* ``sync_large`` (issue 32, scripts/gpu/two_gpu_019.sh): the 2.2 GB model in place, ``--big-steps``
  verified pushes then ``--unverified-pushes`` more of the same run with ``sync.verify`` off; the
  push GB/s (median of the verified pushes after the first, and of the unverified ones), every
  rank's peak extra memory, the sync's own phases (``SyncReport.details["phases"]``); no HF export
  and no final checkpoint (the bench skips it: ~40 s of shards for a 2 GB model);
* ``dp2_equal``: megatron DP=2 (TP=1, two ranks) against one rank with the whole batch, fp32:
  log-probs, loss, gradient norm and every gradient after the data-parallel reduction;
* ``dp2_train``: GRPO with megatron DP=2, the per-phase step table.

Every training part's ranks also write ``<out>/<part>_ranks/rank<i>.json`` after each push, so a
part stopped at its limit keeps every rank's readings so far.

Usage: ``python plugins/megatron/bench/two_gpu.py --part tp_train --out DIR --results FILE
[--device cuda|cpu] [--steps N]`` (``--device cpu`` runs the same code with gloo on tiny sizes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "megatron_tiny.yaml"
GIB = 1 << 30
MIB = 1 << 20

RUN = ["output.progress=false", "output.tensorboard=false", "output.plot=false", "output.checkpoint_every=0",
       "training.lr=0.001"]
DENSE = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64,
         "intermediate_size": 512}
MOE_MTP = {"arch": "qwen3_moe", "hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
           "head_dim": 64, "num_experts": 8, "topk": 2, "moe_intermediate_size": 128, "mtp_layers": 1}
#: ~362 M parameters: 0.72 GB in bf16 (the vocabulary is the task's, tiny)
BIG = {"hidden_size": 2048, "num_layers": 8, "num_heads": 16, "num_kv_heads": 4, "head_dim": 128,
       "intermediate_size": 5632}
BIG_CPU = {"hidden_size": 256, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64,
           "intermediate_size": 512}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(target: Any, world: int, device: str, args: tuple, timeout_s: float = 600,
          visible: list[str] | None = None) -> tuple[list[dict], list[str]]:
    """``world`` processes running ``target(rank, world, port, queue, *args)``; each gets its own
    GPU through ``CUDA_VISIBLE_DEVICES`` (``visible[rank]``, default its rank) on CUDA. Returns
    what the ranks put on the queue and the errors."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    procs = []
    try:
        for r in range(world):
            if device == "cuda":  # the child reads its environment at start: one GPU each
                os.environ["CUDA_VISIBLE_DEVICES"] = visible[r] if visible else str(r)
            p = ctx.Process(target=_guarded, args=(target, r, world, port, q, *args))
            p.start()
            procs.append(p)
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    results: list[dict] = []
    deadline = time.monotonic() + timeout_s
    while len(results) < world and time.monotonic() < deadline:
        try:
            results.append(q.get(timeout=1.0))
        except Exception:  # noqa: BLE001 - queue.Empty: look whether every rank died
            if all(not p.is_alive() for p in procs) and q.empty():
                break
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
    errors = [r["error"] for r in results if "error" in r]
    errors += [f"rank {i} exit code {p.exitcode}" for i, p in enumerate(procs) if p.exitcode not in (0, None)]
    return [r for r in results if "error" not in r], errors


def _guarded(target: Any, rank: int, world: int, port: int, q: Any, *args: Any) -> None:
    dump_s = float(os.environ.get("TWO_GPU_DUMP_S", "0") or 0)
    if dump_s > 0:  # a rank still running then prints every thread's stack (where a hang waits)
        import faulthandler

        faulthandler.dump_traceback_later(dump_s, exit=False)
    try:
        out = target(rank, world, port, *args)
        q.put({"rank": rank, **(out or {})})
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then re-raised
        q.put({"rank": rank, "error": f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"})
        raise


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------- d2d -----

def _copy_between_gpus(rank: int, world: int, port: int) -> dict:
    """GPU0 -> GPU1 copies of 1 GiB through PyTorch (one process, both GPUs visible)."""
    n = GIB
    a = torch.empty(n, dtype=torch.uint8, device="cuda:0").fill_(7)
    b = torch.empty(n, dtype=torch.uint8, device="cuda:1")
    peer = torch.cuda.can_device_access_peer(0, 1)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    reps = 10
    t0 = time.perf_counter()
    for _ in range(reps):
        b.copy_(a)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    dt = (time.perf_counter() - t0) / reps
    assert bool((b[:16] == 7).all())
    return {"peer_access": peer, "bytes": n, "seconds": dt, "GBps": n / dt / 1e9,
            "gpus": [torch.cuda.get_device_name(0), torch.cuda.get_device_name(1)]}


def _nccl_all_gather(rank: int, world: int, port: int, device: str, mib: int) -> dict:
    import torch.distributed as dist
    from rlcore.parallel.worker import init_distributed

    backend = init_distributed(rank, world, f"127.0.0.1:{port}", device, 120)
    dev = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    try:
        part = torch.full((mib * MIB // 2,), float(rank), dtype=torch.bfloat16, device=dev)
        full = torch.empty(world * part.numel(), dtype=part.dtype, device=dev)
        for _ in range(3):
            dist.all_gather_into_tensor(full, part)
        _sync(dev.type)
        reps = 10
        t0 = time.perf_counter()
        for _ in range(reps):
            dist.all_gather_into_tensor(full, part)
        _sync(dev.type)
        dt = (time.perf_counter() - t0) / reps
        ok = bool(full[part.numel():].eq(1).all()) and bool(full[:part.numel()].eq(0).all())
        # each rank receives (world-1) shards: the algorithm bandwidth over the link
        return {"backend": backend, "shard_bytes": part.numel() * 2, "seconds": dt, "correct": ok,
                "received_GBps": (world - 1) * part.numel() * 2 / dt / 1e9,
                "output_GBps": full.numel() * 2 / dt / 1e9}
    finally:
        dist.destroy_process_group()


def part_d2d(args: argparse.Namespace) -> dict:
    out: dict = {}
    if args.device == "cuda":
        got, err = spawn(_copy_between_gpus, 1, "cuda", (), visible=["0,1"], timeout_s=120)
        out["copy_gpu0_to_gpu1"] = got[0] if got else {"errors": err}
    else:
        out["copy_gpu0_to_gpu1"] = {"skipped": "no GPUs (cpu dry run)"}
    got, err = spawn(_nccl_all_gather, 2, args.device, (args.device, 256 if args.device == "cuda" else 4),
                     timeout_s=180)
    out["all_gather_2_ranks"] = sorted(got, key=lambda g: g["rank"]) if got else {"errors": err}
    out["errors"] = err
    return out


# -------------------------------------------------------------------------- logprobs -----

SEQS = [[3, 4, 5, 13, 6, 2], [7, 7, 13], [10, 9, 8, 7, 6, 13, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11]]


def _logprob_rank(rank: int, world: int, port: int, device: str, model_dir: str, tp: int, ep: int) -> dict:
    from types import SimpleNamespace

    import torch.distributed as dist
    from rlcore.batch import PackedBatch
    from rlcore.heads import reference_logprobs
    from rlcore.parallel.worker import init_distributed
    from rlcore.types import HeadInput
    from rlcore_megatron.engine import HFSource, MegatronEngine
    from rlcore_megatron.settings import MegatronSettings

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    init_distributed(rank, world, f"127.0.0.1:{port}", device, 120)
    try:
        engine = MegatronEngine(HFSource.from_dir(model_dir),
                                MegatronSettings(tensor_parallel_size=tp, expert_parallel_size=ep), device=device)
        batch = PackedBatch.pack(SEQS, [1] * len(SEQS)).to(engine.device)
        engine.setup_optimizer(SimpleNamespace(lr=1e-2, betas=[0.9, 0.99], weight_decay=0.0))
        engine.train(True)
        engine.zero_grad()
        out = engine.forward(batch)
        hw = engine.head()
        lp = reference_logprobs(HeadInput(hidden=out.hidden, weight=hw.weight, labels=batch.labels(),
                                          vocab=hw.vocab, loss_mask=batch.loss_mask)).logprobs
        loss = -(lp * torch.linspace(0.5, 1.5, lp.numel(), device=lp.device)).sum() / batch.num_loss_tokens
        loss.backward()
        norm = engine.optimizer_step(grad_clip=0.0)
        return {"logprobs": lp.detach().float().cpu().tolist(), "grad_norm": float(norm),
                "layout": {k: v for k, v in engine.parallel_layout().items()},
                "attention_path": engine.attention_path}
    finally:
        dist.destroy_process_group()


def part_logprobs(args: argparse.Namespace) -> dict:
    from rlcore.testing.models import make_model_dir

    out: dict = {"errors": []}
    work = Path(args.out)
    dense = make_model_dir(work / "dense_hf", "qwen2", **DENSE)
    moe = make_model_dir(work / "moe_hf", "qwen3_moe", **{k: v for k, v in MOE_MTP.items()
                                                          if k not in ("arch", "mtp_layers")})
    for name, model_dir, dim in (("dense_tp", dense, "tp"), ("moe_ep", moe, "ep")):
        runs = {}
        for size in (1, 2):
            tp, ep = (size, 1) if dim == "tp" else (1, size)
            got, err = spawn(_logprob_rank, size, args.device, (args.device, str(model_dir), tp, ep), timeout_s=180)
            out["errors"] += [f"{name} {dim}={size}: {e}" for e in err]
            r0 = next((g for g in got if g["rank"] == 0), None)
            if r0 is not None:
                runs[size] = r0
                out.setdefault("worlds", {})[f"{name} {dim}={size}"] = r0
            # written after every world: a part stopped at its time limit keeps what finished
            Path(args.results).write_text(json.dumps(dict(out, part="logprobs", partial=True), default=str))
        if 1 in runs and 2 in runs:
            a = torch.tensor(runs[1]["logprobs"], dtype=torch.float64)
            b = torch.tensor(runs[2]["logprobs"], dtype=torch.float64)
            out[name] = {"tokens": a.numel(), "max_abs_logprob_diff": float((a - b).abs().max()),
                         "grad_norm": {f"{dim}=1": runs[1]["grad_norm"], f"{dim}=2": runs[2]["grad_norm"]},
                         "grad_norm_rel_diff": abs(runs[1]["grad_norm"] - runs[2]["grad_norm"]) / runs[1]["grad_norm"],
                         "layout_2": runs[2]["layout"], "attention_path": runs[2]["attention_path"]}
    return out


# ----------------------------------------------------------------------- DP = 2 ----------

#: five sequences of uneven lengths and a token budget of 12 a micro-batch: two data-parallel
#: replicas split them 3 + 2, each over several micro-batches (plugins/megatron/tests/parallel_worker.py)
DP_SEQS = [[3, 4, 5, 13, 6], [7, 7, 13], [10, 9, 8, 7, 6, 13, 2], [5, 6, 7, 8], [2, 3, 13, 4, 4, 9]]
DP_PROMPT_LENS = [1, 1, 2, 2, 1]
DP_MICRO_BATCH_TOKENS = 12
#: fp32 with TF32 off: the replicas compute the one-rank step up to summation order (each
#: replica's gradient sum, then the all-reduce; cuBLAS may pick other kernels for other batch
#: shapes), ~1e-7 relative on O(1) log-probs and O(0.1) gradients: 1e-5 absolute is the bound
#: test_parallel.py holds on CPU, 1e-5 relative on the gradient norm
DP_TOLERANCE = 1e-5


def _dp_rank(rank: int, world: int, port: int, device: str, model_dir: str, result: str) -> dict:
    """One step the way the trainer does it through the model-parallel rank strategy (this
    replica's micro-batches, log-probs reduced over the replicas, a fixed loss normalised by the
    whole batch's loss tokens, gradients reduced), then one optimizer step; rank 0 saves the
    log-probs, the loss, the gradient norm and every gradient (HF names)."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from rlcore.batch import PackedBatch
    from rlcore.heads import reference_logprobs
    from rlcore.parallel.model_parallel import ModelParallel
    from rlcore.parallel.worker import init_distributed
    from rlcore.ranks import TorchRanks
    from rlcore.types import HeadInput
    from rlcore_megatron.engine import HFSource, MegatronEngine
    from rlcore_megatron.weights import export_hf

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    init_distributed(rank, world, f"127.0.0.1:{port}", device, 120)
    try:
        engine = MegatronEngine(HFSource.from_dir(model_dir), device=device)
        strategy = ModelParallel(TorchRanks(), splits_samples=True)
        strategy.built(engine, None)
        batch = PackedBatch.pack(DP_SEQS, DP_PROMPT_LENS).to(engine.device)
        weights = torch.linspace(0.5, 1.5, batch.num_tokens, device=engine.device)
        engine.setup_optimizer(SimpleNamespace(lr=1e-2, betas=[0.9, 0.99], weight_decay=0.0))
        engine.train(True)
        engine.zero_grad()
        logprobs = torch.zeros(batch.num_tokens, device=engine.device)
        loss_total = torch.zeros((), device=engine.device)
        mbs = strategy.micro_batches(batch, DP_MICRO_BATCH_TOKENS)
        for mb in mbs:
            out = engine.forward(mb)
            hw = engine.head()
            lp = reference_logprobs(HeadInput(hidden=out.hidden, weight=hw.weight, labels=mb.labels(),
                                              vocab=hw.vocab, loss_mask=mb.loss_mask)).logprobs
            start = mb.token_offset - batch.token_offset
            logprobs[start: start + mb.num_tokens] = lp.detach()
            loss = -(lp * weights[start: start + mb.num_tokens]).sum() / batch.num_loss_tokens
            loss.backward()
            loss_total += loss.detach()
        strategy.reduce_logprobs(logprobs)
        strategy.reduce_gradients(engine.parameters())
        if world > 1:
            dist.all_reduce(loss_total)
        norm = engine.optimizer_step(grad_clip=0.0)
        grads = {n: t.detach().float().cpu().clone() for n, t in export_hf(
            [(n, p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in engine.named_parameters()],
            engine.names)}
        share = sorted({mb.seq_offset + i for mb in mbs for i in range(mb.num_seqs)})
        if rank == 0:
            torch.save({"logprobs": logprobs.cpu(), "grads": grads}, result)
        return {"loss": float(loss_total), "grad_norm": float(norm), "share": share, "micro_batches": len(mbs),
                "layout": dict(engine.parallel_layout())}
    finally:
        dist.destroy_process_group()


def part_dp2_equal(args: argparse.Namespace) -> dict:
    """Megatron DP=2 (two ranks, TP=1) against one rank with the whole batch, fp32: log-probs,
    loss, gradient norm and every gradient after the data-parallel reduction."""
    from rlcore.testing.models import make_model_dir

    work = Path(args.out)
    model = make_model_dir(work / "dense_hf", "qwen2", **DENSE)
    out: dict = {"errors": [], "tolerance": DP_TOLERANCE, "dtype": "float32, TF32 off"}
    runs: dict[int, dict] = {}
    for world in (1, 2):
        path = work / f"dp_world{world}.pt"
        got, err = spawn(_dp_rank, world, args.device, (args.device, str(model), str(path)), timeout_s=150)
        out["errors"] += [f"world {world}: {e}" for e in err]
        if len(got) == world and path.is_file():
            runs[world] = {"ranks": sorted(got, key=lambda g: g["rank"]), **torch.load(path)}
            out[f"world{world}"] = runs[world]["ranks"]
        Path(args.results).write_text(json.dumps(dict(out, part="dp2_equal", partial=True), default=str))
    if 1 in runs and 2 in runs:
        one, two = runs[1], runs[2]
        lp = float((one["logprobs"] - two["logprobs"]).abs().max())
        grad = max(float((one["grads"][k] - two["grads"][k]).abs().max()) for k in one["grads"])
        n1, n2 = one["ranks"][0]["grad_norm"], two["ranks"][0]["grad_norm"]
        l1, l2 = one["ranks"][0]["loss"], two["ranks"][0]["loss"]
        out["compare"] = {
            "tokens": int(one["logprobs"].numel()), "tensors": len(one["grads"]),
            "same_gradient_names": set(one["grads"]) == set(two["grads"]),
            "max_abs_logprob_diff": lp, "max_abs_grad_diff": grad,
            "loss": [l1, l2], "loss_abs_diff": abs(l1 - l2),
            "grad_norm": [n1, n2], "grad_norm_rel_diff": abs(n1 - n2) / n1,
            "shares": [r["share"] for r in two["ranks"]], "layout": two["ranks"][0]["layout"],
        }
        out["equal_within_tolerance"] = (lp < DP_TOLERANCE and grad < DP_TOLERANCE
                                         and abs(l1 - l2) < DP_TOLERANCE and abs(n1 - n2) < DP_TOLERANCE * n1
                                         and set(one["grads"]) == set(two["grads"]))
        if not out["equal_within_tolerance"]:
            out["errors"].append(f"DP=2 differs from one rank beyond {DP_TOLERANCE}: {out['compare']}")
    return out


def part_dp2_train(args: argparse.Namespace) -> dict:
    """GRPO with megatron DP=2 (TP=1 on two ranks: each replica trains on half the step's samples,
    gradients all-reduced; the writer's local rollout), fp32, the per-phase step table."""
    tiny = [f"engine.model.tiny.{k}={v}" for k, v in DENSE.items()]
    return train_part(args, "dp2_train", tiny + [f"training.steps={args.steps}", "rollout.n=8",
                                                  "data.prompts_per_step=16", "sync.bucket_mb=1"])


# ------------------------------------------------------------------------ training -------

def _measured_trainer(base: type, q_info: dict) -> type:
    """The worker's trainer with GPU-memory and export-time readings added (nothing else changes)."""

    class MeasuredTrainer(base):  # type: ignore[misc, valid-type]
        def __init__(self, *a: Any, **kw: Any):
            super().__init__(*a, **kw)
            hw = self.engine.head()
            self._device = next(iter(self.engine.parameters())).device
            group = hw.vocab.group
            q_info["head"] = {"rows_here": int(hw.weight.shape[0]), "vocab_start": int(hw.vocab.start),
                              "vocab_end": int(hw.vocab.end), "vocab_size": int(hw.vocab.vocab_size),
                              "sharded_over": torch.distributed.get_world_size(group) if group is not None else 1}
            q_info["forward_fn"] = {"name": str(self.cfg.forward.name), "type": type(self.forward_fn).__module__ + "."
                                    + type(self.forward_fn).__qualname__}
            q_info["layout"] = dict(self.strategy.layout)
            q_info["device"] = str(self._device)
            q_info["model_bytes_here"] = sum(p.numel() * p.element_size() for p in self.engine.parameters())
            calls = q_info["head_calls"] = {"total": 0, "vocab_sharded": 0, "with_fused_loss": 0}
            head_fn = self.forward_fn

            def counted_head(inp: Any) -> Any:  # the run's head, called as it is; only counted
                calls["total"] += 1
                calls["vocab_sharded"] += int(inp.vocab is not None and inp.vocab.group is not None)
                calls["with_fused_loss"] += int(getattr(inp, "loss", None) is not None)
                if callable(getattr(head_fn, "kernels_for", None)):  # rlcore-fused: which backend serves it
                    calls["kernels"] = type(head_fn.kernels_for(inp.hidden.device)).__name__
                return head_fn(inp)

            self.forward_fn = counted_head
            q_info["pushes"] = []

        def _export_for_push(self, meter: Any) -> Any:
            if not BREAKDOWN:
                yield from super()._export_for_push(meter)
                return
            stream = super()._export_for_push(meter)
            while True:  # the time to produce each tensor (the NCCL gather), GPU included
                t0 = time.perf_counter()
                try:
                    item = next(stream)
                except StopIteration:
                    break
                _sync(self._device.type)
                _PHASES["export_gather"] += time.perf_counter() - t0
                yield item

        def _push(self, version: int) -> Any:
            cuda = self._device.type == "cuda"
            if UNVERIFIED_FROM and version >= UNVERIFIED_FROM and getattr(self.sync, "verify", False):
                self.sync.verify = False  # the same run's later pushes without checksums (coverage only)
            if BREAKDOWN:
                _timed_receiver(self.backend, self._device.type)
                _PHASES.update(dict.fromkeys(_PHASES, 0.0))
            if cuda:
                torch.cuda.synchronize()
                base_alloc = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            with _counted_all_gathers() as all_gathers:
                report = super()._push(version)
            if cuda:
                torch.cuda.synchronize()
            row = {"version": version, "seconds": time.perf_counter() - t0, "bytes": int(report.bytes),
                   "buckets": int(report.num_buckets), "verified": bool(getattr(report, "verified", False)),
                   "level": (getattr(report, "details", None) or {}).get("level"), "all_gathers": dict(all_gathers)}
            sync_phases = (getattr(report, "details", None) or {}).get("phases")
            if sync_phases:  # the sync's own host-time phases, where it reports them
                row["sync_phases"] = dict(sync_phases)
            if BREAKDOWN:
                row["phases"] = dict(_PHASES)
                row["phases"]["rest"] = row["seconds"] - sum(_PHASES.values())
            if cuda:
                row.update(allocated_before=base_alloc, peak_extra_bytes=torch.cuda.max_memory_allocated() - base_alloc,
                           allocated_after=torch.cuda.memory_allocated())
            q_info["pushes"].append(row)
            _dump(q_info)  # a part stopped at its time limit keeps every rank's readings so far
            if version == int(self.cfg.training.steps):  # after the timed last push
                inner = getattr(self.backend, "inner", None)
                if inner is not None and hasattr(inner, "_views"):  # the writer's local rollout
                    # the batched checksums (one kernel) the pushes were verified with, against the
                    # per-tensor reference on every tensor the rollout holds
                    try:
                        from rlcore.sync import ChecksumPlan, tensor_checksum
                    except ImportError as exc:  # the core's checksums changed shape: not this bench's check
                        q_info["checksum_plan_check"] = {"skipped": str(exc)}
                        return report
                    views = list(inner._views.values())
                    plan = ChecksumPlan(views)
                    batched = plan.compute()
                    reference = [tensor_checksum(v) for v in views]
                    q_info["checksum_plan_check"] = {
                        "tensors": len(views), "backend": plan.backend, "equal": batched == reference,
                        "differ": sum(a != b for a, b in zip(batched, reference, strict=True))}
            return report

        def _checkpoint_final(self, wall: float) -> None:
            if NO_FINAL_CHECKPOINT:  # the sync parts measure pushes; a 2 GB model's shards cost ~40 s
                q_info["final_checkpoint"] = "skipped by the bench (TWO_GPU_NO_FINAL_CHECKPOINT=1)"
                return
            super()._checkpoint_final(wall)

        def run(self) -> Any:
            summary = super().run()
            # the gather alone: one more export drained by every rank (no bucket, no rollout)
            torch.distributed.barrier()
            if self._device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            total = 0
            for _name, t in self.engine.export_hf_weights():
                total += t.numel() * t.element_size()
            if self._device.type == "cuda":
                torch.cuda.synchronize()
            q_info["export_only"] = {"bytes": total, "seconds": time.perf_counter() - t0}
            _dump(q_info)
            return summary

    return MeasuredTrainer


#: ``TWO_GPU_UNVERIFIED_FROM=v``: pushes from version v on run with ``sync.verify`` off (the sync
#: object's own flag), so one run measures verified and unverified pushes of the same model
UNVERIFIED_FROM = int(os.environ.get("TWO_GPU_UNVERIFIED_FROM", "0") or 0)
NO_FINAL_CHECKPOINT = os.environ.get("TWO_GPU_NO_FINAL_CHECKPOINT") == "1"


@contextlib.contextmanager
def _counted_all_gathers() -> Any:
    """Counts this rank's all-gathers during a push (the export's: one per group of about a bucket
    since issue 32): ``into`` the flat gather the export calls (``all_gather_single`` where torch
    has it, else ``all_gather_into_tensor``), ``list`` per-tensor ``all_gather``."""
    import torch.distributed as dist

    into_name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    counts = {"into": 0, "list": 0}
    saved = {into_name: getattr(dist, into_name), "all_gather": dist.all_gather}

    def counted(kind: str, fn: Any) -> Any:
        def call(*a: Any, **kw: Any) -> Any:
            counts[kind] += 1
            return fn(*a, **kw)
        return call

    setattr(dist, into_name, counted("into", saved[into_name]))
    dist.all_gather = counted("list", saved["all_gather"])
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _dump(info: dict) -> None:
    path = info.get("dump_path")
    if path:
        Path(path).write_text(json.dumps(info, default=str))


#: ``--breakdown``: every phase of a push is timed (with a GPU synchronisation after each, so the
#: push is slower than without: the phases say where its time goes, not how fast it is)
BREAKDOWN = os.environ.get("TWO_GPU_BREAKDOWN") == "1"
_PHASES = {"export_gather": 0.0, "sender_checksums": 0.0, "receive_bucket": 0.0, "commit": 0.0,
           "receiver_checksums": 0.0}


def _timed(fn: Any, phase: str, device: str) -> Any:
    def run(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        _sync(device)
        _PHASES[phase] += time.perf_counter() - t0
        return out

    run.timed = True  # type: ignore[attr-defined]
    return run


def _timed_receiver(backend: Any, device: str) -> None:
    """Time the writer's rollout (the receiver) and the sender's bucket checksums, once per process."""
    from rlcore.sync import Bucket

    inner = getattr(backend, "inner", None)
    if inner is not None and not getattr(inner.receive_bucket, "timed", False):
        inner.receive_bucket = _timed(inner.receive_bucket, "receive_bucket", device)
        inner.commit_update = _timed(inner.commit_update, "commit", device)
        inner.weight_checksums = _timed(inner.weight_checksums, "receiver_checksums", device)
    if hasattr(Bucket, "checksums") and not getattr(Bucket.checksums, "timed", False):
        Bucket.checksums = _timed(Bucket.checksums, "sender_checksums", device)


def _train_rank(rank: int, world: int, port: int, overrides: list[str], dump_dir: str) -> dict:
    import rlcore.trainer
    from rlcore.parallel.worker import config_yaml, run_rank
    from rlcore.stack import load_stack

    torch.backends.cuda.matmul.allow_tf32 = False
    info: dict = {"rank": rank, "dump_path": str(Path(dump_dir) / f"rank{rank}.json")}
    rlcore.trainer.Trainer = _measured_trainer(rlcore.trainer.Trainer, info)
    stack = load_stack(str(EXAMPLE), overrides)
    t0 = time.perf_counter()
    summary = run_rank(config_yaml(stack.config), rank, world, f"127.0.0.1:{port}", overwrite=True)
    info["run_seconds"] = time.perf_counter() - t0
    info["completed"] = bool(summary.get("completed")) if isinstance(summary, dict) else None
    return info


PHASES = ("generate_seconds", "train_seconds", "sync_seconds", "step_seconds")


def _median(xs: list[float]) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    return xs[len(xs) // 2] if xs else None


def train_part(args: argparse.Namespace, name: str, overrides: list[str]) -> dict:
    out_dir = Path(args.out) / name
    ov = RUN + [f"engine.device={args.device}", f"output.dir={out_dir}"] + overrides
    dump_dir = Path(args.out) / f"{name}_ranks"
    dump_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    got, err = spawn(_train_rank, 2, args.device, (ov, str(dump_dir)), timeout_s=float(args.rank_timeout))
    res: dict = {"overrides": ov, "wall_seconds": time.perf_counter() - t0, "errors": err,
                 "ranks": sorted(got, key=lambda g: g["rank"])}
    if len(got) < 2:  # a rank that did not finish: what it wrote after its last push
        done = {g["rank"] for g in got}
        for path in sorted(dump_dir.glob("rank*.json")):
            info = json.loads(path.read_text())
            if info.get("rank") not in done:
                res["ranks"].append(dict(info, unfinished=True))
    metrics = out_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.is_file() else []
    res["metrics"] = rows
    if rows:
        later = rows[1:] or rows  # the first step pays for compilation and allocator warm-up
        res["summary"] = {
            "steps": len(rows),
            "reward": [round(r.get("reward_mean", float("nan")), 4) for r in rows],
            "median_after_first": {k: _median([r.get(k) for r in later]) for k in PHASES},
            "first_step": {k: rows[0].get(k) for k in PHASES},
            "sync_bytes": rows[-1].get("sync_bytes"), "sync_buckets": rows[-1].get("sync_buckets"),
            "sync_GBps_median": _median([r["sync_bytes"] / r["sync_seconds"] / 1e9 for r in later
                                         if r.get("sync_seconds")]),
            "sync_all_verified": all(r.get("sync_verified") for r in rows),
            "sync_levels": sorted({str(r.get("sync_level")) for r in rows}),
            "logprob_mismatch_max": max(r.get("logprob_mismatch_max", 0.0) for r in rows),
            "weight_version": rows[-1].get("weight_version"),
            "extra": {k: rows[-1][k] for k in rows[-1] if k.startswith(("loss/", "mtp/", "push_"))},
        }
    for g in res["ranks"]:
        pushes = g.get("pushes") or []
        peaks = [p["peak_extra_bytes"] for p in pushes if "peak_extra_bytes" in p]
        if peaks:
            g["peak_extra_push_MiB_max"] = max(peaks) / MIB
        if g.get("export_only", {}).get("seconds"):
            e = g["export_only"]
            g["export_only"]["GBps"] = e["bytes"] / e["seconds"] / 1e9
    return res


def part_tp_train(args: argparse.Namespace) -> dict:
    tiny = [f"engine.model.tiny.{k}={v}" for k, v in DENSE.items()]
    return train_part(args, "tp_train", tiny + ["megatron.tensor_parallel_size=2", f"training.steps={args.steps}",
                                                 "rollout.n=8", "data.prompts_per_step=16", "sync.bucket_mb=1"])


def part_ep_mtp_train(args: argparse.Namespace) -> dict:
    tiny = [f"engine.model.tiny.{k}={v}" for k, v in MOE_MTP.items()]
    return train_part(args, "ep_mtp_train", tiny + [
        "plugins=[megatron,mtp]", "megatron.expert_parallel_size=2", "megatron.export_mtp=false",
        f"training.steps={args.steps}", "rollout.n=8", "data.prompts_per_step=16", "sync.bucket_mb=1"])


def part_fused_tp_train(args: argparse.Namespace) -> dict:
    tiny = [f"engine.model.tiny.{k}={v}" for k, v in DENSE.items()]
    return train_part(args, "fused_tp_train", tiny + [
        "plugins=[megatron,fused]", "forward.name=fused", "megatron.tensor_parallel_size=2",
        # 300 ids (the task's words and unused ones) pad to 512 over TP=2: both ranks hold real rows
        "engine.model.tiny.vocab_size=300",
        f"training.steps={args.steps}", "rollout.n=8", "data.prompts_per_step=16", "sync.bucket_mb=1"])


def _sync_big(args: argparse.Namespace, name: str, variant: list[str], layers_factor: int = 1,
              steps: int = 3) -> dict:
    big = dict(BIG if args.device == "cuda" else BIG_CPU)
    big["num_layers"] *= layers_factor
    bucket = 64 if args.device == "cuda" else 0.25  # two buckets (128 MiB) << the model (690 MiB)
    tiny = [f"engine.model.tiny.{k}={v}" for k, v in big.items()]
    dtype = args.big_dtype
    # the pushes are measured, not the final save: no HF export, no final checkpoint (the ranks inherit)
    os.environ["TWO_GPU_NO_FINAL_CHECKPOINT"] = "1"
    res = train_part(args, name, tiny + [
        f"engine.model.dtype={dtype}", "megatron.tensor_parallel_size=2", f"training.steps={steps}", "rollout.n=4",
        "data.prompts_per_step=4", f"sync.bucket_mb={bucket}", "engine.model.tiny.init_std=0.02",
        "output.export_hf=never"] + variant)
    res["bucket_MiB"] = bucket
    res["variant"] = variant
    res["pushes"] = push_summary(res)
    return res


def push_summary(res: dict) -> dict:
    """The writer's pushes: GB/s of each (bytes / the push's wall time around the trainer's
    ``_push``, and / the trainer's ``sync_seconds``), the medians of the verified pushes after the
    first and of the unverified ones, every rank's peak extra memory, the sync's phases."""
    ranks = {g.get("rank"): g for g in res.get("ranks", [])}
    writer = (ranks.get(0) or {}).get("pushes") or []
    sync_s = {r.get("weight_version"): r.get("sync_seconds") for r in res.get("metrics", [])}
    rows = []
    for p in writer:
        row = {"version": p["version"], "verified": p.get("verified"), "level": p.get("level"),
               "all_gathers": p.get("all_gathers"),
               "bytes": p["bytes"], "buckets": p["buckets"], "push_s": p["seconds"],
               "GBps": p["bytes"] / p["seconds"] / 1e9 if p["seconds"] else None}
        if sync_s.get(p["version"]):
            row["sync_seconds"] = sync_s[p["version"]]
            row["GBps_sync_seconds"] = p["bytes"] / sync_s[p["version"]] / 1e9
        row["sync_phases"] = p.get("sync_phases")
        row["phases"] = p.get("phases")
        rows.append(row)
    verified = [r for r in rows if r["verified"]]
    unverified = [r for r in rows if not r["verified"]]
    return {
        "rows": rows,
        "verified_after_first_GBps_median": _median([r["GBps"] for r in verified[1:]]),
        "unverified_GBps_median": _median([r["GBps"] for r in unverified]),
        "levels": sorted({str(r["level"]) for r in rows}),
        "peak_extra_MiB": {f"rank{k}": [round(p.get("peak_extra_bytes", 0) / MIB, 1) for p in (g.get("pushes") or [])]
                           for k, g in sorted(ranks.items(), key=lambda kv: str(kv[0]))},
        "model_bytes": writer[-1]["bytes"] if writer else None,
    }


def part_sync_big(args: argparse.Namespace) -> dict:
    """The local rollout staged (default): the whole new version is held apart until commit."""
    return _sync_big(args, "sync_big", [])


def part_sync_big_in_place(args: argparse.Namespace) -> dict:
    """``rollout.local_update=in_place``: each bucket lands in the live weights (no model copy)."""
    return _sync_big(args, "sync_big_in_place", ["rollout.local_update=in_place"])


def part_sync_large_in_place(args: argparse.Namespace) -> dict:
    """In place, 3x the layers (24 on the GPU: 1.08 B parameters, 2.2 GB in bf16)."""
    return _sync_big(args, "sync_large_in_place", ["rollout.local_update=in_place"], layers_factor=3)


def part_sync_large(args: argparse.Namespace) -> dict:
    """In place on the 2.2 GB model: ``--big-steps`` pushes verified (coverage+exact), then
    ``--unverified-pushes`` more of the same run with ``sync.verify`` off."""
    verified = max(2, int(args.big_steps))
    if args.unverified_pushes:
        os.environ["TWO_GPU_UNVERIFIED_FROM"] = str(verified + 1)  # the ranks inherit it
    return _sync_big(args, "sync_large", ["rollout.local_update=in_place"], layers_factor=3,
                     steps=verified + int(args.unverified_pushes))


def part_sync_big_breakdown(args: argparse.Namespace) -> dict:
    """In place and verified, every phase of the push timed (``TWO_GPU_BREAKDOWN=1`` in the ranks)."""
    os.environ["TWO_GPU_BREAKDOWN"] = "1"  # the spawned ranks inherit it
    return _sync_big(args, "sync_big_breakdown", ["rollout.local_update=in_place"])


def part_sync_big_unverified(args: argparse.Namespace) -> dict:
    """In place and ``sync.verify=false``: what the checksums (``exact``) cost on top of coverage."""
    return _sync_big(args, "sync_big_unverified", ["rollout.local_update=in_place", "sync.verify=false"])


PARTS = {"d2d": part_d2d, "logprobs": part_logprobs, "tp_train": part_tp_train, "ep_mtp_train": part_ep_mtp_train,
         "fused_tp_train": part_fused_tp_train, "sync_big": part_sync_big,
         "sync_big_in_place": part_sync_big_in_place, "sync_big_unverified": part_sync_big_unverified,
         "sync_big_breakdown": part_sync_big_breakdown, "sync_large_in_place": part_sync_large_in_place,
         "sync_large": part_sync_large, "dp2_equal": part_dp2_equal, "dp2_train": part_dp2_train}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", required=True, choices=sorted(PARTS))
    p.add_argument("--out", required=True)
    p.add_argument("--results", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--big-dtype", default="bfloat16", help="sync_big's model dtype")
    p.add_argument("--rank-timeout", type=float, default=240)
    p.add_argument("--big-steps", type=int, default=4, help="sync_large: verified pushes")
    p.add_argument("--unverified-pushes", type=int, default=3, help="sync_large: unverified pushes after them")
    args = p.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        res = PARTS[args.part](args)
        rc = 0 if not res.get("errors") else 1
    except Exception as exc:  # noqa: BLE001 - the part's failure is its result
        res = {"errors": [f"{type(exc).__name__}: {exc}", traceback.format_exc()[-3000:]]}
        rc = 1
    res.update(part=args.part, device=args.device, part_seconds=time.perf_counter() - t0,
               python=sys.version.split()[0], torch=torch.__version__)
    try:
        import megatron.core as mc

        res["megatron_core"] = mc.__version__
    except Exception:  # noqa: BLE001
        pass
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps(res, indent=1, default=str))
    brief = {k: v for k, v in res.items() if k not in ("metrics", "ranks", "overrides")}
    print(json.dumps(brief, indent=1, default=str)[:6000], flush=True)
    for g in res.get("ranks", []):
        print(f"rank {g.get('rank')}: peak extra push MiB {g.get('peak_extra_push_MiB_max')}, "
              f"export-only {g.get('export_only')}, head {g.get('head')}, forward {g.get('forward_fn')}", flush=True)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
