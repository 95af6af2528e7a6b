#!/usr/bin/env python3
"""Packed (no padding) vs padded attention on the hf and megatron engines (issue 31 item 4).

A Qwen2.5-0.5B-shaped model (random fp32 weights from a config, drawn once on the device; the
bf16 model is those weights rounded, so the fp32 reference is the same model) trains forward + backward over
``--seqs`` sequences whose lengths spread evenly over ``[--min-len, --max-len]`` (shuffled), split
into micro-batches of at most ``--mb-tokens`` real tokens (the same split for both paths, as
``training.micro_batch_tokens`` does), log-probs from core's reference head (chunked fp32 softmax).
For each engine and path: tokens/s (real tokens, forward + backward) and peak GPU memory.

Equality, on ``--check-seqs`` sequences of the same spread:

* fp32 (TF32 off): packed vs padded log-probs and gradients. The packed path runs SDPA per
  sequence there (torch's flash varlen kernel has no fp32); both sum the same terms in another
  order, so they agree to float32 rounding: max |d logprob| <= 1e-3, ||d grad|| / ||grad|| <= 1e-3.
* bf16: the packed path runs torch's ``varlen_attn`` (Flash Attention), padded rows run SDPA with
  a mask: bf16 rounding differs between kernels and grows over 24 layers, so the two are compared
  with the fp32 padded result as the reference: the packed path passes when its error against it
  is at most 1.5x the padded path's (+ 1e-3 absolute on the mean log-prob error).

Writes ``results.json`` and ``results.md`` under ``--out``. ``--size tiny --device cpu`` checks the
script in seconds (the megatron part needs megatron-core importable).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

SIZES = {
    # Qwen2.5-0.5B's shape
    "qwen0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                     intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                     rms_norm_eps=1e-6, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512, max_position_embeddings=4096, rope_theta=1e6,
                 rms_norm_eps=1e-6, tie_word_embeddings=True),
}
FP32_LOGPROB_TOL = 1e-3
FP32_GRAD_TOL = 1e-3
BF16_RATIO = 1.5
BF16_SLACK = 1e-3
PATHS = ("padded", "packed")
#: prefix of the record_function ranges that name a phase (scripts/gpu/profile_phases.py)
PHASE = "phase:"
PHASE_BACKWARD = "backward"


def spread_lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    lens = torch.linspace(lo, hi, n).round().long()
    return lens[torch.randperm(n, generator=torch.Generator().manual_seed(seed))].tolist()


def micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of consecutive sequences while their padded rows (count x longest) hold at most
    ``budget`` tokens: the padded path's memory bound (megatron's local attention keeps ``B x L^2``
    scores per layer), and the same split for the packed path."""
    out, cur, longest = [], [], 0
    for i, n in enumerate(lengths):
        if cur and (len(cur) + 1) * max(longest, n) > budget:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        out.append(cur)
    return out


def hf_model(size: str, dtype: torch.dtype, device: str, layers: int | None = None):
    """The HF model of ``size`` (``layers`` decoder layers instead of the size's, if given),
    random weights initialised on ``device`` (the GPU draws 0.5B normals in well under a second;
    the CPU took 12 s on two cores)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    shape = dict(SIZES[size], **({"num_hidden_layers": layers} if layers else {}))
    cfg = Qwen2Config(**shape, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def run_pass(forward, head, seqs: list[torch.Tensor], groups: list[list[int]], params: list[torch.Tensor]):
    """Forward + backward over every micro-batch (loss: mean token log-prob); per-sequence log-probs back."""
    from rlcore.batch import PackedBatch
    from rlcore.heads import reference_logprobs
    from rlcore.types import HeadInput
    from torch.profiler import record_function

    total = sum(s.numel() - 1 for s in seqs)
    out: list[torch.Tensor | None] = [None] * len(seqs)
    for group in groups:
        # the phase ranges scripts/gpu/profile_phases.py groups the profile by (free when not profiling)
        with record_function(PHASE + "pack"):
            batch = PackedBatch.pack([seqs[i] for i in group], [1] * len(group))
        with record_function(PHASE + "engine forward"):
            hidden = forward(batch)
        with record_function(PHASE + "head (reference, fp32)"):
            weight, vocab = head()
            dev = hidden.device
            lp = reference_logprobs(HeadInput(hidden=hidden, weight=weight, labels=batch.labels().to(dev),
                                              vocab=vocab, loss_mask=batch.loss_mask.to(dev))).logprobs
            loss = -lp.sum() / total
        with record_function(PHASE + PHASE_BACKWARD):
            loss.backward()
        starts = batch.layout.starts.tolist()
        for i, start in zip(group, starts, strict=True):
            out[i] = lp[start:start + seqs[i].numel() - 1].detach().float().cpu()
    return out, [p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
                 for p in params]


def timed(forward, head, seqs, groups, params, iters: int, device: str) -> dict:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for p in params:
        p.grad = None
    run_pass(forward, head, seqs, groups, params)  # warm-up (kernels, allocator)
    for p in params:
        p.grad = None
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        for p in params:
            p.grad = None
        run_pass(forward, head, seqs, groups, params)
    sync()
    dt = (time.perf_counter() - t0) / iters
    tokens = sum(s.numel() for s in seqs)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None
    for p in params:
        p.grad = None
    return {"seconds": dt, "tokens_per_s": tokens / dt, "peak_gib": peak}


def compare(a_lp, a_g, b_lp, b_g) -> dict:
    d = torch.cat([(x - y).abs() for x, y in zip(a_lp, b_lp, strict=True)])
    num = math.sqrt(sum(float(((x - y) ** 2).sum()) for x, y in zip(a_g, b_g, strict=True)))
    den = math.sqrt(sum(float((y ** 2).sum()) for y in b_g))
    return {"max_abs_logprob": float(d.max()), "mean_abs_logprob": float(d.mean()),
            "grad_rel": num / max(den, 1e-30)}


def kernel_check(lengths: list[int], device: str, heads: int, kv_heads: int, head_dim: int = 64) -> dict:
    """rlcore.engines.varlen.varlen_attention in bf16 (the backend it picks) against SDPA per
    sequence in fp32, forward and the query gradient, on ``lengths``."""
    from rlcore.engines import varlen

    g = torch.Generator(device=device).manual_seed(0)
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q32 = torch.randn(T, heads, head_dim, generator=g, device=device)
    k32 = torch.randn(T, kv_heads, head_dim, generator=g, device=device)
    v32 = torch.randn(T, kv_heads, head_dim, generator=g, device=device)
    grads = []
    outs = []
    for dtype, fn in ((torch.bfloat16, varlen.varlen_attention), (torch.float32, None)):
        q = q32.to(dtype).requires_grad_(True)
        k, v = k32.to(dtype), v32.to(dtype)
        out = fn(q, k, v, cu, max(lengths)) if fn else varlen._sdpa_per_sequence(q, k, v, cu, None)
        out.float().square().sum().backward()
        outs.append(out.detach().float())
        grads.append(q.grad.float())
    return {"backend_bf16": varlen.varlen_backend(device, torch.bfloat16),
            "max_abs_out_vs_fp32": float((outs[0] - outs[1]).abs().max()),
            "grad_rel_vs_fp32": float((grads[0] - grads[1]).norm() / grads[1].norm())}


# ------------------------------------------------------------------ engines -----------------


class SourceModels:
    """The HF model every engine and path starts from, kept on the CPU (so that no copy of it
    counts in a path's GPU memory): fp32 weights drawn once on the device, the other dtypes
    rounded from them, so the fp32 reference and the bf16 runs are the same model."""

    def __init__(self, size, device, layers=None):
        self.size, self.device, self.layers = size, device, layers
        self._cpu: dict = {}

    def __call__(self, dtype):
        import copy

        if torch.float32 not in self._cpu:
            self._cpu[torch.float32] = hf_model(self.size, torch.float32, self.device, self.layers).to("cpu")
        if dtype not in self._cpu:  # rounded on the device too (a loaded CPU took 16 s for it)
            self._cpu[dtype] = copy.deepcopy(self._cpu[torch.float32]).to(self.device, dtype).to("cpu")
        return self._cpu[dtype]


class HFFamily:
    """Engines of one path at a time (one model on the GPU at a time), all from the same weights."""

    name = "hf"

    def __init__(self, sources: SourceModels, device):
        self.cpu_model, self.device = sources, device

    def engine(self, dtype, path):
        import copy

        from rlcore.testing.models import HFEngine

        return HFEngine(copy.deepcopy(self.cpu_model(dtype)), None, self.device, path)

    @staticmethod
    def params(engine):
        return [p for p in engine.model.parameters() if p.requires_grad]


class MegatronFamily(HFFamily):
    name = "megatron"

    def engine(self, dtype, path):
        from rlcore_megatron.engine import HFSource, MegatronEngine
        from rlcore_megatron.settings import MegatronSettings

        source = HFSource.from_model(self.cpu_model(dtype), None)
        dt = str(dtype).removeprefix("torch.")
        # packed: megatron.attention=auto, THD on CUDA (Transformer Engine where installed, else
        # torch varlen); on CPU the THD path is only reachable by rebuilding the model (thd_on_cpu)
        settings = MegatronSettings(attention="local" if path == "padded" else "auto")
        engine = MegatronEngine(source, settings, device=self.device, dtype=dt)
        if path == "packed" and engine.attention_path != "thd":
            thd_on_cpu(engine)
        return engine

    @staticmethod
    def params(engine):
        return [p for _, p in engine.named_parameters() if p.requires_grad]


def thd_on_cpu(engine) -> None:
    """CPU check only: megatron.attention=auto is padded on CPU; rebuild the model on the THD path
    (local spec with the varlen core attention) with the same weights."""
    from rlcore_megatron.model import build_model

    built = build_model(engine.spec, engine.settings, engine.par, engine.padded_vocab, "thd", engine.device,
                        engine.dtype)
    built.model.load_state_dict(engine.model.state_dict())
    engine.model = built.model
    engine.chunks = [built.model]
    engine.attention_path = "thd"


def backend_of(family, engine, dtype, device) -> str:
    from rlcore.engines.varlen import varlen_backend

    if family.name == "megatron":
        core = type(engine.model.decoder.layers[0].self_attention.core_attention).__name__
        if engine.attention_path != "thd":
            return f"padded rows ({core})"
        if core.startswith("TE"):
            return f"transformer_engine ({core})"
        return f"{varlen_backend(device, dtype)} ({core})"
    if engine.attention_path != "packed":
        return "padded rows (transformers sdpa)"
    return varlen_backend(device, dtype)


def head_of(engine):
    def head():
        hw = engine.head()
        return hw.weight, hw.vocab
    return head


def fwd_of(engine):
    return lambda batch: engine.forward(batch).hidden


def bench_family(family, args, lens, check_lens, res: dict, save) -> None:
    """Fills ``res`` (and calls ``save()`` after each stage, so that a run cut short by its time
    limit still leaves what it measured); prints each stage's elapsed seconds."""
    device = args.device
    t0 = time.perf_counter()

    def stage(what: str) -> None:
        res.setdefault("stage_s", {})[what] = round(time.perf_counter() - t0, 2)
        print(f"[{family.name}] {time.perf_counter() - t0:7.1f} s  {what}", flush=True)
        save()
    g = torch.Generator().manual_seed(1)
    vocab = SIZES[args.size]["vocab_size"]
    seqs = [torch.randint(0, vocab, (n,), generator=g) for n in lens]
    check = [torch.randint(0, vocab, (n,), generator=g) for n in check_lens]
    groups = micro_batches(lens, args.mb_tokens)
    check_groups = micro_batches(check_lens, args.check_mb_tokens)
    res.update(micro_batches=len(groups), padded_tokens=sum(len(gr) * max(lens[i] for i in gr) for gr in groups))
    equality: dict = {}

    def free():
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()

    # fp32 reference and fp32 equality (TF32 off: the reference must be fp32 arithmetic)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    fp32 = {}
    for path in PATHS:
        eng = family.engine(torch.float32, path)
        stage(f"fp32 {path} built")
        fp32[path] = run_pass(fwd_of(eng), head_of(eng), check, check_groups, family.params(eng))
        stage(f"fp32 {path} equality pass")
        if path == "packed":
            equality["fp32_backend_packed"] = backend_of(family, eng, torch.float32, device)
        del eng
        free()
    equality["fp32_packed_vs_padded"] = compare(*fp32["packed"], *fp32["padded"])
    ref = fp32["padded"]
    del fp32
    # bf16, one engine at a time: equality against the fp32 reference, then speed and memory
    bf16: dict = {}
    res["paths"] = {}
    for path in PATHS:
        eng = family.engine(torch.bfloat16, path)
        stage(f"bf16 {path} built")
        bf16[path] = run_pass(fwd_of(eng), head_of(eng), check, check_groups, family.params(eng))
        stage(f"bf16 {path} equality pass")
        for p in family.params(eng):
            p.grad = None
        free()
        try:
            r = timed(fwd_of(eng), head_of(eng), seqs, groups, family.params(eng), args.iters, device)
        except torch.OutOfMemoryError as exc:  # reported, and the other path still runs
            r = {"seconds": None, "tokens_per_s": None, "peak_gib": None, "error": f"out of memory: {exc}"[:300]}
            for p in family.params(eng):
                p.grad = None
        r["attention_path"] = eng.attention_path
        r["backend"] = backend_of(family, eng, torch.bfloat16, device)
        res["paths"][path] = r
        print(f"[{family.name}] {path}: {r}", flush=True)
        stage(f"bf16 {path} timed (warm-up + {args.iters})")
        del eng
        free()
    equality["bf16_packed_vs_padded"] = compare(*bf16["packed"], *bf16["padded"])
    equality["bf16_padded_vs_fp32"] = compare(*bf16["padded"], *ref)
    equality["bf16_packed_vs_fp32"] = compare(*bf16["packed"], *ref)
    e32 = equality["fp32_packed_vs_padded"]
    pk, pd = equality["bf16_packed_vs_fp32"], equality["bf16_padded_vs_fp32"]
    equality["fp32_pass"] = e32["max_abs_logprob"] <= FP32_LOGPROB_TOL and e32["grad_rel"] <= FP32_GRAD_TOL
    equality["bf16_pass"] = (pk["mean_abs_logprob"] <= BF16_RATIO * pd["mean_abs_logprob"] + BF16_SLACK
                             and pk["grad_rel"] <= BF16_RATIO * pd["grad_rel"] + BF16_SLACK)
    res["equality"] = equality
    stage("done")


def markdown(results: dict) -> str:
    m = results["meta"]
    kc = results["kernel_check"]
    lines = [f"# Packed vs padded attention ({m['device_name']}, {m['date']})", "",
             f"Kernel check (varlen_attention in bf16, backend `{kc['backend_bf16']}`, vs SDPA per sequence in fp32): "
             f"max |d out| {kc['max_abs_out_vs_fp32']:.2e}, query-gradient rel {kc['grad_rel_vs_fp32']:.2e}.", "",
             f"Model: {m['size']}, {m['layers']} layers (random weights), bf16; {m['seqs']} sequences, lengths {m['min_len']}-{m['max_len']} "
             f"(evenly spread, {m['real_tokens']} real tokens), micro-batches of consecutive sequences with padded "
             f"rows (count x longest) <= {m['mb_tokens']} tokens, the same for both paths; "
             f"forward + backward, mean of {m['iters']} passes after a warm-up. torch {m['torch']}, "
             f"transformers {m['transformers']}, megatron-core {m['megatron_core']}.", "",
             "| engine | path | attention backend | tokens/s | s / pass | peak GiB | padded-row tokens |",
             "|---|---|---|---|---|---|---|"]
    for fam, r in results["engines"].items():
        if "error" in r:
            lines.append(f"| {fam} | error | {r['error']} | | | | |")
            continue
        for path, p in r["paths"].items():
            peak = f"{p['peak_gib']:.2f}" if p["peak_gib"] is not None else "-"
            rows = r["padded_tokens"] if path == "padded" else m["real_tokens"]
            if p["seconds"] is None:
                lines.append(f"| {fam} | {p['attention_path']} | {p['backend']} | out of memory | | | {rows} |")
                continue
            lines.append(f"| {fam} | {p['attention_path']} | {p['backend']} | {p['tokens_per_s']:.0f} | "
                         f"{p['seconds']:.3f} | {peak} | {rows} |")
    lines += ["", f"Equality on {m['check_seqs']} sequences (lengths {m['min_len']}-{m['max_len']}): "
              f"fp32 tolerance max |d logprob| <= {FP32_LOGPROB_TOL}, grad rel <= {FP32_GRAD_TOL}; bf16: packed's error "
              f"against the fp32 reference <= {BF16_RATIO} x padded's + {BF16_SLACK}.", "",
              "| engine | compared | backend | max abs d logprob | mean abs d logprob | grad rel | pass |",
              "|---|---|---|---|---|---|---|"]
    for fam, r in results["engines"].items():
        if "error" in r:
            continue
        e = r["equality"]
        for key, backend, ok in (("fp32_packed_vs_padded", e["fp32_backend_packed"], e["fp32_pass"]),
                                 ("bf16_packed_vs_padded", r["paths"]["packed"]["backend"], ""),
                                 ("bf16_padded_vs_fp32", "padded rows", ""),
                                 ("bf16_packed_vs_fp32", r["paths"]["packed"]["backend"], e["bf16_pass"])):
            c = e[key]
            lines.append(f"| {fam} | {key} | {backend} | {c['max_abs_logprob']:.2e} | {c['mean_abs_logprob']:.2e} | "
                         f"{c['grad_rel']:.2e} | {ok} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", choices=sorted(SIZES), default="qwen0.5b")
    ap.add_argument("--engines", default="hf,megatron")
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--check-seqs", type=int, default=8)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--mb-tokens", type=int, default=8192)
    ap.add_argument("--check-mb-tokens", type=int, default=4096, help="the equality check's (fp32) micro-batch bound")
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers instead of the size's (a shorter run; the head's share of the time grows)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import transformers

    try:
        from importlib.metadata import version

        mcore = version("megatron-core")
    except Exception:  # noqa: BLE001 - not installed: the megatron part reports its error
        mcore = None
    lens = spread_lengths(args.seqs, args.min_len, args.max_len, seed=0)
    check_lens = spread_lengths(args.check_seqs, args.min_len, args.max_len, seed=1)
    meta = {"size": args.size, "seqs": args.seqs, "check_seqs": args.check_seqs, "min_len": args.min_len,
            "max_len": args.max_len, "mb_tokens": args.mb_tokens, "iters": args.iters, "real_tokens": sum(lens),
            "layers": args.layers or SIZES[args.size]["num_hidden_layers"],
            "torch": torch.__version__, "transformers": transformers.__version__, "megatron_core": mcore,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
    results = {"meta": meta, "engines": {}}
    sz = SIZES[args.size]
    results["kernel_check"] = kernel_check(check_lens, args.device, sz["num_attention_heads"],
                                           sz["num_key_value_heads"])
    print("kernel check:", results["kernel_check"], flush=True)
    families = {"hf": HFFamily, "megatron": MegatronFamily}
    sources = SourceModels(args.size, args.device, args.layers)  # shared: drawn once for both engines

    def save():
        (out / "results.json").write_text(json.dumps(results, indent=2))

    rc = 0
    for name in args.engines.split(","):
        t0 = time.perf_counter()
        res = results["engines"][name] = {}
        try:
            bench_family(families[name](sources, args.device), args, lens, check_lens, res, save)
        except Exception as exc:  # noqa: BLE001 - one engine's failure is reported, the other still runs
            import traceback

            traceback.print_exc()
            res.clear()
            res["error"] = f"{type(exc).__name__}: {exc}"
            rc = 1
        res["wall_s"] = time.perf_counter() - t0
        save()
    (out / "results.md").write_text(markdown(results))
    print(markdown(results))
    ok = all(r.get("equality", {}).get("fp32_pass") and r["equality"].get("bf16_pass")
             for r in results["engines"].values() if "error" not in r)
    return rc or (0 if ok else 2)


if __name__ == "__main__":
    sys.exit(main())
