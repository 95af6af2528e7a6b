"""Weight-sync benchmark: bucketed push vs one call per tensor vs a plain memcpy of the same bytes.

Creates a Qwen2 of a few hundred MB locally (no hub), starts a real vLLM engine on it (vLLM's
default multi-process engine: the worker is another process), and times whole-model pushes with
the ``vllm`` sync's shared-memory transport over several bucket sizes, with and without
checksum verification; "per tensor" is the same path with one tensor per call (bucket_bytes=1).
The memcpy baseline copies the model's bytes once between two pre-touched buffers in this
process. It measures and prints; it asserts nothing about time.

Usage (in the vllm venv):
  .venvs/vllm/bin/python plugins/vllm/bench/bench_weight_sync.py [--hidden 1024 --layers 6 --repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time


def make_model(path: str, hidden: int, layers: int, vocab: int) -> int:
    import torch
    from rlcore.engines.tiny import init_tiny_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen2", vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.75),
                               num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=2,
                               head_dim=64, max_position_embeddings=512, tie_word_embeddings=False,
                               eos_token_id=1, pad_token_id=0, bos_token_id=None)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    init_tiny_weights(model, 0.02, seed=0)
    model.save_pretrained(path)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def memcpy_seconds(nbytes: int, repeats: int) -> float:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--buckets-mb", default="1,4,16,64,256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--verify-buckets-mb", default="64",
                    help="bucket sizes also timed with checksum verification (slow on CPU: see the doc)")
    ap.add_argument("--multiprocessing", type=int, default=1)
    args = ap.parse_args()

    import torch
    from rlcore.engines.hf import HFEngine
    from rlcore_vllm.backend import VLLMBackend
    from rlcore_vllm.settings import VLLMSettings
    from rlcore_vllm.sync import VLLMWeightSync

    tmp = tempfile.mkdtemp(prefix="rlcore-bench-")
    model_dir = os.path.join(tmp, "model")
    nbytes = make_model(model_dir, args.hidden, args.layers, args.vocab)
    weights = list(HFEngine.from_pretrained(model_dir).export_hf_weights())
    print(f"model: qwen2 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: {len(weights)} tensors, "
          f"{nbytes / 2**20:.0f} MiB fp32")
    backend = VLLMBackend(VLLMSettings(multiprocessing=bool(args.multiprocessing), max_model_len=256,
                                       kv_cache_gib=0.25), dtype="float32")
    backend.start(model_dir, version=0)
    version = 0
    rows = []

    def run(label: str, bucket_bytes: int, verify: bool) -> None:
        nonlocal version
        sync = VLLMWeightSync(bucket_bytes, verify=verify, transport="shm")
        try:
            version += 1
            sync.push(weights, backend, version)  # warm-up: segments created, pages touched
            times, rpcs = [], []
            for _ in range(1 if verify else args.repeats):
                version += 1
                rep = sync.push(weights, backend, version)
                times.append(rep.seconds)
                rpcs.append(rep.details["rpc_load_seconds"])
            rows.append((label, rep.num_buckets, verify, statistics.median(times), statistics.median(rpcs)))
            print(f"  {label:>12}  buckets {rep.num_buckets:5d}  verify {verify!s:5}  {statistics.median(times):7.3f} s  "
                  f"{nbytes / statistics.median(times) / 1e9:6.2f} GB/s", flush=True)
        finally:
            sync.close()

    try:
        verified_sizes = {float(x) for x in args.verify_buckets_mb.split(",") if x}
        for mb in [float(x) for x in args.buckets_mb.split(",")]:
            run(f"{mb:g} MiB", int(mb * 2**20), False)
            if mb in verified_sizes:
                run(f"{mb:g} MiB", int(mb * 2**20), True)
        run("per tensor", 1, False)
        run("per tensor", 1, True)
    finally:
        backend.shutdown()
    mc = memcpy_seconds(nbytes, 5)
    per_tensor = {v: t for label, _, v, t, _ in rows if label == "per tensor"}
    print()
    print(f"command: python plugins/vllm/bench/bench_weight_sync.py --hidden {args.hidden} --layers {args.layers} "
          f"--vocab {args.vocab} --repeats {args.repeats} --multiprocessing {args.multiprocessing}")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    print(f"bytes per push: {nbytes} ({nbytes / 2**20:.0f} MiB); memcpy of the same bytes: {mc:.3f} s "
          f"({nbytes / mc / 1e9:.2f} GB/s)")
    print()
    print("| bucket | buckets | verify | push s | GB/s | vs per-tensor | % of memcpy bandwidth | worker RPC+load s |")
    print("|---|---|---|---|---|---|---|---|")
    for label, nb, verify, t, rpc in rows:
        print(f"| {label} | {nb} | {'yes' if verify else 'no'} | {t:.3f} | {nbytes / t / 1e9:.2f} | "
              f"{per_tensor[verify] / t:.1f}x | {100 * mc / t:.0f} % | {rpc:.3f} |")


if __name__ == "__main__":
    main()
