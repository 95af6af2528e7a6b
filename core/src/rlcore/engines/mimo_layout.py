"""MiMo's multi-token-prediction (MTP) layout: the one place that names it (no torch import).

A MiMo checkpoint is a Qwen2 model plus ``num_nextn_predict_layers`` MTP layers under
``model.mtp_layers.{d}.*`` (``d`` from 0), with ``architectures: ["MiMoForCausalLM"]`` in
config.json. Read from vLLM's ``vllm/model_executor/models/mimo.py`` and ``mimo_mtp.py`` (the
loader vLLM serves it with); the HF engine's :mod:`rlcore.engines.mimo` builds this layout and
rlcore-megatron exports to it.

One MTP layer ``d`` (what vLLM's ``MiMoMultiTokenPredictorLayer`` computes):

* ``token_layernorm`` (RMSNorm) over the token embedding, which is **zeroed where the position
  id is 0**; ``hidden_layernorm`` (RMSNorm) over the previous hidden state;
* ``input_proj`` (``[H, 2H]``, no bias) over ``cat([hidden_layernorm(h), token_layernorm(e)])``
  — **hidden state first, embedding second** (megatron's ``eh_proj`` takes
  ``[enorm(e), hnorm(h)]``: an export swaps the two column halves);
* one Qwen2 decoder block whose tensors sit directly under ``model.mtp_layers.{d}.`` (vLLM
  inserts ``mtp_block.`` itself when loading: a checkpoint must not contain it);
* ``final_layernorm`` (RMSNorm); its output goes through the shared LM head. Embedding and LM
  head are the main model's (``model.embed_tokens``, ``lm_head``); the MTP layers own no copy.

Semantics (DeepSeek-V3 §2.2 / megatron-core MTP, with MiMo's inputs):

* depth ``k`` (1-based; layer ``k - 1``) at position ``t`` of a sequence takes
  ``h^{k-1}_t`` and the embedding of token ``t + k`` and predicts token ``t + k + 1``;
  ``h^0`` is the trunk's last hidden state **before** the final norm (vLLM's ``MiMoModel``
  returns it un-normed and applies ``model.norm`` only for the main logits; megatron feeds the
  post-``final_layernorm`` decoder output instead), ``h^k`` (k >= 1) is layer ``k - 1``'s
  output after its ``final_layernorm``;
* the block's rotary positions are ``t``'s own position ids at every depth;
* everything stays inside one sequence: the token ``t + k`` comes from the same sequence, and
  where it does not exist the embedding is zero and the position carries no label.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["ARCHITECTURE", "NUM_LAYERS_KEY", "tensor_names"]

ARCHITECTURE = "MiMoForCausalLM"
#: config.json key holding the number of MTP layers (the DeepSeek-V3 name MiMo uses)
NUM_LAYERS_KEY = "num_nextn_predict_layers"
PREFIX = "model.mtp_layers."
#: the MTP layer's own tensors, around the decoder block
OWN_TENSORS = (
    "token_layernorm.weight",
    "hidden_layernorm.weight",
    "input_proj.weight",
    "final_layernorm.weight",
)
#: the Qwen2 decoder block's tensors (directly under ``model.mtp_layers.{d}.``)
BLOCK_TENSORS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.q_proj.bias",
    "self_attn.k_proj.weight",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.weight",
    "self_attn.v_proj.bias",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
#: main-model tensors the MTP draft also reads (shared, never duplicated under ``PREFIX``)
SHARED_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")
#: order of the two halves of ``input_proj``'s input (columns ``[0, H)`` then ``[H, 2H)``)
INPUT_PROJ_ORDER = ("hidden", "embedding")

_NAME_RE = re.compile(r"^model\.mtp_layers\.(\d+)\.(.+)$")


def layer_prefix(layer: int) -> str:
    """``model.mtp_layers.{layer}.`` (``layer`` from 0; MTP depth ``layer + 1``)."""
    return f"{PREFIX}{int(layer)}."


def tensor_names(num_layers: int) -> list[str]:
    """Every checkpoint name of ``num_layers`` MTP layers, layer by layer."""
    return [layer_prefix(d) + t for d in range(int(num_layers)) for t in (*OWN_TENSORS, *BLOCK_TENSORS)]


def is_mtp_name(name: str) -> bool:
    return name.startswith(PREFIX)


def split_name(name: str) -> tuple[int, str] | None:
    """``(layer, rest)`` for ``model.mtp_layers.{layer}.{rest}``, else None."""
    m = _NAME_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def tensor_shapes(hidden: int, intermediate: int, num_heads: int, num_kv_heads: int,
                  head_dim: int) -> dict[str, tuple[int, ...]]:
    """Shape of each per-layer tensor (keys as in :data:`OWN_TENSORS` + :data:`BLOCK_TENSORS`)."""
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    return {
        "token_layernorm.weight": (hidden,),
        "hidden_layernorm.weight": (hidden,),
        "input_proj.weight": (hidden, 2 * hidden),
        "final_layernorm.weight": (hidden,),
        "input_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q, hidden),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.weight": (kv, hidden),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (hidden, q),
        "post_attention_layernorm.weight": (hidden,),
        "mlp.gate_proj.weight": (intermediate, hidden),
        "mlp.up_proj.weight": (intermediate, hidden),
        "mlp.down_proj.weight": (hidden, intermediate),
    }


def num_layers_in(config: object) -> int:
    """MTP layers a transformers config (or a config.json dict) declares (0 when none)."""
    value = config.get(NUM_LAYERS_KEY) if isinstance(config, dict) else getattr(config, NUM_LAYERS_KEY, None)
    return int(value or 0)


def missing_names(names: Iterable[str], num_layers: int) -> list[str]:
    """The MTP checkpoint names of ``num_layers`` layers absent from ``names``."""
    have = set(names)
    return [n for n in tensor_names(num_layers) if n not in have]
