"""What every engine's router seam does with a ``router_hook`` answer, in one place.

An engine asks the ``router_hook`` chain for the experts of one router (a
:class:`~rlcore.types.RouterCall`) and gets a :class:`~rlcore.types.RouterDecision` or None.
:func:`apply_router_decision` validates the answer (integer ``[num_tokens, topk]``), maps it from
packed token order to the router's own rows, keeps the native choice on rows with a negative index,
and checks the result (every expert in ``[0, num_experts)``, none twice for one token: a duplicate
collapses in the routing map and silently changes the token's expert weights).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlcore.errors import BatchShapeError
from rlcore.types import RouterDecision


def apply_router_decision(
    decision: RouterDecision,
    native_indices: torch.Tensor,
    *,
    layer: int,
    num_experts: int,
    topk: int,
    num_tokens: int,
    to_rows: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The experts a router must use, ``[rows, topk]`` long, from the hook's ``decision`` and the
    router's own ``native_indices`` ``[rows, topk]``; ``to_rows`` maps packed ``[num_tokens, ...]``
    to router rows. Raises :class:`BatchShapeError` naming the layer when the answer is unusable."""
    forced = torch.as_tensor(decision.indices)
    if tuple(forced.shape) != (num_tokens, topk) or forced.is_floating_point():
        raise BatchShapeError(
            f"router_hook for layer {layer} returned indices {tuple(forced.shape)} "
            f"{forced.dtype}, expected integer [num_tokens={num_tokens}, topk={topk}]"
        )
    rows = to_rows(forced.to(native_indices.device, torch.long))
    native = (rows < 0).any(dim=-1, keepdim=True)
    indices = torch.where(native, native_indices, rows)
    _check_experts(indices, layer=layer, num_experts=num_experts, topk=topk)
    return indices


def _check_experts(indices: torch.Tensor, *, layer: int, num_experts: int, topk: int) -> None:
    if indices.numel() == 0:
        return
    if int(indices.min()) < 0 or int(indices.max()) >= num_experts:
        raise BatchShapeError(
            f"router_hook for layer {layer} chose experts outside [0, {num_experts}): "
            f"{indices[(indices < 0) | (indices >= num_experts)][:4].tolist()}"
        )
    if topk > 1:
        s = indices.sort(dim=-1).values
        dup = (s[:, 1:] == s[:, :-1]).any(dim=-1)
        if bool(dup.any()):
            row = int(dup.nonzero()[0, 0])
            raise BatchShapeError(
                f"router_hook for layer {layer} chose an expert twice for one token "
                f"(router row {row}: {indices[row].tolist()}); each token needs {topk} distinct experts"
            )
