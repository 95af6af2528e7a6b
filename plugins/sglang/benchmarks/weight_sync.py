"""Weight-sync throughput: rlcore's flattened buckets (64 MiB .. 2 GiB) against one payload per
tensor, through SGLang's own deserializer in a separate receiving process, on CPU (shared memory)
or on a GPU (CUDA-IPC, ``--device cuda``).

Each configuration moves the same synthetic MoE checkpoint (a Qwen3-MoE-like layout, scaled down:
many ~1 MiB expert matrices, two large embedding matrices, fp32 norms) from this process into
preallocated "engine" tensors of a receiver process:

* sender: ``rlcore.sync.iter_buckets`` copies the stream into named shared-memory buckets
  (``build``), ``rlcore_sglang.wire`` pickles each bucket as SGLang's flattened-bucket payload
  (``serialize``);
* receiver: SGLang's ``MultiprocessingSerializer.deserialize`` (its SafeUnpickler, mapping the
  shared memory or opening the CUDA-IPC handle) and ``FlattenedTensorBucket.reconstruct_tensors``
  (``deserialize``), then a copy into the receiver's weights (``load``, what a model's
  ``load_weights`` does at least).

The baseline, ``per-tensor``, is the pre-bucket path (SGLang ``load_format=None``): every tensor
is its own payload ``[(name, tensor)]`` — on CPU in its own shared-memory segment (the same copy
into shared memory), on a GPU its own CUDA-IPC handle (no copy) — with the same pickler and
SGLang's same deserializer. Requests are sequential, as in the sync (one HTTP request per payload;
HTTP itself is not in the loop).

Run in the sglang venv (scripts/suites/sglang.sh builds it)::

    .venvs/sglang/bin/python plugins/sglang/benchmarks/weight_sync.py [--layers 12] [--repeats 2]

or on a GPU machine without SGLang, with SGLang 0.5.23's source files at DIR::

    PYTHONPATH=core/src:plugins/sglang/src python plugins/sglang/benchmarks/weight_sync.py \
        --device cuda --sglang-src DIR

It prints a Markdown table; nothing is asserted about time.
"""

from __future__ import annotations

import argparse
import io
import multiprocessing as mp
import os
import platform
import sys
import time
from pathlib import Path

import torch

MiB = 1 << 20
BUCKETS_MB = (64, 128, 256, 512, 1024, 2048)


def model_spec(layers: int, experts: int, hidden: int, moe_inter: int, vocab: int) -> list[tuple[str, tuple, torch.dtype]]:
    """A Qwen3-MoE-like HF checkpoint layout: (name, shape, dtype) in export order."""
    bf16, fp32 = torch.bfloat16, torch.float32
    spec = [("model.embed_tokens.weight", (vocab, hidden), bf16)]
    for i in range(layers):
        p = f"model.layers.{i}."
        spec += [(p + "input_layernorm.weight", (hidden,), fp32), (p + "post_attention_layernorm.weight", (hidden,), fp32)]
        for proj, rows in (("q_proj", hidden), ("k_proj", hidden // 8), ("v_proj", hidden // 8), ("o_proj", hidden)):
            spec.append((p + f"self_attn.{proj}.weight", (rows, hidden), bf16))
        spec.append((p + "mlp.gate.weight", (experts, hidden), bf16))
        for e in range(experts):
            for w, shape in (("gate_proj", (moe_inter, hidden)), ("up_proj", (moe_inter, hidden)),
                             ("down_proj", (hidden, moe_inter))):
                spec.append((p + f"mlp.experts.{e}.{w}.weight", shape, bf16))
    spec += [("model.norm.weight", (hidden,), fp32), ("lm_head.weight", (vocab, hidden), bf16)]
    return spec


def make_tensors(spec, device: str) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(0)
    return [(n, torch.randn(shape, generator=g, dtype=torch.float32, device=device).to(dtype)) for n, shape, dtype in spec]


# -------------------------------------------------------------------------- receiver -----


def _sglang_receiving_code(sglang_src: str | None):
    """SGLang's deserializer and bucket class: from the installed package, or (on a GPU machine
    without SGLang) from its 0.5.23 source files, as tests/gpu/cuda_paths_check.py loads them."""
    here = Path(__file__).resolve().parents[1] / "tests"
    sys.path.insert(0, str(here))
    if sglang_src:
        sys.path.insert(0, str(here / "gpu"))
        from cuda_paths_check import load_sglang_receiver

        sg = load_sglang_receiver(Path(sglang_src))
        return (lambda data: sg["SafeUnpickler"](io.BytesIO(data)).load(), sg["FlattenedTensorBucket"],
                sg["monkey_patch_torch_reductions"])
    from sglang_env import import_sglang_on_cpu

    import_sglang_on_cpu()
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    return MultiprocessingSerializer.deserialize, FlattenedTensorBucket, monkey_patch_torch_reductions


def receiver(conn, spec, device: str, sglang_src: str | None) -> None:
    deserialize, FlattenedTensorBucket, patch = _sglang_receiving_code(sglang_src)
    patch()  # what every SGLang rank runs before deserializing (GPU UUIDs in CUDA-IPC handles)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    params = {n: torch.empty(shape, dtype=dtype, device=device) for n, shape, dtype in spec}
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            return
        kind, payload = msg
        t0 = time.perf_counter()
        data = deserialize(payload)
        if kind == "bucket":
            named = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"],
                                          metadata=data["metadata"]).reconstruct_tensors()
        else:
            named = data
        sync()
        t1 = time.perf_counter()
        for name, t in named:
            params[name].copy_(t)
        sync()
        t2 = time.perf_counter()
        del data, named
        conn.send((t1 - t0, t2 - t1))


# ---------------------------------------------------------------------------- sender -----


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_bucketed(conn, tensors, bucket_bytes: int, device: str) -> dict:
    from rlcore.sync import iter_buckets
    from rlcore_sglang import wire

    build = ser = deser = load = 0.0
    payloads = 0
    wall0 = time.perf_counter()
    t = time.perf_counter()
    for bucket in iter_buckets(iter(tensors), bucket_bytes, allocator=wire.shared_memory_allocator):
        _sync(device)
        t1 = time.perf_counter()
        build += t1 - t
        payload = wire.serialize(wire.flattened_bucket_payload(bucket))
        t2 = time.perf_counter()
        ser += t2 - t1
        conn.send(("bucket", payload))
        d, lo = conn.recv()
        deser += d
        load += lo
        payloads += 1
        del bucket, payload
        t = time.perf_counter()
    if device == "cuda":
        torch.cuda.ipc_collect()
    return {"wall": time.perf_counter() - wall0, "build": build, "serialize": ser, "deserialize": deser,
            "load": load, "payloads": payloads}


def run_per_tensor(conn, tensors, device: str) -> dict:
    """One payload per tensor. CPU: each tensor is copied into its own shared-memory segment (what
    pickling a CPU tensor for another process costs); GPU: the tensor travels as its own CUDA-IPC
    handle, no copy (the pre-bucket colocated path)."""
    from rlcore_sglang import wire

    build = ser = deser = load = 0.0
    wall0 = time.perf_counter()
    for name, tensor in tensors:
        t0 = time.perf_counter()
        if device == "cpu":
            shm = wire.shared_memory_allocator(tensor.numel() * tensor.element_size(), tensor.device)
            shared = shm.view(tensor.dtype).view(tensor.shape)
            shared.copy_(tensor)
        else:
            shared = tensor
        t1 = time.perf_counter()
        payload = wire.serialize([(name, shared)])
        t2 = time.perf_counter()
        conn.send(("tensor", payload))
        d, lo = conn.recv()
        build += t1 - t0
        ser += t2 - t1
        deser += d
        load += lo
        del shared, payload
    if device == "cuda":
        torch.cuda.ipc_collect()
    return {"wall": time.perf_counter() - wall0, "build": build, "serialize": ser, "deserialize": deser,
            "load": load, "payloads": len(tensors)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--moe-intermediate", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--repeats", type=int, default=2, help="runs per configuration; the best is reported")
    ap.add_argument("--buckets-mb", type=int, nargs="*", default=list(BUCKETS_MB))
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: buckets are CUDA-IPC handles; sender and receiver share GPU 0 (colocated)")
    ap.add_argument("--sglang-src", default=None,
                    help="a directory holding sglang/srt/... from the 0.5.23 wheel, for machines without SGLang")
    args = ap.parse_args()

    torch.set_num_threads(os.cpu_count() or 1)
    spec = model_spec(args.layers, args.experts, args.hidden, args.moe_intermediate, args.vocab)
    tensors = make_tensors(spec, args.device)
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(there, spec, args.device, args.sglang_src), daemon=True)
    proc.start()
    assert here.recv() == "ready"

    configs = [(f"bucket {mb} MiB", lambda mb=mb: run_bucketed(here, tensors, mb * MiB, args.device))
               for mb in args.buckets_mb]
    configs.append(("per-tensor", lambda: run_per_tensor(here, tensors, args.device)))
    results = []
    for label, fn in configs:
        best = min((fn() for _ in range(args.repeats)), key=lambda r: r["wall"])
        results.append((label, best))
        print(f"  {label}: {best['wall']:.2f} s", file=sys.stderr, flush=True)
    here.send(None)
    proc.join(30)

    base = dict(results)["per-tensor"]["wall"]
    gpu = f", {torch.cuda.get_device_name(0)}" if args.device == "cuda" else ""
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores{gpu}, device {args.device}, "
          f"torch {torch.__version__}, python {platform.python_version()}")
    print(f"model: {len(tensors)} tensors, {total / 2**30:.2f} GiB ({args.layers} layers x {args.experts} experts, "
          f"hidden {args.hidden}, moe_intermediate {args.moe_intermediate}, vocab {args.vocab}); best of {args.repeats}\n")
    print("| transfer | payloads | build s | serialize s | deserialize s | load s | wall s | GB/s | speed-up vs per-tensor |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, r in results:
        print(f"| {label} | {r['payloads']} | {r['build']:.2f} | {r['serialize']:.3f} | {r['deserialize']:.3f} | "
              f"{r['load']:.2f} | {r['wall']:.2f} | {total / r['wall'] / 1e9:.2f} | {base / r['wall']:.2f}x |")


if __name__ == "__main__":
    main()
