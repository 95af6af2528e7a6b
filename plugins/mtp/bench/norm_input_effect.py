"""Draft acceptance of the MTP layer fed the trunk's hidden state before versus after model.norm.

rlcore trains MiMo's MTP layer (``rlcore.engines.mimo``) on the trunk's last hidden state
*before* ``model.norm``, as vLLM serves it; SGLang 0.5.17 feeds it the state *after*
``model.norm``. The layer's own ``hidden_layernorm`` makes the two inputs equal while
``model.norm.weight`` is uniform (its init) and different by the per-channel factor
``w / rms(w * x_hat)`` once training moves that weight. This script measures what that costs:

1. trains ``examples/tiny_mtp.yaml`` with one MTP layer (``engine.model.tiny.mtp_layers=1``, the
   layout of ``examples/gpu_sglang_mtp.yaml``; ``rollout.max_new_tokens`` 16 as there) by GRPO on
   CPU through rlcore's own ``Trainer``, once per ``--run DTYPE:LR`` (``engine.model.dtype``,
   ``training.lr``), keeping the model after 0, E, 2E, ... N updates (``--every`` E, ``--steps`` N);
2. at each, samples a fixed prompt set with the model itself (rlcore's local rollout, temperature
   1, seed 0) and runs the MTP depth-1 forward twice on the same sequences through
   ``HFEngine.forward(mtp_hidden=True)``: as rlcore/vLLM feed it (pre-norm) and with the trunk
   state passed through ``model.norm`` first (post-norm, SGLang 0.5.17);
3. reports, per variant, over the positions rlcore_mtp's ``mtp/acceptance_d1`` counts
   (``rlcore_mtp.loss.depth_targets``):
   * ``greedy``: the fraction whose MTP argmax is the sampled next-next token
     (``rlcore_mtp.loss.argmax_hits``, exactly ``mtp/acceptance_d1``'s definition);
   * ``p_top1``: mean target probability of the MTP argmax token, i.e. the expected acceptance of
     a top-1 draft verified by accepting it with probability p_target(draft) (SGLang's
     target-only verification at threshold 1, topk 1; our reading of its source, not run here);
   * ``min_pq``: mean sum_v min(p_target, q_draft): the acceptance of standard speculative
     sampling (draft sampled from q; rlcore's local rollout, vLLM);
   plus ``model.norm.weight``'s std/mean (0 = uniform), the fraction of positions where the two
   variants draft a different token, the total-variation distance of their draft distributions,
   and the greedy proxy split into the first-response-token position (which SGLang never drafts:
   the target samples that token from the prefill) and the rest. Writes a JSON (``--out``) and
   prints two markdown tables.

    .venv/bin/python plugins/mtp/bench/norm_input_effect.py   # float32:0.001 float32:0.01 bfloat16:0.001

The defaults (3 runs x 45 steps, 4 measurements each) took 54 s on an idle 2-core machine (a
60-step run took 11 minutes while other jobs loaded it: wall times vary with the load).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from rlcore.rollout_local import LocalRollout
from rlcore.sample_batch import pack_samples
from rlcore.stack import load_stack
from rlcore.testing.models import HFEngine
from rlcore.testing.runs import Trainer, list_checkpoints
from rlcore.types import Prompt, SamplingSettings
from rlcore_mtp.loss import argmax_hits, depth_targets

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "examples" / "tiny_mtp.yaml"
QUIET = ["output.plot=false", "output.tensorboard=false", "output.progress=false", "output.export_hf=never"]


def train(dtype: str, lr: float, args: argparse.Namespace, run_dir: Path) -> tuple[Trainer, dict[int, dict], dict]:
    """GRPO with rlcore's Trainer; ``{updates: model state}`` for 0, every, 2*every, ... and the
    trainer's metrics rows by step."""
    overrides = ["engine.model.tiny.mtp_layers=1", f"engine.model.dtype={dtype}", f"training.lr={lr}",
                 f"training.steps={args.steps}", f"rollout.max_new_tokens={args.max_new_tokens}",
                 f"output.checkpoint_every={args.every}", "output.keep_checkpoints=1000", f"output.dir={run_dir}",
                 *QUIET]
    trainer = Trainer(load_stack(str(CONFIG), overrides), overwrite=True)
    states = {0: {k: v.detach().clone() for k, v in trainer.engine.model.state_dict().items()}}
    trainer.run()
    for step, record in list_checkpoints(run_dir):
        state_file = run_dir / "checkpoints" / json.loads(record.read_text())["state_file"]
        states[step + 1] = torch.load(state_file, map_location="cpu", weights_only=False)["engine"]["model"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return trainer, states, {int(r["step"]): r for r in rows}


@contextlib.contextmanager
def post_norm_input(model):
    """Feed the MTP layers ``model.norm(trunk_hidden)`` (SGLang 0.5.17) instead of the pre-norm
    state HFEngine captures (rlcore, vLLM); everything else is the engine's own path."""
    real = model.mtp_forward
    model.mtp_forward = lambda ids, attn, trunk_hidden, **kw: real(ids, attn, model.model.norm(trunk_hidden), **kw)
    try:
        yield
    finally:
        del model.mtp_forward


@torch.no_grad()
def measure(engine: HFEngine, prompts: list[Prompt], params: SamplingSettings, workdir: Path) -> dict:
    """Depth-1 acceptance proxies of both inputs on the model's own samples (fixed prompts, seed)."""
    model = engine.model.eval()
    engine.save_hf(workdir)
    rollout = LocalRollout(seed=0)
    rollout.start(str(workdir))
    samples = rollout.generate(prompts, params)
    rollout.shutdown()
    batch = pack_samples(samples, [0.0] * len(samples), engine, step=0)
    labels, mask = depth_targets(batch, 1)
    # SGLang drafts only after a sampled token: the position whose input token is the prompt's last
    # (it predicts the first response token, which the target samples from the prefill) is never drafted
    drafted = (mask & batch.loss_mask)[mask]
    head = engine.head()
    w = head.weight.float()
    out = {"positions": int(mask.sum()), "samples": len(samples), "first_frac": float((~drafted).float().mean())}
    drafts, qs = {}, {}
    for name, ctx in (("pre", contextlib.nullcontext()), ("post", post_norm_input(model))):
        with ctx:
            res = engine.forward(batch, mtp_hidden=True)
        # the target's distribution of token t+2 is its head at position t+1 (post-norm, temperature 1)
        p = batch.roll(torch.softmax(res.hidden.float() @ w.T, -1), -1)[mask]
        h = res.mtp_hidden[0]
        q = torch.softmax(h.float() @ w.T, -1)[mask]
        top1 = q.argmax(-1)
        drafts[name], qs[name] = top1, q
        hits = argmax_hits(h, head.weight, labels, mask, head.vocab)[mask].float()
        out[f"greedy_{name}"] = float(hits.mean())
        out[f"greedy_first_{name}"] = float(hits[~drafted].mean())
        out[f"greedy_drafted_{name}"] = float(hits[drafted].mean())
        p_top1 = p.gather(1, top1[:, None]).squeeze(1)
        out[f"p_top1_{name}"] = float(p_top1.mean())
        out[f"p_top1_drafted_{name}"] = float(p_top1[drafted].mean())
        out[f"min_pq_{name}"] = float(torch.minimum(p, q).sum(-1).mean())
    out["draft_disagree"] = float((drafts["pre"] != drafts["post"]).float().mean())
    out["q_tv"] = float(0.5 * (qs["pre"] - qs["post"]).abs().sum(-1).mean())
    nw = model.model.norm.weight.detach().float()
    out["norm_std_over_mean"] = float(nw.std() / nw.mean())
    out["norm_max_rel_dev"] = float(((nw - nw.mean()).abs().max()) / nw.mean())
    return out


#: (header, result key, format) of the two tables: the norm effect, then where the positions come from
NORM_COLS = [("run", "run", "s"), ("updates", "updates", "d"), ("norm w std/mean", "norm_std_over_mean", ".4f"),
             ("greedy pre", "greedy_pre", ".3f"), ("greedy post", "greedy_post", ".3f"), ("Δ greedy", "d_greedy", "+.3f"),
             ("draft token differs", "draft_disagree", ".4f"), ("TV(q_pre, q_post)", "q_tv", ".4f"),
             ("p_top1 pre", "p_top1_pre", ".3f"), ("p_top1 post", "p_top1_post", ".3f"),
             ("min_pq pre", "min_pq_pre", ".3f"), ("min_pq post", "min_pq_post", ".3f")]
POSITION_COLS = [("run", "run", "s"), ("updates", "updates", "d"), ("reward_mean", "reward_mean", ".3f"),
                 ("trainer mtp/acceptance_d1", "trainer_acceptance_d1", ".3f"), ("greedy pre (all)", "greedy_pre", ".3f"),
                 ("share of first-token positions", "first_frac", ".3f"),
                 ("greedy pre, first token", "greedy_first_pre", ".3f"),
                 ("greedy pre, drafted", "greedy_drafted_pre", ".3f"),
                 ("greedy post, drafted", "greedy_drafted_post", ".3f"),
                 ("p_top1 post, drafted", "p_top1_drafted_post", ".3f")]


def table(results: list[dict], cols: list[tuple[str, str, str]]) -> str:
    lines = ["| " + " | ".join(c[0] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        cells = [format(r[k], f) if isinstance(r.get(k), (int, float, str)) else "–" for _, k, f in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", nargs="+", default=["float32:0.001", "float32:0.01", "bfloat16:0.001"],
                    help="DTYPE:LR, one training run each (engine.model.dtype, training.lr)")
    ap.add_argument("--steps", type=int, default=45)
    ap.add_argument("--every", type=int, default=15, help="measure after every this many updates (and at 0)")
    ap.add_argument("--max-new-tokens", type=int, default=16, help="rollout.max_new_tokens (gpu_sglang_mtp.yaml's)")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--out", default="/tmp/mtp_norm_input.json")
    args = ap.parse_args()
    t0 = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="mtp_norm_input_") as tmp:
        for spec in args.run:
            dtype, lr = spec.split(":")[0], float(spec.split(":")[1])
            run_dir = Path(tmp) / spec.replace(":", "_")
            trainer, states, rows = train(dtype, lr, args, run_dir)
            tok = trainer.tokenizer
            texts = trainer.built.task.make_prompts(random.Random(12345), args.prompts)  # not a training step's
            prompts = [Prompt(ids=tok(t.text, add_special_tokens=False)["input_ids"], index=i, meta=t.meta)
                       for i, t in enumerate(texts)]
            params = SamplingSettings(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0)
            model = trainer.engine.model
            for updates in sorted(states):
                model.load_state_dict(states[updates])
                hf_dir = Path(tmp) / f"hf_{spec.replace(':', '_')}_{updates}"
                r = {"run": f"{dtype} lr {lr:g}", "dtype": dtype, "lr": lr, "updates": updates,
                     **measure(HFEngine(model, tok), prompts, params, hf_dir)}
                r["d_greedy"] = r["greedy_post"] - r["greedy_pre"]
                row = rows.get(updates, {})  # the train pass of step `updates` runs the model after that many updates
                r["trainer_acceptance_d1"] = row.get("mtp/acceptance_d1")
                r["reward_mean"] = row.get("reward_mean")
                results.append(r)
                print(json.dumps(r), flush=True)
    summary = {f"mean_abs_d_{k}": sum(abs(r[f"{k}_post"] - r[f"{k}_pre"]) for r in results) / len(results)
               for k in ("greedy", "p_top1", "min_pq")}
    summary["max_draft_disagree"] = max(r["draft_disagree"] for r in results)
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    meta = {"config": str(CONFIG.relative_to(ROOT)), "overrides": "engine.model.tiny.mtp_layers=1", **vars(args),
            "torch": torch.__version__, "threads": torch.get_num_threads()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results, "summary": summary}, indent=1) + "\n")
    print("\n" + table(results, NORM_COLS) + "\n\n" + table(results, POSITION_COLS) + "\n")
    print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))


if __name__ == "__main__":
    main()
