"""Tiny models created locally and HF-transformers ground truth for conformance tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from omegaconf import OmegaConf

WORDS = [str(i) for i in range(10)] + ["=", "+", "a", "b", "c"]


def tiny_config(arch: str = "qwen2", seed: int = 0, **overrides: Any) -> Any:
    from rlcore.config import TinyModelConfig

    cfg = OmegaConf.structured(TinyModelConfig)
    cfg.arch = arch
    cfg.seed = seed
    for k, v in overrides.items():
        cfg[k] = v
    return cfg


def make_model_dir(path: str | Path, arch: str = "qwen2", seed: int = 0, **overrides: Any) -> Path:
    """A tiny HF model directory (weights + tokenizer) for ``arch``, deterministic in ``seed``."""
    from rlcore.engines.tiny import save_tiny

    return save_tiny(path, tiny_config(arch, seed, **overrides), WORDS)


@dataclass
class HFRun:
    tokens: list[int]
    logprobs: list[float]


def hf_model(model_dir: str | Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    m.eval()
    return m


def hf_greedy(model: Any, prompt: Sequence[int], max_new_tokens: int, eos: int | None = None) -> HFRun:
    """Greedy continuation by plain transformers (no cache), float32: the ground truth."""
    import torch

    ids = list(prompt)
    toks, lps = [], []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            lp = torch.log_softmax(logits, -1)
            t = int(lp.argmax())
            toks.append(t)
            lps.append(float(lp[t]))
            ids.append(t)
            if eos is not None and t == eos:
                break
    return HFRun(toks, lps)


def hf_token_logprobs(model: Any, prompt: Sequence[int], response: Sequence[int], temperature: float = 1.0) -> list[float]:
    """Log-probs of ``response`` given ``prompt`` under ``softmax(logits / temperature)``."""
    import torch

    ids = list(prompt) + list(response)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, -1)
    P = len(prompt)
    return [float(lp[P - 1 + i, t]) for i, t in enumerate(response)]
