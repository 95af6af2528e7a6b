"""Tiny MoE models on the ``hf`` engine, created locally, and the replay plugin driven the way the
trainer drives it (forward_request → engine forward with the router_hook chain → postprocess)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from omegaconf import OmegaConf
from rlcore.batch import PackedBatch
from rlcore.engines.tiny import init_tiny_weights, make_tokenizer, tiny_config
from rlcore.testing.models import HFEngine, TinyModelConfig
from rlcore.types import MicroBatchContext

WORDS = [str(i) for i in range(20)]


def make_engine(arch: str = "qwen3_moe", num_layers: int = 3, mlp_only_layers: tuple[int, ...] = (),
                num_experts: int = 8, topk: int = 2, seed: int = 0) -> HFEngine:
    from transformers import AutoModelForCausalLM

    tok = make_tokenizer(WORDS)
    tiny = replace(TinyModelConfig(), arch=arch, num_layers=num_layers, num_experts=num_experts, topk=topk,
                   hidden_size=64, head_dim=32, intermediate_size=64, moe_intermediate_size=32, seed=seed,
                   init_std=0.2)
    cfg = tiny_config(tiny, vocab_size=len(tok), eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    if mlp_only_layers:
        cfg.mlp_only_layers = list(mlp_only_layers)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    init_tiny_weights(model, tiny.init_std, seed)
    return HFEngine(model, tok, "cpu")


def make_batch(seed: int = 0, lens: tuple[int, ...] = (7, 5, 9), vocab: int = 20) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(1, vocab, (n,), generator=g) for n in lens]
    return PackedBatch.pack(seqs, [2] * len(seqs))


def replay_config(mode: str = "R3", **kw: Any) -> Any:
    return OmegaConf.create({"replay": {"mode": mode, "on_missing": kw.pop("on_missing", "error"),
                                        "mtp": kw.pop("mtp", "replay"), "agreement": kw.pop("agreement", False)},
                             **kw})


def context(batch: PackedBatch, config: Any, phase: str = "train", index: int = 0, step: int = 0) -> MicroBatchContext:
    return MicroBatchContext(step=step, phase=phase, index=index, count=1, batch=batch, config=config)


def perturb_routers(engine: HFEngine, scale: float = 3.0, seed: int = 1) -> None:
    """Change every router's weight so native routing changes."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, router in engine.seam.routers:
            router.weight.add_(torch.randn(router.weight.shape, generator=g) * scale)

