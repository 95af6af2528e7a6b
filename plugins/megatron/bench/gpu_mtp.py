"""MTP and routing-replay proofs of the megatron engine on a GPU (megatron-core 0.19 on the H100:
scripts/gpu/megatron_mtp_019.sh runs it; ``--device cpu`` runs it anywhere, slowly).

A benchmark script, not part of the ``rlcore_megatron`` package. Sections, each recorded in
``results.json`` (a failing section is recorded with its error and the others still run):

1. ``mtp_once``: megatron-core's own MTP loss is never added (:mod:`rlcore_megatron.mtp_checks`:
   spies, autograd-graph walk, the MTP layers' gradient equal to that of rlcore's MTP loss
   alone), the native-path control on this version (0.19: ``_postprocess`` with ``labels=None``
   derives labels from ``input_ids`` and adds a second loss), and which parameters receive MTP
   gradients for each ``detach_trunk`` / ``detach_head`` setting;
2. ``mimo_export``: a Qwen2 + MTP model's megatron export in MiMo's layout loaded into core's HF
   MiMo model: MTP hidden states and log-probs agree;
3. ``replay``: R3 (routes given) and R2 (recorded in the old-log-prob pass) through rlcore-replay:
   record, perturb the routers so native routing changes, replay — the experts equal the
   recorded ones (MTP router included), the log-probs equal a forward forced to those experts;
4. ``fused_mtp_head``: rlcore-mtp's loss through rlcore-fused's head (Triton on CUDA) against the
   reference head on the same engine output: loss and MTP-layer gradients;
5. ``train``: GRPO steps of a tiny MoE + MTP model with ``plugins: [megatron, fused, mtp]`` (the
   MTP loss through the fused Triton head), then the same with ``replay`` (R2) added, then
   examples/tiny_mtp.yaml's Qwen2 + 2 MTP layers (MiMo) with the local rollout drafting
   speculatively with the MTP layers pushed every step (``rollout.draft_depths=2``).

Usage: ``python plugins/megatron/bench/gpu_mtp.py --out DIR [--device cuda] [--steps 30]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch
from rlcore_megatron.testing import perturb_routers

SEQS = [[3, 4, 5, 13, 6, 2, 9], [7, 7, 13, 4], [10, 9, 8, 7, 6, 13, 2]]
MOE = dict(arch="qwen3_moe", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
           num_experts=8, topk=2, moe_intermediate_size=128, mtp_layers=1)
DENSE = dict(arch="qwen2", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
             mtp_layers=1)
MIMO = dict(arch="qwen2", hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64, mtp_layers=2)


def make_dir(root: Path, name: str, tiny: dict, seed: int) -> Path:
    from omegaconf import OmegaConf
    from rlcore.config import DataConfig
    from rlcore.engines.tiny import make_tokenizer
    from rlcore.tasks import successor
    from rlcore.testing.models import tiny_config
    from rlcore_megatron.hf_dir import tiny_source
    from safetensors.torch import save_file

    tok = make_tokenizer(successor(OmegaConf.structured(DataConfig)).vocab)
    src = tiny_source(tiny_config(seed=seed, **tiny), tok)
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    save_file({n: src.get(n).contiguous() for n in sorted(src.names)}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    src.config.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


def engine_for(path: Path, device: str):
    from rlcore_megatron.engine import HFSource, MegatronEngine

    return MegatronEngine(HFSource.from_dir(path), device=device)


def check_mtp_once(path: Path, device: str) -> dict:
    from rlcore.batch import PackedBatch
    from rlcore_megatron.mtp_checks import mtp_gradient_owners, mtp_loss_exactly_once, native_mtp_loss_control

    engine = engine_for(path, device)
    batch = PackedBatch.pack(SEQS, [1, 1, 2])
    once = mtp_loss_exactly_once(engine, batch)
    control = native_mtp_loss_control(engine, [3, 4, 5, 13, 6, 2, 9, 8])
    owners = {}
    for trunk in (False, True):
        for head in (False, True):
            got, _ = mtp_gradient_owners(engine, batch, detach_trunk=trunk, detach_head=head)
            owners[f"detach_trunk={trunk},detach_head={head}"] = {k: len(v) for k, v in got.items()}
    # the control passes on what megatron's loss did (its autoscaler's backward ran, the MTP
    # gradient changed); the graph walk is recorded beside it
    ok = (not once["megatron_calls"] and not once["autoscaler_in_graph"] and once["mtp_params_with_grad"] > 0
          and once["max_abs_grad_diff_vs_rlcore_alone"] == 0.0
          and control["megatron_calls"].get("MTPLossAutoScaler.backward", 0) >= 1
          and control["max_abs_grad_diff_vs_rlcore_alone"] > 1e-6
          and all((o["trunk"] == 0) == ("detach_trunk=True" in k) and (o["head"] == 0) == ("detach_head=True" in k)
                  and o["mtp"] > 0 for k, o in owners.items()))
    return {"passed": ok, "rlcore_path": once, "native_control": control, "gradient_owners": owners}


def check_mimo_export(path: Path, device: str, out: Path) -> dict:
    from rlcore.batch import PackedBatch
    from rlcore.heads import reference_logprobs
    from rlcore.testing.models import HFEngine
    from rlcore.types import HeadInput

    engine = engine_for(path, device)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in engine.named_parameters():
            if name.startswith("mtp."):
                p.add_((torch.randn(p.shape, generator=g) * 0.05).to(p.device))
    engine.save_hf(out)
    hf = HFEngine.from_pretrained(out, device=device)
    batch = PackedBatch.pack(SEQS, [1, 1, 2])
    with torch.no_grad():
        ours, theirs = engine.forward(batch, mtp_hidden=True), hf.forward(batch, mtp_hidden=True)
    labels = batch.roll(batch.labels(), -1).to(device)
    mask = batch.roll(batch.loss_mask, -1, fill=False).to(device)

    def lp(eng, hidden, lab):
        hw = eng.head()
        return reference_logprobs(HeadInput(hidden=hidden, weight=hw.weight, labels=lab, vocab=hw.vocab,
                                            loss_mask=batch.loss_mask.to(device))).logprobs

    cfg = json.loads((out / "config.json").read_text())
    res = {
        "architectures": cfg.get("architectures"), "num_nextn_predict_layers": cfg.get("num_nextn_predict_layers"),
        "mtp_tensor_names": sorted(n for n, _ in engine.export_hf_weights() if n.startswith("model.mtp_layers.0.")),
        "max_abs_mtp_hidden_diff": float((ours.mtp_hidden[0] - theirs.mtp_hidden[0]).abs().max()),
        "max_abs_mtp_logprob_diff": float((lp(engine, ours.mtp_hidden[0], labels)
                                           - lp(hf, theirs.mtp_hidden[0], labels))[mask].abs().max()),
    }
    res["passed"] = res["architectures"] == ["MiMoForCausalLM"] and res["max_abs_mtp_hidden_diff"] < 1e-4 \
        and res["max_abs_mtp_logprob_diff"] < 1e-4
    return res


def check_fused_mtp_head(path: Path, device: str) -> dict:
    """rlcore-mtp's MTP loss through rlcore-fused's head (Triton on CUDA tensors) against the
    reference head, on the same engine output: loss and the MTP layers' gradients."""
    from rlcore.batch import PackedBatch
    from rlcore.heads import reference_logprobs
    from rlcore_fused.head import FusedHead
    from rlcore_megatron.mtp_checks import rlcore_mtp_loss

    engine = engine_for(path, device)
    batch = PackedBatch.pack(SEQS, [1, 1, 2]).to(engine.device)
    fused = FusedHead(backend="auto")
    params = [(n, p) for n, p in engine.named_parameters() if n.startswith("mtp.")]
    res = {}
    for name, fn in (("reference", reference_logprobs), ("fused", fused)):
        engine.zero_grad()
        out = engine.forward(batch, mtp_hidden=True, mtp_detach_trunk=True)
        loss = rlcore_mtp_loss(batch, out, engine.head(), fn)
        loss.backward()
        res[name] = (float(loss.detach()), [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                                            for _, p in params])
    engine.zero_grad()
    grad_diff = max(float((a - b).abs().max()) for a, b in zip(res["reference"][1], res["fused"][1], strict=True))
    grad_scale = max(float(a.abs().max()) for a in res["reference"][1])
    out = {"mtp_loss_reference": res["reference"][0], "mtp_loss_fused": res["fused"][0],
           "abs_loss_diff": abs(res["reference"][0] - res["fused"][0]),
           "max_abs_mtp_grad_diff": grad_diff, "max_abs_mtp_grad": grad_scale,
           "fused_kernels": "triton" if fused._triton is not None else "torch"}
    out["passed"] = out["abs_loss_diff"] < 1e-4 and grad_diff <= 1e-3 * max(grad_scale, 1e-12) \
        and (device != "cuda" or out["fused_kernels"] == "triton")
    return out


def _replay_cfg(mode: str):
    from omegaconf import OmegaConf

    return OmegaConf.create({"replay": {"mode": mode, "on_missing": "error", "mtp": "replay", "agreement": True}})


def check_replay(path: Path, device: str) -> dict:
    from rlcore.batch import PackedBatch
    from rlcore.heads import reference_logprobs
    from rlcore.types import HeadInput, MicroBatchContext, RouterDecision
    from rlcore_replay.replay import Replayer

    def logprobs(engine, batch, out):
        hw = engine.head()
        return reference_logprobs(HeadInput(hidden=out.hidden, weight=hw.weight, labels=batch.labels().to(device),
                                            vocab=hw.vocab, loss_mask=batch.loss_mask.to(device))).logprobs

    def replayed(engine, rep, batch, phase):
        ctx = MicroBatchContext(step=0, phase=phase, index=0, count=1, batch=batch, config=rep.config)
        rep.forward_request(ctx)
        out = engine.forward(batch, record_routes=True, router=rep.router_hook, micro_batch=ctx, mtp_hidden=True)
        res = rep.postprocess(ctx, SimpleNamespace(engine=out))
        return out, res

    results = {}
    # R3: the routes are given (as a rollout engine would return them)
    engine = engine_for(path, device)
    batch = PackedBatch.pack(SEQS, [1, 1, 2])
    with torch.no_grad():
        base = engine.forward(batch, record_routes=True, mtp_hidden=True)
        recorded = base.routes.clone()
        batch.fields["routes"] = recorded
        same, _ = replayed(engine, Replayer(_replay_cfg("R3")), batch, "train")
        bit_identical = torch.equal(logprobs(engine, batch, same), logprobs(engine, batch, base)) and \
            torch.equal(same.mtp_hidden[0], base.mtp_hidden[0])
        perturb_routers(engine)
        native = engine.forward(batch, record_routes=True, mtp_hidden=True).routes
        batch.fields["routes"] = recorded
        rep = Replayer(_replay_cfg("R3"))
        out, _ = replayed(engine, rep, batch, "train")
        forced = engine.forward(batch, mtp_hidden=True, record_routes=True,
                                router=lambda c: RouterDecision(indices=recorded[:, c.routed_index].long().to(device)))
        metrics = rep.step_end(SimpleNamespace(step=0, batch=batch))
    results["R3"] = {
        "seam": engine.seam.mode, "routes_shape": list(recorded.shape),
        "layout_layers": list(engine.info.route_layout.layers),
        "unchanged_weights_bit_identical": bool(bit_identical),
        "perturbation_changed_native_routing": not torch.equal(native, recorded),
        "native_routes_differing_fraction": float((native != recorded).any(-1).float().mean()),
        "replayed_experts_equal_recorded": torch.equal(out.routes, recorded),
        "mtp_router_replayed": torch.equal(out.routes[:, -1], recorded[:, -1]),
        "logprobs_equal_forced_forward": torch.equal(logprobs(engine, batch, out), logprobs(engine, batch, forced)),
        "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))},
    }
    # R2: recorded in the old-log-prob pass, replayed in the update after the routers changed
    engine = engine_for(path, device)
    batch = PackedBatch.pack(SEQS, [1, 1, 2])
    rep = Replayer(_replay_cfg("R2"))
    with torch.no_grad():
        old, res = replayed(engine, rep, batch, "old_logprob")
        for k, v in res.batch_updates.items():
            batch.write_back(batch, k, v)
        perturb_routers(engine)
        native = engine.forward(batch, record_routes=True, mtp_hidden=True).routes
    again, _ = replayed(engine, rep, batch, "train")  # with gradients, as the update runs
    results["R2"] = {
        "perturbation_changed_native_routing": not torch.equal(native, old.routes),
        "replayed_experts_equal_recorded": torch.equal(again.routes, old.routes),
    }
    results["passed"] = all(v for r in (results["R3"], results["R2"]) for k, v in r.items()
                            if isinstance(v, bool))
    return results


def train(out_dir: Path, device: str, steps: int, forward: str, extra_plugins: list[str],
          extra: list[str], tiny: dict | None = None) -> dict:
    from rlcore.stack import load_config, resolve
    from rlcore.testing.runs import Trainer

    plugins = ["megatron", "mtp"] + ([forward] if forward != "reference" else []) + extra_plugins
    tiny = tiny or MOE
    overrides = [
        "engine.name=megatron", f"engine.device={device}",
        *[f"engine.model.tiny.{k}={v}" for k, v in tiny.items()],
        # the local rollout builds MTP drafts only for Qwen2 (MiMo); a MoE model's stay in training
        f"megatron.export_mtp={'true' if tiny['arch'] == 'qwen2' else 'false'}",
        f"training.steps={steps}", "training.lr=0.001", "rollout.n=8", "data.prompts_per_step=16",
        f"output.dir={out_dir}", "output.checkpoint_every=0", "output.plot=false", "output.tensorboard=false",
        f"forward.name={forward}", f"plugins=[{','.join(plugins)}]", *extra,
    ]
    cfg, pm = load_config(None, overrides)
    stack = resolve(cfg, pm)
    t0 = time.perf_counter()
    trainer = Trainer(stack)
    summary = trainer.run()
    wall = time.perf_counter() - t0
    head = trainer.forward_fn
    kernels = ("triton" if getattr(head, "_triton", None) is not None else "torch") if forward == "fused" else forward
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    k = min(5, len(rows))

    def first_last(key):
        vals = [r[key] for r in rows if key in r]
        return [vals[0], vals[-1]] if vals else None

    return {
        "plugins": plugins, "overrides": extra, "steps": len(rows), "completed": summary["completed"],
        "forward_fn": type(head).__name__, "head_kernels": kernels,
        "reward_first5": sum(r["reward_mean"] for r in rows[:k]) / k,
        "reward_last5": sum(r["reward_mean"] for r in rows[-k:]) / k,
        "mtp_loss_term_first_last": first_last("loss/mtp/mtp"),
        "mtp_loss_d1_first_last": first_last("mtp/loss_d1"),
        "mtp_acceptance_d1_first_last": first_last("mtp/acceptance_d1"),
        "mtp_loss_d2_first_last": first_last("mtp/loss_d2"),
        "rollout_acceptance_d1_first_last": first_last("rollout/acceptance_d1"),
        "rollout_acceptance_d2_first_last": first_last("rollout/acceptance_d2"),
        "rollout_accept_length_first_last": first_last("rollout/accept_length"),
        "draft_weight_version_last": first_last("rollout/draft_weight_version"),
        "sync_verified_all": all(r.get("sync_verified", False) for r in rows),
        "median_tokens_per_second": sorted(r.get("tokens_per_second", 0.0) for r in rows)[len(rows) // 2],
        "replay_coverage_first_last": first_last("replay/coverage"),
        "logprob_mismatch_max": max(r.get("logprob_mismatch_max", 0.0) for r in rows),
        "median_step_seconds": sorted(r["step_seconds"] for r in rows)[len(rows) // 2],
        "wall_seconds": wall,
        "metric_keys": sorted(k for k in rows[-1] if k.startswith(("mtp", "loss/", "replay"))),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--forward", default="fused")
    p.add_argument("--only", default="", help="comma-separated sections to run (default: all)")
    p.add_argument("--results", default="", help="also write results.json here after every section")
    args = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import megatron.core as mc

    results: dict = {"megatron_core": mc.__version__, "torch": torch.__version__, "python": sys.version.split()[0],
                     "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                     "models": {"moe_mtp": MOE, "dense_mtp": DENSE}}
    dirs = {"moe_mtp": make_dir(out / "models", "moe_mtp", MOE, 9), "dense_mtp": make_dir(out / "models", "dense_mtp", DENSE, 10)}
    sections = {
        "mtp_once": lambda: check_mtp_once(dirs["moe_mtp"], args.device),
        "mtp_once_mimo": lambda: check_mtp_once(dirs["dense_mtp"], args.device),
        "mimo_export": lambda: check_mimo_export(dirs["dense_mtp"], args.device, out / "mimo_export"),
        "fused_mtp_head": lambda: check_fused_mtp_head(dirs["moe_mtp"], args.device),
        "replay": lambda: check_replay(dirs["moe_mtp"], args.device),
        "train_fused_mtp": lambda: train(out / "train_fused_mtp", args.device, args.steps, args.forward, [], []),
        "train_fused_mtp_replay_r2": lambda: train(out / "train_fused_mtp_r2", args.device, args.steps, args.forward,
                                                   ["replay"], ["replay.mode=R2", "algorithm.old_logprobs=recompute"]),
        # examples/tiny_mtp.yaml's MiMo model on the megatron engine: MTP weights pushed to the
        # local rollout every step, which drafts with them (speculative sampling, 2 depths)
        "train_mimo_fused_mtp_draft": lambda: train(out / "train_mimo_draft", args.device, args.steps, args.forward,
                                                    [], ["rollout.draft_depths=2"], tiny=MIMO),
    }
    only = [s for s in args.only.split(",") if s]
    failed = []
    for name, fn in sections.items():
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        try:
            results[name] = fn()
        except Exception:  # noqa: BLE001 - recorded; the other sections still run
            results[name] = {"passed": False, "error": traceback.format_exc()[-3000:]}
        results[name]["seconds"] = round(time.perf_counter() - t0, 1)
        if results[name].get("passed") is False:
            failed.append(name)
        print(f"== {name}", json.dumps(results[name], indent=1, default=str), flush=True)
        results["failed_sections"] = failed
        for path in {out / "results.json", *([Path(args.results)] if args.results else [])}:
            path.write_text(json.dumps(results, indent=1, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
