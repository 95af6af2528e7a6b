"""HF checkpoint names for a transformers model's parameters.

transformers v5 keeps MoE experts fused in memory (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``,
``mlp.experts.down_proj`` ``[E, H, I]``) but checkpoints — and vLLM's and SGLang's
``load_weights`` — use one tensor per expert (``mlp.experts.{e}.gate_proj.weight`` ...).
:func:`checkpoint_tensors` gives every parameter under its checkpoint name as a *view* of the
live parameter: reading it exports, copying into it loads.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from rlcore.errors import RLCoreError

__all__ = ["checkpoint_tensors"]

# model_type -> per-expert names of (gate, up, down) in checkpoints
_EXPERT_NAMES = {
    "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
    "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
    "qwen3_next": ("gate_proj", "up_proj", "down_proj"),
    "olmoe": ("gate_proj", "up_proj", "down_proj"),
    "mixtral": ("w1", "w3", "w2"),
}

# model_type -> (in-memory module name, checkpoint module name) of the MoE block: transformers v5
# renames Mixtral's ``block_sparse_moe`` to ``mlp`` on load (router included)
_MOE_BLOCK_NAMES = {
    "mixtral": (".mlp.", ".block_sparse_moe."),
}


def _checkpoint_name(model_type: str, name: str) -> str:
    rename = _MOE_BLOCK_NAMES.get(model_type)
    if rename is not None and rename[0] in name:
        return name.replace(rename[0], rename[1], 1)
    return name


def checkpoint_tensors(model: Any) -> Iterator[tuple[str, Any]]:
    """``(checkpoint_name, view)`` for every parameter (tied weights once)."""
    model_type = getattr(model.config, "model_type", "")
    for pname, p in model.named_parameters():
        name = _checkpoint_name(model_type, pname)
        if name.endswith("experts.gate_up_proj") and p.dim() == 3:
            gate, up, _ = _names_for(model_type, name)
            prefix = name[: -len("gate_up_proj")]
            inter = p.shape[1] // 2
            for e in range(p.shape[0]):
                yield f"{prefix}{e}.{gate}.weight", p[e, :inter]
                yield f"{prefix}{e}.{up}.weight", p[e, inter:]
        elif name.endswith("experts.down_proj") and p.dim() == 3:
            _, _, down = _names_for(model_type, name)
            prefix = name[: -len("down_proj")]
            for e in range(p.shape[0]):
                yield f"{prefix}{e}.{down}.weight", p[e]
        else:
            yield name, p


def checkpoint_views(model: Any) -> dict[str, Any]:
    return dict(checkpoint_tensors(model))


def _names_for(model_type: str, pname: str) -> tuple[str, str, str]:
    names = _EXPERT_NAMES.get(model_type)
    if names is None:
        raise RLCoreError(
            f"rlcore does not know the checkpoint names of fused experts {pname!r} for model type "
            f"{model_type!r}; supported: {', '.join(sorted(_EXPERT_NAMES))}"
        )
    return names
