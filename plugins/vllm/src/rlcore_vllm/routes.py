"""Routed experts as vLLM returns them, decoded to rlcore's ``Sample.routed_experts``.

vLLM (``enable_return_routed_experts``) gives, per completion, the experts every MoE layer chose
for every token that went through a forward pass: ``[prompt + response - 1, num_hidden_layers,
top_k]`` (the last sampled token never ran), ``uint8`` with at most 256 experts, else ``uint16``.
Offline it is a NumPy array (``CompletionOutput.routed_experts``); over the OpenAI server it is
the base64 of the array's ``.npy`` bytes (``choices[i].routed_experts``).
"""

from __future__ import annotations

import base64
import io
from typing import Any

ROUTE_DTYPES = ("uint8", "uint16", "int16", "int32", "int64")


def decode_routed_experts(value: Any, num_tokens: int, num_layers: int | None = None,
                          topk: int | None = None) -> Any:
    """``[num_tokens - 1, layers, topk]`` int16 tensor from vLLM's array or base64 ``.npy`` string.

    :param num_tokens: prompt + response length of the sample; the route rows must be one fewer.
    :raises ValueError: on a shape or dtype that does not match (never silently reshaped).
    """
    import numpy as np
    import torch

    if value is None:
        return None
    if isinstance(value, (str, bytes)):
        raw = base64.b64decode(value)
        arr = np.load(io.BytesIO(raw), allow_pickle=False)
    else:
        arr = np.asarray(value)
    if arr.dtype.name not in ROUTE_DTYPES:
        raise ValueError(f"routed experts of dtype {arr.dtype} (expected one of {', '.join(ROUTE_DTYPES)})")
    if arr.ndim != 3:
        raise ValueError(f"routed experts must be [tokens, layers, topk], got shape {arr.shape}")
    if arr.shape[0] != num_tokens - 1:
        raise ValueError(f"routed experts have {arr.shape[0]} rows for a sample of {num_tokens} tokens "
                         f"(expected {num_tokens - 1}: every token but the last)")
    if num_layers is not None and arr.shape[1] != num_layers:
        raise ValueError(f"routed experts have {arr.shape[1]} layers, the model has {num_layers}")
    if topk is not None and arr.shape[2] != topk:
        raise ValueError(f"routed experts have top-k {arr.shape[2]}, the model routes to {topk}")
    if arr.dtype.name in ("uint16", "int32", "int64") and arr.size and int(arr.max()) > 32767:
        raise ValueError(f"expert index {int(arr.max())} does not fit rlcore's int16 routes")
    return torch.from_numpy(arr.astype(np.int16, copy=True))
