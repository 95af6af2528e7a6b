"""MiMo's MTP checkpoint names (``model.mtp_layers.{d}.*``), as vLLM's ``MiMoMTP`` loads them.

Temporary home: these move to core's MiMo layout module (rlcore-mtp work) and this module then
re-exports them from there.
"""

from __future__ import annotations

MIMO_MTP_ROOT = "model.mtp_layers."
MIMO_TOKEN_NORM = "token_layernorm.weight"
MIMO_HIDDEN_NORM = "hidden_layernorm.weight"
MIMO_INPUT_PROJ = "input_proj.weight"
MIMO_FINAL_NORM = "final_layernorm.weight"
MIMO_ARCHITECTURE = "MiMoForCausalLM"


def mimo_mtp_prefix(depth: int) -> str:
    """``model.mtp_layers.{depth}.`` (depth 0-based): the decoder block's tensors follow under
    their usual names (``self_attn.q_proj.weight``, ``mlp.gate_proj.weight``, ...)."""
    return f"{MIMO_MTP_ROOT}{depth}."
