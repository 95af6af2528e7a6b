"""Tiny models created locally and HF-transformers ground truth for conformance tests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from rlcore.config import TinyModelConfig
from rlcore.engines.hf import HFEngine

# HFEngine (core's built-in engine) and TinyModelConfig (engine.model.tiny's schema): what tests
# build a reference engine or a tiny model from
__all__ = [
    "HFEngine", "TinyModelConfig", "WORDS", "assert_same_tensors", "hf_greedy", "hf_model", "hf_token_logprobs",
    "make_mixed_moe_dir", "make_model_dir", "model_dir_tensors", "tiny_config",
]

WORDS = [str(i) for i in range(10)] + ["=", "+", "a", "b", "c"]


def tiny_config(arch: str = "qwen2", seed: int = 0, **overrides: Any) -> Any:
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


def model_dir_tensors(model_dir: str | Path) -> dict[str, Any]:
    """Every tensor of a model directory's ``*.safetensors`` files, by name (fails on a directory
    without weights)."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    assert files, f"no safetensors in {model_dir}: {sorted(p.name for p in Path(model_dir).iterdir())}"
    out: dict[str, Any] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def assert_same_tensors(a: dict[str, Any], b: dict[str, Any]) -> None:
    """The same names and, for each, bit-identical tensors (one process's values, never stored ones)."""
    import torch

    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def make_mixed_moe_dir(path: str | Path) -> tuple[Path, Any, Any]:
    """A tiny Qwen3-MoE with a dense middle layer (``mlp_only_layers=[1]``: routed layers 0 and 2)
    saved as an HF directory at ``path``: ``(path, model, tokenizer)``."""
    from dataclasses import replace

    import torch
    from transformers import AutoModelForCausalLM

    from rlcore.config import TinyModelConfig
    from rlcore.engines.tiny import init_tiny_weights, make_tokenizer
    from rlcore.engines.tiny import tiny_config as hf_tiny_config

    tok = make_tokenizer([str(i) for i in range(20)])
    tiny = replace(TinyModelConfig(), arch="qwen3_moe", num_layers=3, num_experts=8, topk=2, hidden_size=64,
                   head_dim=32, intermediate_size=64, moe_intermediate_size=32, seed=5, init_std=0.2)
    cfg = hf_tiny_config(tiny, vocab_size=len(tok), eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    cfg.mlp_only_layers = [1]
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    init_tiny_weights(model, tiny.init_std, tiny.seed)
    path = Path(path)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, model, tok


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
