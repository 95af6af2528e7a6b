"""Weight-sync benchmark: bucketed push vs one call per tensor vs a plain memcpy of the same bytes.

Creates a Qwen2 of a few hundred MB locally (no hub), starts a real vLLM engine on it (vLLM's
default multi-process engine: the worker is another process), and times whole-model pushes with
the ``vllm`` sync's shared-memory transport over several bucket sizes, with and without
checksum verification; "per tensor" is the same path with one tensor per call (bucket_bytes=1).
The memcpy baseline copies the model's bytes once between two pre-touched buffers in this
process. It measures and prints; it asserts nothing about time.

``--arch qwen3_moe`` makes a Qwen3-MoE instead (``--experts`` experts per layer, each with its own
gate/up/down tensors in checkpoint names: 3 x experts x layers expert tensors), the seed's case of
thousands of small per-expert tensors. Every row also prints where the time went (trainer side:
bucket fill, checksums, RPC round trips; worker side: decode/check/map, checksums, vLLM's
loaders; begin/finish of the layerwise reload).

Usage (in the vllm venv):
  .venvs/vllm/bin/python plugins/vllm/bench/bench_weight_sync.py [--hidden 1024 --layers 6 --repeats 3]
  .venvs/vllm/bin/python plugins/vllm/bench/bench_weight_sync.py --arch qwen3_moe --hidden 128 --layers 8 \
      --experts 64 --moe-intermediate 64 --vocab 1024 --buckets-mb 1,4,16,64 --verify-buckets-mb 16
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time


def make_model(path: str, hidden: int, layers: int, vocab: int, arch: str = "qwen2", experts: int = 0,
               moe_intermediate: int = 0) -> int:
    import torch
    from rlcore.engines.tiny import init_tiny_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_key_value_heads=2, head_dim=64,
                  max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=1, pad_token_id=0,
                  bos_token_id=None)
    if arch == "qwen3_moe":
        cfg = AutoConfig.for_model("qwen3_moe", intermediate_size=int(hidden * 2.75), num_attention_heads=max(2, hidden // 64),
                                   moe_intermediate_size=moe_intermediate, num_experts=experts, num_experts_per_tok=2,
                                   decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, **common)
    else:
        cfg = AutoConfig.for_model("qwen2", intermediate_size=int(hidden * 2.75), num_attention_heads=hidden // 64,
                                   **common)
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
    ap.add_argument("--arch", default="qwen2", choices=["qwen2", "qwen3_moe"])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--moe-intermediate", type=int, default=64)
    ap.add_argument("--buckets-mb", default="1,4,16,64,256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--verify-buckets-mb", default="64",
                    help="bucket sizes also timed with checksum verification (slow on CPU: see the doc)")
    ap.add_argument("--multiprocessing", type=int, default=1)
    args = ap.parse_args()

    import torch
    from rlcore.testing.models import HFEngine
    from rlcore_vllm.backend import VLLMBackend
    from rlcore_vllm.settings import VLLMSettings
    from rlcore_vllm.sync import VLLMWeightSync

    tmp = tempfile.mkdtemp(prefix="rlcore-bench-")
    model_dir = os.path.join(tmp, "model")
    nbytes = make_model(model_dir, args.hidden, args.layers, args.vocab, args.arch, args.experts,
                        args.moe_intermediate)
    weights = list(HFEngine.from_pretrained(model_dir).export_hf_weights())
    n_expert = sum(".experts." in n for n, _ in weights)
    print(f"model: {args.arch} hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}"
          f"{f', {args.experts} experts' if args.arch == 'qwen3_moe' else ''}: {len(weights)} tensors "
          f"({n_expert} expert tensors), {nbytes / 2**20:.0f} MiB fp32")
    backend = VLLMBackend(VLLMSettings(multiprocessing=bool(args.multiprocessing), max_model_len=256,
                                       kv_cache_gib=0.25), dtype="float32")
    backend.start(model_dir, version=0)
    version = 0
    rows = []
    phase_rows = []

    def run(label: str, bucket_bytes: int, verify: bool) -> None:
        nonlocal version
        sync = VLLMWeightSync(bucket_bytes, verify=verify, transport="shm")
        try:
            version += 1
            sync.push(weights, backend, version)  # warm-up: segments created, pages touched
            times, rpcs, reps = [], [], []
            for _ in range(1 if verify else args.repeats):
                version += 1
                rep = sync.push(weights, backend, version)
                times.append(rep.seconds)
                rpcs.append(rep.details["rpc_load_seconds"])
                reps.append(rep)
            rows.append((label, rep.num_buckets, verify, statistics.median(times), statistics.median(rpcs)))
            mid = reps[times.index(statistics.median(times))] if len(times) % 2 else reps[0]
            phase_rows.append((label, verify, mid.seconds, mid.details["loader_phases"], mid.details["worker_phases"]))
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
    print(f"command: python plugins/vllm/bench/bench_weight_sync.py --arch {args.arch} --hidden {args.hidden} "
          f"--layers {args.layers} --vocab {args.vocab} --experts {args.experts} --moe-intermediate "
          f"{args.moe_intermediate} --buckets-mb {args.buckets_mb} --verify-buckets-mb {args.verify_buckets_mb} "
          f"--repeats {args.repeats} --multiprocessing {args.multiprocessing}")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    print(f"bytes per push: {nbytes} ({nbytes / 2**20:.0f} MiB); memcpy of the same bytes: {mc:.3f} s "
          f"({nbytes / mc / 1e9:.2f} GB/s)")
    print()
    print("| bucket | buckets | verify | push s | GB/s | vs per-tensor | % of memcpy bandwidth | worker RPC+load s |")
    print("|---|---|---|---|---|---|---|---|")
    for label, nb, verify, t, rpc in rows:
        print(f"| {label} | {nb} | {'yes' if verify else 'no'} | {t:.3f} | {nbytes / t / 1e9:.2f} | "
              f"{per_tensor[verify] / t:.1f}x | {100 * mc / t:.0f} % | {rpc:.3f} |")

    print()
    print("Where the time went (one push per row, seconds; worker columns summed over its RPCs; "
          "transfer = rpc - worker):")
    print("| bucket | verify | push | begin | fill | checksum | rpc | worker check+map | worker verify | worker load "
          "| worker detach | transfer | finish |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, verify, total, ph, wk in phase_rows:
        inside = sum(wk.values())
        print(f"| {label} | {'yes' if verify else 'no'} | {total:.3f} | {ph['begin']:.3f} | {ph['fill']:.3f} | "
              f"{ph['checksum']:.3f} | {ph['rpc']:.3f} | {wk.get('check_map', 0):.3f} | {wk.get('verify', 0):.3f} | "
              f"{wk.get('load', 0):.3f} | {wk.get('detach', 0):.3f} | {ph['rpc'] - inside:.3f} | {ph['finish']:.3f} |")


if __name__ == "__main__":
    main()
