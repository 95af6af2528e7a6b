"""Colocated weight sync on one GPU through rlcore.transport's CUDA IPC buckets.

Two processes share one GPU, started with ``multiprocessing`` spawn (not Ray: Ray's wheel does
not fit one call of the GPU machine, so the same worker code is launched directly):

* the **trainer** holds the model's weights (HF names, bf16, seeded) and pushes them with
  :class:`rlcore.transport.WeightSender` over a :class:`~rlcore.transport.CudaIpcPlane`;
* the **rollout replica** holds parameters of the same names and shapes and loads every bucket
  into them in place (one ``copy_`` per tensor, the way an engine's loader copies), through
  :class:`rlcore.transport.WeightReceiver`.

In the same run, the trainer measures one device-to-device copy of the model's bytes (the
bandwidth ceiling of a copy), the per-tensor copy of the model inside one process, and the
bucket fill alone. Each configuration (bucket size, number of buffers) gets one warm-up push and
``--repeats`` timed pushes; a verified push (per-bucket checksums) and a final comparison of
every tensor's checksum on both sides end the run. Writes ``results.json`` to ``--out``.

Usage::

    PYTHONPATH=core/src python core/bench/bench_transport_gpu.py --out DIR [--device cuda|cpu]

``--device cpu`` runs the same code over shared memory with a small model (a check of the
script, not a benchmark).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time

import torch

GiB = 1 << 30
MiB = 1 << 20


def model_shapes(kind: str, scale: float = 1.0) -> list[tuple[str, tuple[int, ...]]]:
    """HF names and shapes. ``moe``: Qwen3-MoE-like, 16 layers x 32 experts (1,536 expert
    matrices, ~6.5 GB bf16); ``dense``: Llama-like, 12 layers of hidden 4096 (~6.9 GB)."""
    shapes: list[tuple[str, tuple[int, ...]]] = []
    if kind == "moe":
        hidden, inter, layers, experts, vocab = int(2048 * scale), int(768 * scale), 16, 32, 151936
        if scale < 1:
            layers, experts, vocab = 2, 8, 1024
    else:
        hidden, inter, layers, experts, vocab = int(4096 * scale), int(14336 * scale), 12, 0, 128256
        if scale < 1:
            layers, vocab = 2, 1024
    shapes.append(("model.embed_tokens.weight", (vocab, hidden)))
    for i in range(layers):
        p = f"model.layers.{i}"
        for n, s in (("q_proj", (hidden, hidden)), ("k_proj", (hidden // 4, hidden)), ("v_proj", (hidden // 4, hidden)),
                     ("o_proj", (hidden, hidden))):
            shapes.append((f"{p}.self_attn.{n}.weight", s))
        shapes += [(f"{p}.input_layernorm.weight", (hidden,)), (f"{p}.post_attention_layernorm.weight", (hidden,))]
        if experts:
            shapes.append((f"{p}.mlp.gate.weight", (experts, hidden)))
            for e in range(experts):
                for n, s in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
                    shapes.append((f"{p}.mlp.experts.{e}.{n}.weight", s))
        else:
            for n, s in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
                shapes.append((f"{p}.mlp.{n}.weight", s))
    shapes += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return shapes


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ReplicaParams:
    """The rollout side's parameters, loaded in place bucket by bucket (a BucketReceiver)."""

    def __init__(self, params: dict[str, torch.Tensor]):
        self.params = params
        self.version = 0
        self.pending: int | None = None

    def begin_update(self, version: int) -> None:
        self.pending = version

    def receive_bucket(self, bucket) -> None:
        pairs = [(self.params[name], view) for name, view in bucket.tensors()]
        # one fused launch per bucket (an engine's loader would copy tensor by tensor; the
        # in-process baselines below time both)
        torch._foreach_copy_([d for d, _ in pairs], [v for _, v in pairs])

    def commit_update(self, version: int) -> None:
        sync(next(iter(self.params.values())).device)  # the push is done when the copies are
        self.version, self.pending = version, None

    def abort_update(self) -> None:
        self.pending = None


def rollout_main(conn, result_conn, kind: str, scale: float, device: str) -> None:
    from rlcore.sync import WeightManifest, tensor_checksum
    from rlcore.transport import PipeChannel, WeightReceiver, receiver_plane_for

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    shapes = model_shapes(kind, scale)
    replica = ReplicaParams({n: torch.zeros(s, dtype=torch.bfloat16, device=dev) for n, s in shapes})
    plane = receiver_plane_for("cuda_ipc" if dev.type == "cuda" else "shm")
    receiver = WeightReceiver(PipeChannel(conn, "trainer"), plane, manifest=WeightManifest(dict(shapes)),
                              timeout=300)
    try:
        summaries = receiver.serve(replica)
        sums = {n: tensor_checksum(t) for n, t in replica.params.items()}
        result_conn.send(("ok", replica.version, sums, summaries))
    except Exception:
        import traceback

        result_conn.send(("crash", traceback.format_exc()))


def timed(fn, device: torch.device, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


def trainer_main(conn, result_conn, args: dict) -> None:
    from rlcore.sync import iter_buckets, tensor_checksum
    from rlcore.transport import CudaIpcPlane, PipeChannel, ShmPlane, WeightSender

    res: dict = {"configs": []}
    try:
        dev = torch.device(args["device"])
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        shapes = model_shapes(args["kind"], args["scale"])
        g = torch.Generator(device=dev).manual_seed(0)
        weights = [(n, torch.randn(s, generator=g, device=dev, dtype=torch.float32).to(torch.bfloat16))
                   for n, s in shapes]
        nbytes = sum(t.numel() * t.element_size() for _, t in weights)
        res.update(kind=args["kind"], tensors=len(weights), bytes=nbytes,
                   expert_tensors=sum(".experts." in n for n, _ in weights))
        # ceilings, same process, same run
        src = torch.empty(nbytes, dtype=torch.uint8, device=dev).fill_(1)
        dst = torch.empty_like(src)
        t = timed(lambda: dst.copy_(src), dev, 7)[1:]
        res["d2d_copy"] = {"seconds": min(t), "GBps": nbytes / min(t) / 1e9}
        src = dst = None  # freed before the pushes
        twins = [torch.empty_like(w) for _, w in weights]

        def per_tensor():
            for (_, w), d in zip(weights, twins, strict=True):
                d.copy_(w, non_blocking=True)

        t = timed(per_tensor, dev, 5)[1:]
        res["per_tensor_copy_in_process"] = {"seconds": min(t), "GBps": nbytes / min(t) / 1e9}
        t = timed(lambda: torch._foreach_copy_(twins, [w for _, w in weights]), dev, 5)[1:]
        res["foreach_copy_in_process"] = {"seconds": min(t), "GBps": nbytes / min(t) / 1e9}
        twins = []
        slots = [torch.empty(512 * MiB, dtype=torch.uint8, device=dev) for _ in range(2)]

        def fill_only(defer: bool):
            turn = [0]

            def alloc(n, _d):
                turn[0] ^= 1
                return slots[turn[0]][:n]

            for _ in iter_buckets(iter(weights), 512 * MiB, device=dev, group_by_dtype=False, allocator=alloc,
                                  defer_copies=defer):
                pass

        # tensors above 512 MiB would need pieces here; fill_only is run on the rest only
        big = [n for n, w in weights if w.numel() * 2 > 512 * MiB]
        small = [(n, w) for n, w in weights if n not in big]
        small_bytes = sum(w.numel() * 2 for _, w in small)
        saved = weights
        weights = small
        for defer in (False, True):
            t = timed(lambda d=defer: fill_only(d), dev, 4)[1:]
            res[f"bucket_fill_alone_{'fused' if defer else 'per_tensor'}"] = {
                "seconds": min(t), "GBps": small_bytes / min(t) / 1e9, "note": f"without {big} (larger than a bucket)"}
        weights = saved
        slots = []

        version = 0
        for slot_mib, num_slots, fused in args["configs"]:
            plane = CudaIpcPlane(dev) if dev.type == "cuda" else ShmPlane()
            sender = WeightSender(PipeChannel(conn, "rollout"), plane, slot_mib * MiB, num_slots=num_slots,
                                  verify=False, timeout=300, fused_fill=fused)
            reports, peaks = [], []
            for r in range(args["repeats"] + 1):
                version += 1
                if dev.type == "cuda":
                    base = torch.cuda.memory_allocated(dev)
                    torch.cuda.reset_peak_memory_stats(dev)
                rep = sender.send(iter(weights), version)
                if dev.type == "cuda":
                    peaks.append((torch.cuda.max_memory_allocated(dev) - base) / MiB)
                if r:  # the first push of a configuration is the warm-up
                    reports.append(rep)
            secs = [rep.seconds for rep in reports]
            best = reports[secs.index(min(secs))]
            row = {"slot_mib": slot_mib, "num_slots": num_slots, "fused_fill": fused, "buckets": best.num_buckets,
                   "median_s": statistics.median(secs), "best_s": min(secs),
                   "GBps_median": nbytes / statistics.median(secs) / 1e9, "GBps_best": nbytes / min(secs) / 1e9,
                   "slot_waits": best.details["slot_waits"], "max_lent": best.details["max_lent"],
                   "sender_phases_best": best.details["sender_phases"],
                   "receiver_phases_best": best.details["receiver_phases"],
                   "peak_extra_mib_per_push": [round(p, 1) for p in peaks]}
            res["configs"].append(row)
            print(json.dumps(row), flush=True)
            sender.close()

        # verified pushes: new weights each time, per-bucket checksums, then every tensor compared
        plane = CudaIpcPlane(dev) if dev.type == "cuda" else ShmPlane()
        sender = WeightSender(PipeChannel(conn, "rollout"), plane, 512 * MiB, num_slots=2, verify=True, timeout=300,
                              fused_fill=True)
        for _ in range(2):
            for _, w in weights:
                w.mul_(-1)
            version += 1
            rep = sender.send(iter(weights), version)
        res["verified_push"] = {"seconds": rep.seconds, "GBps": nbytes / rep.seconds / 1e9,
                                "level": rep.details["level"], "checked_tensors": rep.checked,
                                "sender_phases": rep.details["sender_phases"],
                                "receiver_phases": rep.details["receiver_phases"]}
        res["final_version"] = version
        res["trainer_checksums"] = {n: tensor_checksum(w) for n, w in weights}
        conn.send(("close",))
        sender.close()
        result_conn.send(("ok", res))
    except Exception:
        import traceback

        result_conn.send(("crash", traceback.format_exc(), res))
        try:
            conn.send(("close",))
        except Exception:  # noqa: BLE001
            pass


def run_model(kind: str, args) -> dict:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    tr_parent, tr_child = ctx.Pipe()
    ro_parent, ro_child = ctx.Pipe()
    scale = 1.0 if args.device.startswith("cuda") else 0.05
    configs = ([(512, 1, False), (512, 2, False), (512, 1, True), (512, 2, True), (512, 3, True), (256, 2, True),
                (1024, 2, True), (2048, 2, True)]
               if args.device.startswith("cuda") else [(1, 1, False), (1, 2, True)])
    t0 = time.time()
    ro = ctx.Process(target=rollout_main, args=(b, ro_child, kind, scale, args.device))
    tr = ctx.Process(target=trainer_main, args=(a, tr_child, {"device": args.device, "kind": kind, "scale": scale,
                                                             "configs": configs, "repeats": args.repeats}))
    ro.start()
    tr.start()
    if not tr_parent.poll(args.timeout):
        tr.kill()
        ro.kill()
        return {"error": f"trainer gave no answer in {args.timeout} s"}
    tres = tr_parent.recv()
    rres = ro_parent.recv() if ro_parent.poll(120) else ("crash", "rollout gave no answer")
    tr.join(60)
    ro.join(60)
    out = tres[1] if tres[0] == "ok" else {"trainer_crash": tres[1], **(tres[2] if len(tres) > 2 else {})}
    if rres[0] != "ok":
        out["rollout_crash"] = rres[1]
    elif tres[0] == "ok":
        sums = out.pop("trainer_checksums")
        out["rollout_version"] = rres[1]
        out["all_tensors_equal_after_sync"] = rres[2] == sums and rres[1] == out["final_version"]
        out["rollout_levels"] = sorted({s["level"] for s in rres[3]})
    out["wall_s"] = time.time() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", default="moe,dense")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=240)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = {"command": " ".join([sys.executable, *sys.argv]), "torch": torch.__version__,
               "machine": platform.node(), "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
               "device_name": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else platform.processor()}
    for kind in args.models.split(","):
        results[kind] = run_model(kind, args)
        print(kind, json.dumps({k: v for k, v in results[kind].items() if k != "configs"}, default=str)[:3000],
              flush=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
