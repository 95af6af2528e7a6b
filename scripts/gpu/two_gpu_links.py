"""What the link between two GPUs of one host carries, measured the way a weight push uses it: a
device copy GPU0 -> GPU1 (one process, both GPUs visible), and, with one process per GPU over
NCCL, a broadcast from GPU 0 (what ``vllm.transport: broadcast`` sends per bucket) at a bucket's
size and at a whole model's, and an all-gather (what a TP=2 export runs per tensor). Medians of
CUDA-event timings after warm-ups; each result is checked. Writes one JSON (scripts/gpu/two_gpu_ray.sh).

    python3 scripts/gpu/two_gpu_links.py OUT.json [--model-bytes N] [--bucket-mib M]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.multiprocessing as mp

MIB = 1 << 20


def _median_seconds(fn, reps: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def copy_gpu0_to_gpu1(nbytes: int) -> dict:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    dt = _median_seconds(lambda: dst.copy_(src, non_blocking=True))
    ok = bool(torch.equal(dst[:4096].cpu(), src[:4096].cpu()))
    return {"bytes": nbytes, "seconds": dt, "GB_per_s": nbytes / dt / 1e9, "correct": ok,
            "peer_access": torch.cuda.can_device_access_peer(0, 1)}


def _rank(rank: int, port: int, sizes: dict, queue) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    out = {}
    for name, nbytes in sizes.items():
        buf = torch.full((nbytes,), 3 if rank == 0 else 0, dtype=torch.uint8, device="cuda")
        dt = _median_seconds(lambda buf=buf: dist.broadcast(buf, src=0))
        out[f"broadcast_{name}"] = {"bytes": nbytes, "seconds": dt, "GB_per_s": nbytes / dt / 1e9,
                                    "correct": bool(buf[:4096].eq(3).all())}
    shard = torch.full((sizes["bucket"] // 2,), float(rank), dtype=torch.bfloat16, device="cuda")
    full = torch.empty(2 * shard.numel(), dtype=shard.dtype, device="cuda")
    dt = _median_seconds(lambda: dist.all_gather_into_tensor(full, shard))
    out["all_gather_bucket"] = {"shard_bytes": shard.numel() * 2, "seconds": dt,
                                "received_GB_per_s": shard.numel() * 2 / dt / 1e9,
                                "correct": bool(full[shard.numel():].eq(1).all() and full[:shard.numel()].eq(0).all())}
    dist.destroy_process_group()
    queue.put((rank, out))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--model-bytes", type=int, default=988_065_536, help="the 0.5 B model of gpu_two_disagg.yaml")
    p.add_argument("--bucket-mib", type=int, default=256)
    args = p.parse_args()
    res = {"gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
           "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    res["copy_gpu0_to_gpu1"] = copy_gpu0_to_gpu1(args.model_bytes)
    sizes = {"bucket": args.bucket_mib * MIB, "model": args.model_bytes}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29000 + os.getpid() % 1000
    procs = [ctx.Process(target=_rank, args=(r, port, sizes, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    got = dict(queue.get(timeout=180) for _ in procs)
    for proc in procs:
        proc.join(30)
    res["nccl_rank0"], res["nccl_rank1"] = got[0], got[1]
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
