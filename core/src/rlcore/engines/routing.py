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
from typing import TypeVar

import torch

from rlcore.errors import BatchShapeError
from rlcore.types import RouterDecision

__all__ = ["apply_router_decision", "forward_state_of_router_call", "in_backward"]

_State = TypeVar("_State")


def in_backward() -> bool:
    """True while autograd runs a backward pass (activation recomputation re-runs routers there)."""
    return bool(torch._C._current_graph_task_id() != -1)


def forward_state_of_router_call(live: _State | None, last: _State | None, *, routed_index: int,
                                 layer: int) -> tuple[_State | None, bool]:
    """Which forward a router call belongs to, and whether it is a recomputation: ``live`` (the
    seam's state during a forward) when set; else, inside a backward, ``last`` (the last forward
    with a dispatcher: activation recomputation re-runs its routers), counted in its
    ``recomputed`` dict — a second recomputation of one router for one forward is an error; else
    ``(None, False)``: the router runs outside any seam forward and routes natively."""
    if live is not None:
        return live, False
    if last is None or not in_backward():
        return None, False
    recomputed: dict[int, int] = last.recomputed  # type: ignore[attr-defined]
    recomputed[routed_index] = recomputed.get(routed_index, 0) + 1
    if recomputed[routed_index] > 1:
        raise BatchShapeError(f"MoE router of layer {layer} was recomputed twice for one forward")
    return last, True


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
