"""GPU smoke run of the megatron engine (scripts/gpu/megatron_019.sh runs it on the GPU machine).

A benchmark script, not part of the ``rlcore_megatron`` package: it drives the whole stack (config,
trainer) the way a user's run would, which the engine package itself never imports.

Three checks on a tiny Qwen3-MoE-style model with one MTP layer, created locally:

1. **log-probs vs the hf engine** on the same weights, fp32 (TF32 off): the max abs difference
   of per-token log-probs (reference head) between transformers and the megatron engine;
2. **routing replay**: routes recorded in one forward, replayed in a second; the log-probs and
   the MTP hidden states must be bit-identical, and the route tensor must have the documented
   ``[tokens, moe_layers + mtp_layers, topk]`` shape;
3. **training**: ``rlcore``'s GRPO loop (local rollout, inproc sync, ``--forward`` head) for a few
   steps with an MTP loss term computed through the same forward_fn as the policy loss (an
   inline plugin: ``forward_request`` asks for MTP hidden states, ``postprocess`` adds the loss).

Writes ``results.json`` and the training metrics under ``--out``. Usage::

    python plugins/megatron/bench/gpu_smoke.py --out DIR [--device cuda] [--steps 30]

with rlcore and rlcore-megatron installed (the script's own directory holds no package).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

import torch


def _mtp_plugin(weight: float) -> types.ModuleType:
    from rlcore import PLUGIN_API, hookimpl
    from rlcore.types import ForwardRequest, HeadInput, PostprocessResult

    mod = types.ModuleType("gpu_smoke_mtp")
    mod.PLUGIN_API = PLUGIN_API

    @hookimpl
    def forward_request(ctx):
        return ForwardRequest(mtp_hidden=ctx.phase == "train")

    @hookimpl
    def postprocess(ctx, output):
        hidden = output.engine.mtp_hidden
        if ctx.phase != "train" or not hidden:
            return None
        batch = ctx.batch
        total, metrics = 0.0, {}
        labels = batch.labels()
        mask = batch.loss_mask
        for d, h in enumerate(hidden, start=1):
            labels = batch.roll(labels, -1, fill=batch.pad_id)  # depth d predicts token t + 1 + d
            mask = batch.roll(mask, -1, fill=False)
            head = output.forward_fn(HeadInput(hidden=h, weight=output.head_weight.weight,
                                               labels=labels.to(h.device), vocab=output.head_weight.vocab,
                                               loss_mask=mask.to(h.device), compute_entropy=False))
            n = max(int(mask.sum()), 1)
            loss = -head.logprobs.sum() / n
            total = total + loss
            metrics[f"mtp_loss_{d}"] = float(loss.detach())
        return PostprocessResult(loss_terms={"mtp": weight * total}, metrics=metrics)

    mod.forward_request = forward_request
    mod.postprocess = postprocess
    return mod


def check_logprobs_and_replay(model_dir: Path, device: str) -> dict:
    from rlcore.batch import PackedBatch
    from rlcore.heads import reference_logprobs
    from rlcore.testing.models import hf_model
    from rlcore.types import HeadInput, RouterDecision
    from rlcore_megatron.engine import HFSource, MegatronEngine

    engine = MegatronEngine(HFSource.from_dir(model_dir), device=device)
    hf = hf_model(model_dir).to(device)
    seqs = [[3, 4, 5, 13, 6, 2], [7, 7, 13], [10, 9, 8, 7, 6, 13, 2, 3, 4]]
    batch = PackedBatch.pack(seqs, [1] * len(seqs))

    def logprobs(**kw):
        out = engine.forward(batch, **kw)
        hw = engine.head()
        lp = reference_logprobs(HeadInput(hidden=out.hidden, weight=hw.weight, labels=batch.labels().to(device),
                                          vocab=hw.vocab, loss_mask=batch.loss_mask.to(device))).logprobs
        return out, lp

    with torch.no_grad():
        out, lp = logprobs(record_routes=True, mtp_hidden=True)
        worst = 0.0
        for seq, got in zip(seqs, batch.unpack(lp.cpu()), strict=True):
            logits = hf(torch.tensor([seq], device=device)).logits[0].float()
            ref = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(seq[1:], device=device)[:, None])[:, 0]
            worst = max(worst, float((got[:-1] - ref.cpu()).abs().max()))
        routes = out.routes
        out2, lp2 = logprobs(router=lambda c: RouterDecision(indices=routes[:, c.routed_index].long()),
                             record_routes=True, mtp_hidden=True)
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "router_seam": engine.seam.mode,
        "attention_path": engine.attention_path,
        "route_layout_layers": list(engine.info.route_layout.layers),
        "routes_shape": list(routes.shape),
        "max_abs_logprob_diff_vs_hf_fp32": worst,
        "replay_routes_equal": bool(torch.equal(out2.routes, routes)),
        "replay_logprobs_bit_exact": bool(torch.equal(lp2, lp)),
        "replay_mtp_hidden_bit_exact": bool(all(torch.equal(a, b) for a, b in zip(out.mtp_hidden, out2.mtp_hidden, strict=True))),
    }


def train(out_dir: Path, device: str, steps: int, tiny: dict, forward: str = "reference") -> dict:
    from rlcore.stack import load_config, resolve

    overrides = [
        "engine.name=megatron", f"engine.device={device}",
        *[f"engine.model.tiny.{k}={v}" for k, v in tiny.items()],
        "megatron.export_mtp=false",  # the local rollout serves no MTP drafts
        f"training.steps={steps}", "training.lr=0.001", "rollout.n=8", "data.prompts_per_step=16",
        f"output.dir={out_dir}", "output.checkpoint_every=0", "output.plot=false", "output.tensorboard=false",
        f"forward.name={forward}",
    ]
    # the engine is a plugin; a plugin's head (rlcore-fused) serves the policy loss and the MTP loss alike
    plugins = ["megatron"] + ([forward] if forward != "reference" else [])
    overrides.append(f"plugins=[{','.join(plugins)}]")
    cfg, pm = load_config(None, overrides)
    pm.register(_mtp_plugin(0.1), "gpu-smoke-mtp")
    stack = resolve(cfg, pm)
    t0 = time.perf_counter()
    from rlcore.testing.runs import Trainer

    summary = Trainer(stack).run()
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    k = min(5, len(rows))
    mtp = [r.get("loss/gpu-smoke-mtp/mtp") for r in rows]
    return {
        "steps": len(rows),
        "reward_first5": sum(r["reward_mean"] for r in rows[:k]) / k,
        "reward_last5": sum(r["reward_mean"] for r in rows[-k:]) / k,
        "mtp_loss_term_first": mtp[0],
        "mtp_loss_term_last": mtp[-1],
        "logprob_mismatch_max": max(r["logprob_mismatch_max"] for r in rows),
        "median_step_seconds": sorted(r["step_seconds"] for r in rows)[len(rows) // 2],
        "wall_seconds": wall,
        "completed": summary["completed"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--forward", default="reference", help="forward_fn for training (e.g. fused, with rlcore-fused installed)")
    args = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import megatron.core as mc
    from rlcore.engines.tiny import make_tokenizer
    from rlcore.tasks import successor
    from rlcore.testing.models import tiny_config
    from rlcore_megatron.hf_dir import tiny_source

    tiny = dict(arch="qwen3_moe", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                num_experts=8, topk=2, moe_intermediate_size=128, mtp_layers=1)
    results: dict = {"megatron_core": mc.__version__, "torch": torch.__version__, "python": sys.version.split()[0],
                     "model": tiny}
    # an HF directory of the same tiny model the trainer creates (same seed), MTP layer included
    from omegaconf import OmegaConf
    from rlcore.config import DataConfig

    words = successor(OmegaConf.structured(DataConfig)).vocab
    tok = make_tokenizer(words)
    src = tiny_source(tiny_config(**tiny), tok)
    model_dir = out / "tiny_moe_mtp_hf"
    model_dir.mkdir(exist_ok=True)
    from safetensors.torch import save_file

    save_file({n: src.get(n).contiguous() for n in sorted(src.names)}, str(model_dir / "model.safetensors"),
              metadata={"format": "pt"})
    src.config.save_pretrained(str(model_dir))
    tok.save_pretrained(str(model_dir))

    results["checks"] = check_logprobs_and_replay(model_dir, args.device)
    print(json.dumps(results["checks"], indent=1), flush=True)
    results["forward_fn"] = args.forward
    results["train"] = train(out / "train", args.device, args.steps, {k: v for k, v in tiny.items()}, args.forward)
    print(json.dumps(results["train"], indent=1), flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
