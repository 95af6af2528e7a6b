"""A tiny MiMo-layout checkpoint for the engine tests: a Qwen2 model plus ``model.mtp_layers.{d}.*``
(token/hidden layernorms, ``input_proj`` over [hidden, embedding], one Qwen2 decoder block, a final
layernorm), ``architectures: [MiMoForCausalLM]`` and ``num_nextn_predict_layers`` in config.json:
the names vLLM's ``mimo.py`` / ``mimo_mtp.py`` load. Written from tensors directly, so the tests do
not depend on a training engine that builds MTP layers."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

#: the per-depth tensors besides the decoder block's own
MTP_EXTRA = ("token_layernorm.weight", "hidden_layernorm.weight", "final_layernorm.weight", "input_proj.weight")


def mtp_tensor_names(layer_names: list[str], depth: int) -> list[str]:
    """Names of depth ``depth``'s tensors, given decoder layer 0's names without the prefix."""
    return [f"model.mtp_layers.{depth}.{n}" for n in (*layer_names, *MTP_EXTRA)]


def add_mtp_layers(model_dir: str | Path, depths: int = 1, seed: int = 0, std: float = 0.08) -> Path:
    """Turn a tiny Qwen2 directory into MiMo layout in place: random MTP layers (norms at 1)."""
    model_dir = Path(model_dir)
    weights_file = model_dir / "model.safetensors"
    tensors = load_file(str(weights_file))
    prefix = "model.layers.0."
    layer = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    gen = torch.Generator().manual_seed(seed)
    for d in range(depths):
        for name, like in layer.items():
            full = f"model.mtp_layers.{d}.{name}"
            tensors[full] = (torch.randn(like.shape, generator=gen) * std).to(like.dtype) if like.dim() >= 2 \
                else torch.ones_like(like) if "norm" in name else torch.zeros_like(like)
        for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
            tensors[f"model.mtp_layers.{d}.{norm}.weight"] = torch.ones(hidden)
        tensors[f"model.mtp_layers.{d}.input_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * std
    save_file(tensors, str(weights_file), metadata={"format": "pt"})
    cfg_file = model_dir / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["architectures"] = ["MiMoForCausalLM"]
    cfg["num_nextn_predict_layers"] = int(depths)
    cfg_file.write_text(json.dumps(cfg, indent=2))
    return model_dir


def read_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(model_dir) / "model.safetensors"))
