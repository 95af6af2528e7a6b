"""Routed experts as a rollout engine returns them, decoded to ``Sample.routed_experts``.

Engines that return routed experts (R3) give, per sample, the experts every MoE layer chose for
every token that went through a forward pass: ``[prompt + response - 1, num_hidden_layers, topk]``
(the last sampled token never ran). They arrive as an array (vLLM's offline ``LLM``), as the
base64 of the array's ``.npy`` bytes (vLLM's OpenAI server), or as the base64 of raw little-endian
int32 rows (SGLang). :func:`decode_routed_experts` reads all three and returns rlcore's route
tensor: int16 ``[rows, layers, topk]``, ``-1`` where a token has no route.

Every malformed answer (missing, not base64, wrong dtype, shape, row count or expert id) raises
:class:`~rlcore.errors.RolloutError` saying what arrived and what was expected: routes are never
dropped or reshaped silently.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlcore.errors import RolloutError

if TYPE_CHECKING:  # pragma: no cover - annotations only
    import torch

#: integer dtypes an engine may send routes in (vLLM: uint8 up to 256 experts, else uint16)
ROUTE_DTYPES = ("uint8", "uint16", "int16", "int32", "int64")
#: how a base64 route string is packed
PACKINGS = ("npy", "int32")
_INT16_MAX = 32767
_NPY_MAGIC = b"\x93NUMPY"


@dataclass(frozen=True)
class MoEShape:
    """What a model's routes look like: ``layers`` rows of ``topk`` experts out of ``num_experts``
    (None when the config does not say)."""

    layers: int
    topk: int
    num_experts: int | None = None


def moe_shape(config: Mapping[str, Any]) -> MoEShape | None:
    """The route shape of an HF ``config.json`` (its ``text_config`` for a multimodal model, as the
    engines read it), or None for a dense model."""
    text = config.get("text_config") or config
    topk = text.get("num_experts_per_tok")
    if not topk:
        return None
    experts = next((text[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if text.get(k)), None)
    return MoEShape(int(text["num_hidden_layers"]), int(topk), None if experts is None else int(experts))


def decode_routed_experts(value: Any, *, rows: int, layers: int | None = None, topk: int | None = None,
                          num_experts: int | None = None, packing: str = "npy",
                          source: str = "the rollout engine") -> torch.Tensor:
    """rlcore's int16 ``[rows, layers, topk]`` routes from what an engine returned.

    :param value: an array (NumPy, torch, nested lists), or a base64 string packed as ``packing``:
        ``npy`` (an ``.npy`` file) or ``int32`` (raw little-endian int32 rows; needs ``layers``
        and ``topk``).
    :param rows: the expected row count, ``prompt + response - 1``.
    :param layers, topk, num_experts: checked when given.
    :param source: names the answer in errors (``"SGLang's answer for prompt 3"``).
    :raises RolloutError: naming what arrived and what was expected.
    """
    import numpy as np
    import torch

    def fail(what: str) -> RolloutError:
        return RolloutError(f"routed experts from {source}: {what}")

    expected = f"[{rows}, {layers if layers is not None else 'layers'}, {topk if topk is not None else 'topk'}]"
    if value is None:
        raise fail(f"none were returned although they were asked for (expected {expected} expert ids)")
    if packing not in PACKINGS:
        raise ValueError(f"packing must be one of {PACKINGS}, not {packing!r}")
    if isinstance(value, (str, bytes, bytearray)):
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise fail(f"not valid base64 ({exc}); expected the base64 of {packing} routes {expected}") from None
        if packing == "npy":
            if not raw.startswith(_NPY_MAGIC):  # np.load would try to unpickle it, and say so
                raise fail(f"the base64 does not hold an .npy array (no .npy header); expected {expected}")
            try:
                arr = np.load(io.BytesIO(raw), allow_pickle=False)
            except (ValueError, OSError, EOFError) as exc:
                raise fail(f"the base64 does not hold an .npy array ({exc}); expected {expected}") from None
        else:
            if layers is None or topk is None or layers <= 0 or topk <= 0:
                raise ValueError("int32-packed routes need positive layers and topk to be reshaped")
            per_row = layers * topk * 4
            if len(raw) % per_row:
                raise fail(f"{len(raw)} bytes are not a whole number of [{layers} layers x {topk}] int32 rows "
                           f"(expected {rows * per_row} bytes for {expected})")
            arr = np.frombuffer(raw, dtype="<i4").reshape(len(raw) // per_row, layers, topk)
    elif isinstance(value, torch.Tensor):
        arr = value.detach().cpu().numpy()
    else:
        try:
            arr = np.asarray(value)
        except (ValueError, TypeError) as exc:
            raise fail(f"not an array ({exc}); expected {expected} expert ids") from None
    if arr.dtype.name not in ROUTE_DTYPES:
        raise fail(f"dtype {arr.dtype} (expected an integer dtype: {', '.join(ROUTE_DTYPES)})")
    if arr.ndim != 3:
        raise fail(f"shape {tuple(arr.shape)} (expected {expected}: tokens, layers, topk)")
    if arr.shape[0] != rows:
        raise fail(f"{arr.shape[0]} rows (expected {rows}: every token of prompt + response but the last)")
    if layers is not None and arr.shape[1] != layers:
        raise fail(f"{arr.shape[1]} layers (the model has {layers})")
    if topk is not None and arr.shape[2] != topk:
        raise fail(f"top-k {arr.shape[2]} (the model routes each token to {topk} experts)")
    if arr.size:
        low, high = int(arr.min()), int(arr.max())
        limit = num_experts if num_experts is not None else _INT16_MAX + 1
        if low < -1 or high >= limit:
            bad = low if low < -1 else high
            raise fail(f"expert id {bad} (expected ids in [0, {limit}), or -1 for a token without a route)")
    return torch.from_numpy(arr.astype(np.int16, copy=True))
