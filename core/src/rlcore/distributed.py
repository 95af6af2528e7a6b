"""Autograd-aware collectives for tensor-parallel heads (torch.distributed only, any backend).

The conventions are Megatron's: a loss computed identically on every tensor-parallel rank is one
loss, not ``tp`` copies, so

* :func:`reduce_from_group` sums partial statistics in forward and passes the gradient through
  unchanged in backward;
* :func:`copy_to_group` is the identity in forward and sums the (partial) gradients of its input
  over the group in backward (a hidden state used by every vocab shard);
* :func:`gather_from_sequence_parallel` all-gathers a sequence-parallel ``[T/tp, ...]`` tensor
  along dim 0 in forward and reduce-scatters the gradient in backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "all_reduce_max", "copy_to_group", "gather_from_sequence_parallel", "group_rank", "group_size",
    "reduce_from_group",
]


def group_size(group: Any) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: Any) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _GatherSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        world = dist.get_world_size(group)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        world = dist.get_world_size(ctx.group)
        chunks = [c.contiguous() for c in grad.chunk(world, dim=0)]
        out = torch.empty_like(chunks[0])
        if hasattr(dist, "reduce_scatter") and dist.get_backend(ctx.group) != "gloo":
            dist.reduce_scatter(out, chunks, group=ctx.group)
        else:  # gloo has no reduce_scatter: all-reduce and keep our chunk
            full = grad.contiguous().clone()
            dist.all_reduce(full, group=ctx.group)
            out = full.chunk(world, dim=0)[dist.get_rank(ctx.group)].contiguous()
        return out, None


def reduce_from_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    return _ReduceFromGroup.apply(x, group)


def copy_to_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    return _CopyToGroup.apply(x, group)


def gather_from_sequence_parallel(x: torch.Tensor, group: Any) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    return _GatherSequenceParallel.apply(x, group)


def all_reduce_max(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Element-wise max over the group, no gradient (softmax shifts are constants)."""
    x = x.detach().clone()
    if group_size(group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x
