"""Causal attention over packed sequences (THD: ``[T, heads, dim]`` with ``cu_seqlens``), no padding.

One function, :func:`varlen_attention`, shared by the ``hf`` engine's packed path and
rlcore-megatron's local THD core attention. Two backends compute the same thing:

* ``torch_varlen``: PyTorch's ``torch.nn.attention.varlen.varlen_attn`` (Flash Attention's
  variable-length kernel): CUDA only, fp16/bf16 only. Its keyword arguments changed between
  releases (``is_causal`` in torch 2.10; ``window_size=(-1, 0)`` from 2.11 on, ``enable_gqa`` from
  2.12 on), so the call is built from the installed signature.
* ``sdpa_per_sequence``: ``scaled_dot_product_attention`` once per sequence (causal), on any
  device and dtype: the CPU path CI tests, and fp32 on CUDA where the flash kernel has none.

:func:`varlen_backend` says which one a device and dtype get, so engines can report it.
"""

from __future__ import annotations

import inspect
from functools import lru_cache

import torch
import torch.nn.functional as F

__all__ = ["SDPA_PER_SEQUENCE", "varlen_attention", "varlen_backend"]

TORCH_VARLEN = "torch_varlen"
SDPA_PER_SEQUENCE = "sdpa_per_sequence"


@lru_cache(maxsize=1)
def _torch_varlen_params() -> frozenset[str] | None:
    """The keyword parameters of the installed ``varlen_attn``, or None when torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return frozenset(inspect.signature(varlen_attn).parameters)


def varlen_backend(device: torch.device | str, dtype: torch.dtype) -> str:
    """The backend :func:`varlen_attention` uses for tensors of this device and dtype."""
    params = _torch_varlen_params()
    causal_arg = params is not None and ("window_size" in params or "is_causal" in params)
    if torch.device(device).type == "cuda" and dtype in (torch.float16, torch.bfloat16) and causal_arg:
        return TORCH_VARLEN
    return SDPA_PER_SEQUENCE


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, scale: float | None = None) -> torch.Tensor:
    """Causal self-attention of each sequence ``[cu_seqlens[i], cu_seqlens[i+1])`` over itself.

    ``query`` ``[T, Hq, D]``, ``key``/``value`` ``[T, Hkv, D]`` (``Hq`` a multiple of ``Hkv``:
    grouped-query attention); ``cu_seqlens`` ``[B + 1]`` int32 with ``cu_seqlens[-1] == T``;
    ``scale`` defaults to ``1/sqrt(D)``. Returns ``[T, Hq, D]``."""
    if varlen_backend(query.device, query.dtype) == TORCH_VARLEN:
        return _torch_varlen(query, key, value, cu_seqlens, max_seqlen, scale)
    return _sdpa_per_sequence(query, key, value, cu_seqlens, scale)


def _torch_varlen(query, key, value, cu_seqlens, max_seqlen, scale):
    from torch.nn.attention.varlen import varlen_attn

    params = _torch_varlen_params()
    kwargs: dict = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)  # causal
    else:
        kwargs["is_causal"] = True
    if scale is not None:
        if "scale" not in params:
            if abs(scale - query.shape[-1] ** -0.5) > 1e-12:
                raise NotImplementedError(f"this torch's varlen_attn has no scale argument; the model asks {scale}")
        else:
            kwargs["scale"] = scale
    if key.shape[1] != query.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:  # each key/value head serves a group of query heads
            group = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    cu = cu_seqlens.to(device=query.device, dtype=torch.int32)
    return varlen_attn(query, key, value, cu, cu, int(max_seqlen), int(max_seqlen), **kwargs)


def _sdpa_per_sequence(query, key, value, cu_seqlens, scale):
    bounds = cu_seqlens.tolist()
    group = query.shape[1] // key.shape[1]
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        # [H, L, D] per sequence: its own causal attention, nothing from its neighbours
        q = query[start:end].transpose(0, 1)
        k = key[start:end].transpose(0, 1)
        v = value[start:end].transpose(0, 1)
        if group > 1:
            k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(outs, 0) if outs else query.new_zeros(query.shape)
