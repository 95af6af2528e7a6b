"""Colocated weight sync on one GPU: the source-mapped transport against a device-to-device copy.

Two processes share one GPU, started with ``multiprocessing`` spawn (not Ray: Ray's wheel does
not fit one call of the GPU machine; the worker code is the same): the **trainer** holds the
weights (HF names, bf16, seeded) and the **rollout replica** holds tensors of the same names and
shapes (no generation engine). Per model, in one pair of processes:

1. reference points, trainer process: one device-to-device copy of the model's bytes, and the
   replica's copy program (:class:`rlcore_ray.transport.CopyProgram`) run inside one process;
2. the batched checksum (:class:`rlcore.sync.ChecksumPlan`) checked equal to
   ``tensor_checksum`` on every tensor, and both timed;
3. the mapped path (``MappedSender`` / ``MappedReceiver``) with five copy strategies on the
   receiver (``MAPPED``; default: copies >= 16 MiB one by one, the rest in one Triton launch),
   1 first push (layout, IPC opens) + ``--repeats`` pushes each; then verified pushes (new weights
   each time, checksums on both sides); then a push during which the trainer writes one byte
   after its checksum (must fail with the receiver aborted); then a good push and every tensor
   compared bitwise with the trainer's.

The bitwise comparison receives the trainer's tensors through torch's own CUDA IPC pickling
(``torch.multiprocessing`` reductions, one handle per tensor), independent of the transport.

Models: ``dense`` (Llama-like, 111 tensors, 7.34 GB), ``moe`` (Qwen3-MoE-like, 1,651 tensors of
which 1,536 expert matrices, 6.41 GB; every tensor allocated on its own, on both sides) and
``moe_flat`` (the same tensors carved out of one flat buffer on both sides, as a trainer's
contiguous parameter buffer would be). Writes ``results.json`` to ``--out`` and prints a table.

The run of record (docs/benchmarks/transport.md) also timed the bucket path (``WeightSender`` over
``CudaIpcPlane``) in the same processes; that code was deleted in 5ffb9cf (no run used it), and
this script lost that column with it.

Usage::

    python plugins/ray/bench/bench_transport_mapped_gpu.py --out DIR [--device cuda|cpu]

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


# (name, big_bytes, fused): how the replica copies; the default last, it goes on with the verified pushes
MAPPED = [("all_memcpy", 0, "foreach"), ("all_foreach", 1 << 62, "foreach"), ("all_triton", 1 << 62, "triton"),
          ("memcpy16M_foreach", 16 * MiB, "foreach"), ("default", 16 * MiB, "auto")]


def allocate(shapes, dev, flat: bool, seed: int | None) -> dict[str, torch.Tensor]:
    if dev.type == "cpu":  # the CPU analogue of CUDA IPC handles: shared memory named by file
        import torch.multiprocessing as tmp

        tmp.set_sharing_strategy("file_system")
    out: dict[str, torch.Tensor] = {}
    g = torch.Generator(device=dev).manual_seed(seed) if seed is not None else None
    total = sum(int(torch.Size(s).numel()) for _, s in shapes)
    buf = torch.empty(total, dtype=torch.bfloat16, device=dev) if flat else None
    if buf is not None and dev.type == "cpu":
        buf.share_memory_()
    at = 0
    for name, shape in shapes:
        n = int(torch.Size(shape).numel())
        if buf is not None:
            t = buf[at:at + n].view(shape)
            at += n
        else:
            t = torch.empty(shape, dtype=torch.bfloat16, device=dev)
            if dev.type == "cpu":
                t.share_memory_()
        if g is not None:
            t.copy_(torch.randn(shape, generator=g, device=dev, dtype=torch.float32))
        else:
            t.zero_()
        out[name] = t
    return out


class Replica:
    """The rollout side's parameters (a BucketReceiver): the mapped receiver copies straight into
    them (``direct_destinations``); ``receive_bucket`` loads what has no direct destination."""

    def __init__(self, params: dict[str, torch.Tensor]):
        self.params = params
        self.version = 0
        self.pending: int | None = None

    def direct_destinations(self) -> dict[str, torch.Tensor]:
        return self.params

    def begin_update(self, version: int) -> None:
        self.pending = version

    def receive_bucket(self, bucket) -> None:
        pairs = [(self.params[name], view) for name, view in bucket.tensors()]
        torch._foreach_copy_([d for d, _ in pairs], [v for _, v in pairs])

    def commit_update(self, version: int) -> None:
        sync(next(iter(self.params.values())).device)  # the push is done when the copies are
        self.version, self.pending = version, None

    def abort_update(self) -> None:
        self.pending = None


def bitwise_mismatches(mine: dict[str, torch.Tensor], storages: list, metas: list) -> tuple[int, int]:
    """Tensors of ``mine`` whose bytes differ from the trainer's (``storages``: the trainer's
    storages as uint8 tensors, received through torch's own CUDA IPC pickling)."""
    bases = dict(storages)
    bad = 0
    for name, key, offset, nbytes in metas:
        a = mine[name].reshape(-1).view(torch.uint8)
        bad += int(not torch.equal(a, bases[key][offset:offset + nbytes]))
    return bad, len(metas)


def cuda_indexed(dev: torch.device) -> torch.device:
    """``cuda`` as ``cuda:0`` (``torch.cuda.set_device`` refuses a device without an index)."""
    return torch.device("cuda", 0) if dev.type == "cuda" and dev.index is None else dev


def rollout_main(conn, result_conn, kind: str, scale: float, device: str) -> None:
    from rlcore.sync import WeightManifest
    from rlcore_ray.transport import MappedReceiver
    from rlcore_ray.transport.testing import PipeChannel

    dev = cuda_indexed(torch.device(device))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    shapes = model_shapes(kind.removesuffix("_flat"), scale)
    replica = Replica(allocate(shapes, dev, flat=kind.endswith("_flat"), seed=None))
    manifest = WeightManifest(dict(shapes))
    channel = PipeChannel(conn, "trainer")
    log = []
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "phase" and msg[1] == "mapped":
                receiver = MappedReceiver(channel, manifest=manifest, timeout=300, big_bytes=msg[2], fused=msg[3])
                log.append(("mapped", receiver.serve(replica)))
                receiver.close()
            elif msg[0] == "bitwise":
                sync(dev)
                conn.send(("bitwise", *bitwise_mismatches(replica.params, msg[1], msg[2])))
                del msg
            elif msg[0] == "finish":
                conn.send(("bye",))
                break
        result_conn.send(("ok", replica.version, log))
    except Exception:
        import traceback

        result_conn.send(("crash", traceback.format_exc()))


def timed(fn, dev, repeats: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        out.append(time.perf_counter() - t0)
    return out


def summarize(reports, nbytes: int, d2d: float) -> dict:
    secs = [r.seconds for r in reports]
    best = reports[secs.index(min(secs))]
    med = statistics.median(secs)
    return {"median_s": med, "best_s": min(secs), "all_s": secs, "GBps_median": nbytes / med / 1e9,
            "pct_of_d2d_median": 100 * (nbytes / med) / d2d, "GBps_best": nbytes / min(secs) / 1e9,
            "sender_phases_best": best.details["sender_phases"],
            "receiver_phases_best": best.details["receiver_phases"], "level": best.details["level"],
            **{k: best.details[k] for k in ("storages", "blocks") if k in best.details}}


def trainer_main(conn, result_conn, args: dict) -> None:
    import torch.multiprocessing  # noqa: F401 - registers the CUDA tensor reductions on the pipe's pickler
    from rlcore.sync import ChecksumPlan, tensor_checksum
    from rlcore_ray.transport import CopyProgram, MappedSender, TransportError
    from rlcore_ray.transport.testing import PipeChannel

    res: dict = {}
    kind, dev, R = args["kind"], cuda_indexed(torch.device(args["device"])), args["repeats"]
    channel = PipeChannel(conn, "rollout")

    def bitwise(tag: str) -> None:
        storages, metas = {}, []
        for name, w in weights.items():  # each storage once, as a uint8 tensor over all of it
            st = w.untyped_storage()
            if st.data_ptr() not in storages:
                storages[st.data_ptr()] = torch.empty(0, dtype=torch.uint8, device=dev).set_(st)
            metas.append((name, st.data_ptr(), w.data_ptr() - st.data_ptr(), w.numel() * w.element_size()))
        sync(dev)
        conn.send(("bitwise", list(storages.items()), metas))
        _, bad, n = conn.recv()
        res[f"bitwise_{tag}"] = {"mismatched": bad, "compared": n}
        print(kind, tag, "bitwise mismatched", bad, "of", n, flush=True)

    try:
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        shapes = model_shapes(kind.removesuffix("_flat"), args["scale"])
        weights = allocate(shapes, dev, flat=kind.endswith("_flat"), seed=0)
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        res.update(kind=kind, tensors=len(weights), bytes=nbytes,
                   expert_tensors=sum(".experts." in n for n in weights))
        src = torch.empty(nbytes, dtype=torch.uint8, device=dev).fill_(1)
        dst = torch.empty_like(src)
        t = timed(lambda: dst.copy_(src), dev, 10, warmup=3)
        d2d = nbytes / statistics.median(t)
        res["d2d_copy"] = {"median_s": statistics.median(t), "GBps": d2d / 1e9}
        src = dst = None  # freed before the pushes
        twins = allocate(shapes, dev, flat=kind.endswith("_flat"), seed=None)
        for name, big, fused in MAPPED:
            fused = fused if dev.type == "cuda" else "auto"  # no Triton copy on a CPU
            program = CopyProgram([(twins[n], w) for n, w in weights.items()], big_bytes=big, fused=fused)
            t = timed(program.run, dev, 5)
            res[f"in_process_copy_program_{name}"] = {"median_s": statistics.median(t),
                                                      "GBps": nbytes / statistics.median(t) / 1e9, **program.stats()}
        del twins, program
        # the batched checksum equals tensor_checksum on every tensor
        plan = ChecksumPlan(list(weights.values()))
        batched = plan.compute()
        t0 = time.perf_counter()
        single = [tensor_checksum(w) for w in weights.values()]
        per_tensor_s = time.perf_counter() - t0
        t = timed(plan.compute, dev, 5, warmup=1)
        res["checksum"] = {"backend": plan.backend, "equal_to_tensor_checksum": batched == single,
                           "batched_median_s": statistics.median(t), "per_tensor_s": per_tensor_s}
        print(kind, "checksum", res["checksum"], flush=True)

        version = 0
        res["mapped"] = {}
        for name, big, fused in MAPPED:
            conn.send(("phase", "mapped", big, fused if dev.type == "cuda" else "auto"))
            sender = MappedSender(channel, verify=False, timeout=300)
            version += 1
            first = sender.send(weights, version)
            reports = []
            for _ in range(R):
                version += 1
                reports.append(sender.send(weights, version))
            res["mapped"][name] = {"first_push_s": first.seconds, "first_sender_phases": first.details["sender_phases"],
                                   "first_receiver_phases": first.details["receiver_phases"],
                                   **summarize(reports, nbytes, d2d)}
            print(kind, "mapped", name, json.dumps(res["mapped"][name])[:600], flush=True)
            if name != "default":
                conn.send(("close",))
                sender.close()
        # still on the default receiver: verified pushes, each of new weights (an optimizer step)
        sender.verify = True
        reports = []
        for _ in range(R):
            sender.check_writable()
            for w in weights.values():
                w.mul_(-1)
            version += 1
            reports.append(sender.send(weights, version))
        res["mapped_verified"] = summarize(reports, nbytes, d2d)
        res["mapped_verified"]["checked"] = reports[-1].checked
        # a trainer that writes one byte after its checksum, before the receiver reads
        victim = next(n for n in weights if ".experts." in n or "mlp.down_proj" in n)

        def reckless(tensors):
            raw = weights[victim].view(-1).view(torch.uint8)
            raw[min(12345, raw.numel() - 1)] ^= 0x40

        sender._before_publish = reckless
        version += 1
        try:
            sender.send(weights, version)
            res["corrupted_push"] = {"caught": False}
        except TransportError as exc:
            res["corrupted_push"] = {"caught": "other bytes" in str(exc), "victim": victim, "error": str(exc)[:400],
                                     "sender_state_after": sender.state}
        sender._before_publish = lambda tensors: None
        sender.check_writable()
        version += 1
        rep = sender.send(weights, version)
        res["final_version"], res["final_level"] = version, rep.details["level"]
        conn.send(("close",))
        sender.close()
        bitwise("after_mapped")
        res["trainer_checksums_equal_plan"] = ChecksumPlan(list(weights.values())).compute() == [
            tensor_checksum(w) for w in weights.values()]
        conn.send(("finish",))
        conn.recv()  # the replica let go of every mapping before the trainer's storages go
        result_conn.send(("ok", res))
    except Exception:
        import traceback

        result_conn.send(("crash", traceback.format_exc(), res))
        try:
            conn.send(("finish",))
        except Exception:  # noqa: BLE001
            pass


def run_model(kind: str, args) -> dict:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    tr_parent, tr_child = ctx.Pipe()
    ro_parent, ro_child = ctx.Pipe()
    scale = 1.0 if args.device.startswith("cuda") else 0.05
    t0 = time.time()
    ro = ctx.Process(target=rollout_main, args=(b, ro_child, kind, scale, args.device))
    tr = ctx.Process(target=trainer_main, args=(a, tr_child, {"device": args.device, "kind": kind, "scale": scale,
                                                             "repeats": args.repeats}))
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
    else:
        out["rollout_version"] = rres[1]
        out["rollout_log"] = rres[2]
    out["wall_s"] = time.time() - t0
    return out


def table(results: dict, kinds: list[str]) -> str:
    rows = ["| model | path | median ms | GB/s | % of D2D | sender phases (best push, ms) | receiver phases |",
            "|---|---|---|---|---|---|---|"]

    def ms(ph):
        return " ".join(f"{k} {v * 1e3:.2f}" for k, v in ph.items())

    for k in kinds:
        r = results.get(k, {})
        if "d2d_copy" not in r:
            rows.append(f"| {k} | FAILED | | | | | |")
            continue
        rows.append(f"| {k} | D2D copy | {r['d2d_copy']['median_s'] * 1e3:.2f} | {r['d2d_copy']['GBps']:.0f} | 100 | | |")
        paths = [(f"mapped {n}", v) for n, v in r.get("mapped", {}).items()]
        paths.append(("mapped verified", r.get("mapped_verified")))
        for name, v in paths:
            if v:
                rows.append(f"| {k} | {name} | {v['median_s'] * 1e3:.2f} | {v['GBps_median']:.0f} | "
                            f"{v['pct_of_d2d_median']:.0f} | {ms(v['sender_phases_best'])} | "
                            f"{ms(v['receiver_phases_best'])} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", default="dense,moe,moe_flat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=200)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = {"command": " ".join([sys.executable, *sys.argv]), "torch": torch.__version__,
               "machine": platform.node(), "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
               "device_name": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else platform.processor()}
    kinds = args.models.split(",")
    for kind in kinds:
        results[kind] = run_model(kind, args)
        short = {k: v for k, v in results[kind].items() if k not in ("rollout_log",)}
        print(kind, json.dumps(short, default=str)[:2500], flush=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    print(table(results, kinds), flush=True)


if __name__ == "__main__":
    main()
