"""The seed's measurement on a real SGLang engine (issue 26 item 3): bucketed vs per-tensor weight
updates of a Qwen3-MoE-style model with >= 1,000 tensors, colocated on one GPU, against the
device-to-device copy of the same bytes, with every pushed version checked against the trainer's
forward (no partial or stale weights).

* The model: a Qwen3-MoE config created here (random weights, ``--layers`` x ``--experts`` experts:
  1,209 tensors, 1.26 GB in bf16 by default), written as an HF checkpoint that an SGLang server
  launched by rlcore-sglang's backend loads (``sglang.mode: server``).
* ``bucketed``: rlcore-sglang's ``sglang-tensor`` sync (flattened buckets of ``--bucket-mb``, one
  ``/update_weights_from_tensor`` request per bucket, CUDA IPC with the GPU's UUID);
* ``per-tensor``: the pre-bucket path the seed started from: one request per tensor with
  ``load_format=None`` (SGLang's ``model.load_weights([(name, tensor)])``), the same pickler and
  CUDA-IPC handles, ``flush_cache`` and the version on the last one only;
* ``d2d``: one on-device copy of as many bytes (CUDA events, median of 7): the floor.

Every version pushed is a fresh set of random weights. After each push SGLang generates greedily
from a few prompts, and the trainer's forward (transformers' Qwen3MoeForCausalLM loaded from the
same tensors) scores SGLang's tokens (teacher-forced, so one flip does not carry over): at a
generated position SGLang's token is the trainer's argmax, or within ``--tie-logit`` of it, and
SGLang's reported weight version must be the pushed one. bf16 MoE kernels differ from
transformers' in the last bits, and a near-tie in a router's scores then picks another expert, so
a few positions of a random MoE land beyond the tie even with the right weights: the version
passes when at most ``--max-flip-fraction`` of its positions do (SGLang serving the start
checkpoint it loaded from disk itself, no sync involved, is measured the same way as the noise
floor), and the same check against the previous version must fail at nearly every position
(>= 90%): stale or partial weights cannot pass. With ``--verify-once`` the first
bucketed push also runs the sync's self-test (SGLang's weights checker: snapshot, reset every
engine tensor to random, re-send the checkpoint through the transport, compare).

    PYTHONPATH=/tmp/site python plugins/sglang/benchmarks/engine_moe_sync.py --out result.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

MiB = 1 << 20


def moe_config(a: argparse.Namespace) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": a.vocab,
        "hidden_size": a.hidden, "intermediate_size": a.moe_inter * 2, "moe_intermediate_size": a.moe_inter,
        "num_hidden_layers": a.layers, "num_attention_heads": a.hidden // 128, "num_key_value_heads": 2,
        "head_dim": 128, "num_experts": a.experts, "num_experts_per_tok": a.topk, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 2048, "tie_word_embeddings": False,
        "attention_bias": False, "attention_dropout": 0.0, "output_router_logits": False,
        "router_aux_loss_coef": 0.001, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
        "initializer_range": 0.02, "use_sliding_window": False, "sliding_window": None, "max_window_layers": a.layers,
    }


def moe_spec(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """The HF checkpoint layout of Qwen3-MoE (per-expert tensors, as SGLang's loader reads them)."""
    h, hd, nh, kv = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    spec = [("model.embed_tokens.weight", (c["vocab_size"], h))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        spec += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                 (p + "self_attn.q_proj.weight", (nh * hd, h)), (p + "self_attn.k_proj.weight", (kv * hd, h)),
                 (p + "self_attn.v_proj.weight", (kv * hd, h)), (p + "self_attn.o_proj.weight", (h, nh * hd)),
                 (p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,)),
                 (p + "mlp.gate.weight", (c["num_experts"], h))]
        for e in range(c["num_experts"]):
            m = c["moe_intermediate_size"]
            spec += [(p + f"mlp.experts.{e}.gate_proj.weight", (m, h)), (p + f"mlp.experts.{e}.up_proj.weight", (m, h)),
                     (p + f"mlp.experts.{e}.down_proj.weight", (h, m))]
    return spec + [("model.norm.weight", (h,)), ("lm_head.weight", (c["vocab_size"], h))]


def random_weights(spec, seed: int, std: float) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = {}
    for name, shape in spec:
        if name.endswith("norm.weight"):  # norms near 1, as trained models have them
            t = 1.0 + 0.1 * torch.randn(shape, generator=g, device="cuda")
        else:
            t = std * torch.randn(shape, generator=g, device="cuda")
        out[name] = t.to(torch.bfloat16)
    return out


def save_checkpoint(d: Path, config: dict, weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config, indent=1))
    save_file({n: t.cpu() for n, t in weights.items()}, str(d / "model.safetensors"), metadata={"format": "pt"})


def trainer_model(d: Path):
    """The trainer's forward: transformers' Qwen3-MoE loaded from the checkpoint of a version."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.bfloat16, device_map="cuda").eval()


@torch.no_grad()
def greedy_check(model, prompts: list[list[int]], outputs: list[list[int]], tie_logit: float) -> dict:
    """Score SGLang's greedy tokens under the trainer's forward: each must be the argmax, or
    within ``tie_logit`` of it."""
    positions = mismatched = exact = 0
    worst = 0.0
    for p, o in zip(prompts, outputs, strict=True):
        ids = torch.tensor([p + o], device="cuda")
        logits = model(input_ids=ids).logits[0, len(p) - 1: len(p) - 1 + len(o)].float()
        chosen = logits.gather(1, torch.tensor(o, device="cuda")[:, None])[:, 0]
        gap = logits.max(dim=1).values - chosen
        positions += len(o)
        mismatched += int((gap > tie_logit).sum())
        worst = max(worst, float(gap.max()))
        exact += int(bool((gap == 0).all()))
    return {"positions": positions, "beyond_tie": mismatched, "max_logit_gap": worst,
            "sequences_all_argmax": exact, "sequences": len(prompts)}


def d2d_seconds(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return statistics.median(times)


def push_per_tensor(backend, weights: dict[str, torch.Tensor], version: int, selector: str) -> float:
    """One /update_weights_from_tensor request per tensor, load_format None: the seed's baseline."""
    from rlcore_sglang import protocol, wire

    f = backend.features
    names = list(weights)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for k, name in enumerate(names):
        last = k == len(names) - 1
        body = {"serialized_named_tensors": wire.serialize_per_rank([(name, weights[name])], f.tp_size),
                "load_format": None, "flush_cache": last, "abort_all_requests": False}
        if last:
            body["weight_version"] = str(version)
        body.update(protocol.selector_fields(selector, f))
        answer = backend.transport.call("/update_weights_from_tensor", body)
        if not protocol.is_success(answer):
            raise RuntimeError(f"per-tensor update of {name} failed: {answer}")
    seconds = time.perf_counter() - t0
    torch.cuda.ipc_collect()
    backend.set_weight_version(version)
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--moe-inter", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--std", type=float, default=0.05)
    ap.add_argument("--bucket-mb", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--repeats", type=int, default=2, help="pushes per method (each a fresh version)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--tie-logit", type=float, default=0.25)
    ap.add_argument("--max-flip-fraction", type=float, default=0.1)
    ap.add_argument("--verify-once", action="store_true")
    ap.add_argument("--launch-args", default="--attention-backend triton --mem-fraction-static 0.3 --disable-cuda-graph "
                    "--skip-tokenizer-init --skip-server-warmup --log-level warning")
    ap.add_argument("--port", type=int, default=30123)
    ap.add_argument("--work", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    from rlcore.types import Prompt, SamplingSettings
    from rlcore_sglang.backend import SGLangBackend
    from rlcore_sglang.settings import SGLangSettings
    from rlcore_sglang.sync import SGLangTensorSync

    work = Path(a.work or tempfile.mkdtemp(prefix="rlcore-sglang-moe-"))
    config = moe_config(a)
    spec = moe_spec(config)
    nbytes = sum(2 * int(torch.Size(s).numel()) for _, s in spec)
    result: dict = {"model": {"tensors": len(spec), "bytes": nbytes, **{k: config[k] for k in (
        "num_hidden_layers", "num_experts", "num_experts_per_tok", "hidden_size", "moe_intermediate_size", "vocab_size")}},
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    print(f"[moe] {len(spec)} tensors, {nbytes / 1e9:.2f} GB (bf16)", flush=True)
    versions = {0: random_weights(spec, 0, a.std)}
    save_checkpoint(work / "v0", config, versions[0])

    settings = SGLangSettings(mode="server", port=a.port, launch_args=a.launch_args.split(), enable_memory_saver=False,
                              startup_timeout_s=600)
    backend = SGLangBackend(settings, output_dir=str(work))
    t0 = time.perf_counter()
    backend.start(str(work / "v0"), version=0)
    result["engine_start_seconds"] = time.perf_counter() - t0
    import importlib.metadata as md
    result["sglang"] = md.version("sglang")
    print(f"[moe] SGLang {result['sglang']} up in {result['engine_start_seconds']:.1f} s", flush=True)

    g = torch.Generator().manual_seed(1)
    prompts = [Prompt(ids=torch.randint(3, a.vocab, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist(),
                      index=i) for i in range(a.prompts)]
    greedy = SamplingSettings(n=1, temperature=0.0, max_new_tokens=a.new_tokens, top_p=1.0, top_k=0)
    checks = []

    def check(version: int, method: str) -> None:
        samples = backend.generate(prompts, greedy)
        got = {s.weight_version for s in samples}
        outs = [s.response_ids.tolist() for s in samples]
        d = work / f"v{version}"
        if not d.exists():
            save_checkpoint(d, config, versions[version])
        model = trainer_model(d)
        now = greedy_check(model, [p.ids for p in prompts], outs, a.tie_logit)
        del model
        prev = None
        if version - 1 in versions:
            pd = work / f"v{version - 1}"
            if not pd.exists():
                save_checkpoint(pd, config, versions[version - 1])
            model = trainer_model(pd)
            prev = greedy_check(model, [p.ids for p in prompts], outs, a.tie_logit)
            del model
        torch.cuda.empty_cache()
        ok = (now["beyond_tie"] <= a.max_flip_fraction * now["positions"] and got == {version}
              and (prev is None or prev["beyond_tie"] >= 0.9 * prev["positions"]))
        checks.append({"version": version, "method": method, "engine_versions": sorted(got), "against_pushed": now,
                       "against_previous": prev, "ok": ok})
        print(f"[moe] v{version} ({method}): engine reports {sorted(got)}; vs pushed {now}; vs previous {prev}: "
              f"{'OK' if ok else 'FAILED'}", flush=True)

    check(0, "start checkpoint")
    runs = []
    version = 0
    if a.verify_once:
        version += 1
        versions[version] = random_weights(spec, version, a.std)
        sync = SGLangTensorSync(settings, a.bucket_mb[0] * MiB, verify=True, output_dir=str(work))
        rep = sync.push(iter(versions[version].items()), backend, version)
        runs.append({"method": "bucketed+verify", "bucket_mb": a.bucket_mb[0], "seconds": rep.seconds,
                     "buckets": rep.num_buckets, "tensors": rep.num_tensors, "bytes": rep.bytes,
                     "selftest": rep.details.get("selftest"), "level": rep.details.get("level")})
        print(f"[moe] verified push v{version}: {runs[-1]}", flush=True)
        check(version, "bucketed+verify")
        versions.pop(version - 1, None)
    for _ in range(a.repeats):
        for mb in a.bucket_mb:
            version += 1
            versions[version] = random_weights(spec, version, a.std)
            sync = SGLangTensorSync(settings, mb * MiB, verify=False, output_dir=str(work))
            torch.cuda.synchronize()
            rep = sync.push(iter(versions[version].items()), backend, version)
            runs.append({"method": "bucketed", "bucket_mb": mb, "seconds": rep.seconds, "buckets": rep.num_buckets,
                         "tensors": rep.num_tensors, "bytes": rep.bytes, "GB_per_s": rep.bytes / rep.seconds / 1e9})
            print(f"[moe] bucketed {mb} MiB v{version}: {rep.seconds:.3f} s, {rep.num_buckets} buckets", flush=True)
            check(version, f"bucketed {mb} MiB")
            versions.pop(version - 1, None)
        version += 1
        versions[version] = random_weights(spec, version, a.std)
        s = push_per_tensor(backend, versions[version], version, "all")
        runs.append({"method": "per-tensor", "seconds": s, "requests": len(spec), "bytes": nbytes,
                     "GB_per_s": nbytes / s / 1e9})
        print(f"[moe] per-tensor v{version}: {s:.3f} s, {len(spec)} requests", flush=True)
        check(version, "per-tensor")
        versions.pop(version - 1, None)
    backend.shutdown()

    d2d = d2d_seconds(nbytes)
    result["d2d"] = {"seconds": d2d, "GB_per_s": nbytes / d2d / 1e9}
    result["runs"] = runs
    result["checks"] = checks
    best = {}
    for r in runs:
        if r["method"] in ("bucketed", "per-tensor"):
            key = r["method"] if r["method"] == "per-tensor" else f"bucketed {r['bucket_mb']} MiB"
            best[key] = min(best.get(key, float("inf")), r["seconds"])
    per = best.get("per-tensor")
    result["summary"] = {k: {"seconds": v, "GB_per_s": nbytes / v / 1e9,
                             "speedup_over_per_tensor": (per / v) if per else None,
                             "times_d2d": v / d2d} for k, v in best.items()}
    result["all_checks_ok"] = all(c["ok"] for c in checks)
    print("[moe] summary:", json.dumps(result["summary"]), "d2d", json.dumps(result["d2d"]),
          "all checks ok:", result["all_checks_ok"], flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0 if result["all_checks_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
