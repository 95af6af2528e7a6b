"""Acceptance of the local rollout's MTP draft: synced (the checkpoint's trained MTP layers)
versus stale (the trained trunk with the MTP layers left at their initial weights, as a draft
that never received a push would be). Same prompts, same seed, temperature 1, 2 draft depths.

    python plugins/mtp/bench/stale_draft.py RUN_DIR/checkpoints/step-XXXXXXXX.pt [--prompts 16]

The checkpoint must come from ``examples/tiny_mtp.yaml`` (the tiny model is rebuilt from it).
Prints one JSON line per draft."""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from rlcore.engines import mimo_layout
from rlcore.engines.tiny import make_tiny_model, make_tokenizer
from rlcore.rollout_local import LocalRollout
from rlcore.tasks import successor
from rlcore.testing.models import HFEngine, TinyModelConfig
from rlcore.types import Prompt, SamplingSettings

ROOT = Path(__file__).resolve().parents[3]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=2)
    args = ap.parse_args()
    cfg = OmegaConf.load(ROOT / "examples" / "tiny_mtp.yaml")
    task = successor()
    tok = make_tokenizer(task.vocab)
    tiny = OmegaConf.merge(OmegaConf.structured(TinyModelConfig), cfg.engine.model.tiny)
    initial = make_tiny_model(tiny, tok)
    trained = make_tiny_model(tiny, tok)
    state = torch.load(args.checkpoint, map_location="cpu", weights_only=False)  # our own checkpoint
    trained.load_state_dict(state["engine"]["model"])
    stale = make_tiny_model(tiny, tok)
    stale.load_state_dict(state["engine"]["model"])
    with torch.no_grad():
        init = dict(initial.named_parameters())
        for n, p in stale.named_parameters():
            if mimo_layout.is_mtp_name(n):
                p.copy_(init[n])
    texts = task.make_prompts(random.Random(0), args.prompts)
    prompts = [Prompt(ids=tok(t.text)["input_ids"], index=i) for i, t in enumerate(texts)]
    params = SamplingSettings(n=args.n, temperature=1.0, max_new_tokens=int(cfg.rollout.max_new_tokens), seed=0)
    with tempfile.TemporaryDirectory() as d:
        for name, model in (("synced", trained), ("stale", stale)):
            HFEngine(model, tok).save_hf(Path(d) / name)
            r = LocalRollout(seed=0, draft_depths=2)
            r.start(str(Path(d) / name))
            t0 = time.perf_counter()
            samples = r.generate(prompts, params)
            dt = time.perf_counter() - t0
            toks = sum(len(s.response_ids) for s in samples)
            print(json.dumps({"draft": name, "step": state["step"], **r.rollout_metrics(), "samples": len(samples),
                              "tokens": toks, "seconds": round(dt, 2)}))


if __name__ == "__main__":
    main()
