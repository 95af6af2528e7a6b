"""The MTP loss and its per-depth metrics, through the run's selected forward_fn.

Depth ``d`` (1-based) at position ``t`` predicts token ``t + d + 1`` of the same sequence (see
:mod:`rlcore.engines.mimo_layout`). Its labels are ``batch.roll(input_ids, -(d + 1))`` and its
mask ``batch.roll(loss_mask, -d)`` — core's packed-aware roll, so a label is never taken from
the next sequence, and a position counts only if the token it predicts is a trained (response)
token. The log-probs come from ``output.forward_fn`` (``reference``, or ``fused``'s Triton head
under ``plugins: [fused, mtp]``) at temperature 1; the loss is their negative sum.

The acceptance proxy of depth ``d`` is the fraction of its valid positions whose argmax equals
the label (megatron-core 0.19's ``mtp_k_acceptance_rate``): what greedy speculative decoding
with that depth as the draft would accept. It is a metric, computed without gradients, in
chunks, and combined over vocabulary shards when the head is tensor-parallel.
"""

from __future__ import annotations

from typing import Any

import torch
from rlcore.errors import ConfigError, RLCoreError
from rlcore.types import HeadInput, PostprocessResult

ARGMAX_CHUNK = 4096


def depth_targets(batch: Any, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(labels, mask)`` ``[T]`` of MTP depth ``depth`` (1-based), inside each sequence."""
    labels = batch.roll(batch.input_ids, -(depth + 1), fill=batch.pad_id)
    mask = batch.roll(batch.loss_mask, -depth, fill=False)
    return labels, mask


@torch.no_grad()
def argmax_hits(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor,
                vocab: Any, sequence_parallel: bool = False) -> torch.Tensor:
    """``[T]`` bool: the label is the argmax of the logits (ties count as a hit), at masked-in
    positions. Vocab shards are combined over ``vocab.group``; sequence-parallel hidden states
    are gathered over it first."""
    group = vocab.group
    if sequence_parallel and group is not None:
        import torch.distributed as dist

        parts = [torch.empty_like(hidden) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, hidden.contiguous(), group=group)
        hidden = torch.cat(parts, 0)
    T = labels.shape[0]
    top = torch.full((T,), float("-inf"), device=hidden.device)
    own = torch.zeros(T, device=hidden.device)
    w = weight[: vocab.valid_rows].float()
    local = labels - vocab.start
    mine = (local >= 0) & (local < vocab.valid_rows)
    for s in range(0, T, ARGMAX_CHUNK):
        logits = hidden[s: s + ARGMAX_CHUNK].float() @ w.T
        top[s: s + ARGMAX_CHUNK] = logits.max(dim=1).values
        idx = local[s: s + ARGMAX_CHUNK].clamp(0, max(vocab.valid_rows - 1, 0))
        got = logits.gather(1, idx[:, None]).squeeze(1)
        own[s: s + ARGMAX_CHUNK] = torch.where(mine[s: s + ARGMAX_CHUNK], got, torch.zeros_like(got))
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(own, op=dist.ReduceOp.SUM, group=group)
    return (own >= top) & mask


def mtp_postprocess(ctx: Any, output: Any, settings: Any) -> PostprocessResult:
    """The MTP loss term (``loss_terms["mtp"]``, this micro-batch's share of the step's) and the
    per-depth metrics of one train-phase micro-batch: what the plugin's ``postprocess`` returns.

    ``ctx`` needs ``batch`` (a :class:`~rlcore.batch.PackedBatch`) and ``num_tokens_in_step``;
    ``output`` is a :class:`~rlcore.types.ModelOutput` whose ``engine.mtp_hidden`` holds one
    ``[T, H]`` tensor per MTP depth; ``settings`` has the ``mtp:`` section's ``loss_scale``,
    ``detach_head`` and ``depths`` (0 = every depth the engine returned)."""
    mtp_hidden = output.engine.mtp_hidden
    if mtp_hidden is None:
        raise RLCoreError(
            "mtp: the engine returned no MTP hidden states in the train pass although the mtp plugin asked for "
            "them (ForwardRequest.mtp_hidden); the engine ignored the request")
    have = len(mtp_hidden)
    depths = int(settings.depths) or have
    if depths > have:
        raise ConfigError(f"mtp.depths={depths} but the engine's model has {have} MTP layers", key="mtp.depths")
    batch = ctx.batch
    hw = output.head_weight
    weight = hw.weight.detach() if settings.detach_head else hw.weight
    divisor = max(int(ctx.num_tokens_in_step), 1)
    scale = float(settings.loss_scale) / depths
    total = None
    metrics: dict[str, float] = {}
    for d in range(1, depths + 1):
        hidden = mtp_hidden[d - 1]
        labels, mask = depth_targets(batch, d)
        head = output.forward_fn(HeadInput(
            hidden=hidden, weight=weight, labels=labels, vocab=hw.vocab, loss_mask=mask, temperature=1.0,
            sequence_parallel=bool(output.engine.sequence_parallel), compute_entropy=False, loss=None,
        ))
        lp = head.logprobs
        n = int(mask.sum())
        ce_sum = -(lp * mask.to(lp.dtype)).sum()
        total = ce_sum if total is None else total + ce_sum
        if n:
            metrics[f"mtp/loss_d{d}"] = float(ce_sum.detach()) / n
            hits = argmax_hits(hidden, hw.weight, labels, mask, hw.vocab, bool(output.engine.sequence_parallel))
            metrics[f"mtp/acceptance_d{d}"] = float(hits.sum()) / n
    assert total is not None
    return PostprocessResult(loss_terms={"mtp": total * (scale / divisor)}, metrics=metrics)
