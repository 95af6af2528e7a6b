"""The THD attention path without Transformer Engine: megatron-core's local layer spec with its
core attention replaced by one that runs over packed sequences.

Megatron's local ``DotProductAttention`` refuses ``PackedSeqParams``; :class:`VarlenDotProductAttention`
is that module (same constructor, same heads per tensor-parallel rank, same softmax scale) whose
forward, given ``PackedSeqParams(qkv_format="thd")``, runs :func:`rlcore.engines.varlen.varlen_attention`
over ``[T, heads, dim]`` per ``cu_seqlens``: torch's ``varlen_attn`` (Flash Attention) on CUDA
in bf16/fp16, SDPA per sequence elsewhere. Megatron's ``Attention`` has already applied RoPE per
sequence (``cu_seqlens``) and squeezed the batch dimension by then. Without ``PackedSeqParams``
it is megatron's own module.

Sequence boundaries are the padded ``cu_seqlens`` (megatron places tokens at the padded offsets
and ropes them there): a sequence's real tokens come first in its padded span, so under causal
attention they see exactly their own sequence; the padding positions after them produce values
nobody reads.
"""

from __future__ import annotations

import copy
from typing import Any

from megatron.core.transformer.dot_product_attention import DotProductAttention
from rlcore.engines.varlen import varlen_attention, varlen_backend

#: the backend name this module reports where Transformer Engine runs the THD path instead
TRANSFORMER_ENGINE = "transformer_engine"


class VarlenDotProductAttention(DotProductAttention):
    """Megatron's local core attention, plus the THD format (see the module docstring)."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs: Any):
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params, **kwargs)
        if attention_bias is not None:
            raise NotImplementedError("the THD path without Transformer Engine takes no attention bias")
        if self.training and self.attention_dropout.p > 0:
            raise NotImplementedError("the THD path without Transformer Engine applies no attention dropout")
        cu = packed_seq_params.cu_seqlens_q_padded
        if cu is None:
            cu = packed_seq_params.cu_seqlens_q
        max_len = packed_seq_params.max_seqlen_q
        if max_len is None:
            max_len = int((cu[1:] - cu[:-1]).max())
        # [T, heads, dim] in; megatron's Attention reshapes the output to [T, 1, heads * dim]
        return varlen_attention(query, key, value, cu, int(max_len), scale=self.effective_scale())

    def effective_scale(self) -> float:
        """The scale megatron's own path applies to ``q·k``: ``softmax_scale``, times the layer
        number when query-key layer scaling divided it out (its softmax multiplies it back)."""
        if self.config.apply_query_key_layer_scaling:
            return self.softmax_scale * self.layer_number
        return self.softmax_scale


def with_varlen_core_attention(block_spec: Any) -> Any:
    """A copy of a local (non-TE) decoder block spec whose layers' core attention is
    :class:`VarlenDotProductAttention`; an error if a layer's core attention is not megatron's
    local ``DotProductAttention`` (a spec this module does not know how to extend)."""
    spec = copy.deepcopy(block_spec)
    for layer in spec.layer_specs:  # layers may share one spec object: each is patched once
        attention = layer.submodules.self_attention.submodules
        if attention.core_attention not in (DotProductAttention, VarlenDotProductAttention):
            raise TypeError(f"the local layer spec's core attention is {attention.core_attention!r}, not "
                            f"megatron's DotProductAttention")
        attention.core_attention = VarlenDotProductAttention
    return spec


def thd_backend(use_te: bool, device: Any, dtype: Any) -> str:
    """Which kernel runs the THD path's attention: Transformer Engine's, or
    :func:`rlcore.engines.varlen.varlen_backend`'s for ``device`` and ``dtype``."""
    return TRANSFORMER_ENGINE if use_te else varlen_backend(device, dtype)
