"""Aggregation: how per-token loss values become the step's loss.

Every mode is a per-token weight ``w_t = numerator_t / divisor`` computed once per step, from
the whole step's loss mask, before any forward. A micro-batch's loss is
``Σ_{t∈mb} numerator_t·ℓ_t / divisor``, so the sum over micro-batches is the step's loss
whatever the split (and, with the divisor taken over all data-parallel ranks, whatever the
sharding).

==========================  =====================  ==============================================
mode                        numerator_t            divisor
==========================  =====================  ==============================================
token-mean                  1                      loss tokens in the step
token-sum                   1                      1
seq-mean-token-sum          1                      sequences in the step
seq-mean-token-mean         1 / tokens of its seq  sequences in the step
seq-mean-token-sum-norm     1                      sequences · ``norm_tokens`` (a constant)
==========================  =====================  ==============================================

(numerators are zero on masked tokens). seq-mean-token-sum-norm is Dr.GRPO's: Liu et al. 2025,
"Understanding R1-Zero-Like Training: A Critical Perspective", eq. 3 and its code, which divide
each sequence's token sum by the generation budget (a constant) instead of its length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlcore.algorithms.spec import LOSS_AGGREGATIONS


@dataclass
class StepWeights:
    """``numerator`` ``[T]`` over the step's token axis and the step's ``divisor``."""

    numerator: torch.Tensor
    divisor: float

    @property
    def weights(self) -> torch.Tensor:
        return self.numerator / self.divisor


def step_weights(mode: str, mask: torch.Tensor, seq_index: torch.Tensor, num_seqs: int,
                 norm_tokens: int = 0) -> StepWeights:
    """The aggregation weights of one step (``mask`` and ``seq_index`` over its token axis)."""
    m = mask.to(torch.float32)
    if mode == "token-mean":
        return StepWeights(m, float(max(int(mask.sum()), 1)))
    if mode == "token-sum":
        return StepWeights(m, 1.0)
    if mode == "seq-mean-token-sum":
        return StepWeights(m, float(max(num_seqs, 1)))
    if mode == "seq-mean-token-mean":
        per_seq = torch.zeros(num_seqs, dtype=m.dtype, device=m.device).index_add_(0, seq_index, m).clamp_min(1.0)
        return StepWeights(m / per_seq[seq_index], float(max(num_seqs, 1)))
    if mode == "seq-mean-token-sum-norm":
        if norm_tokens < 1:
            raise ValueError("seq-mean-token-sum-norm needs norm_tokens >= 1 (a constant generation budget)")
        return StepWeights(m, float(max(num_seqs, 1) * norm_tokens))
    raise ValueError(f"unknown loss aggregation {mode!r}; choose one of: {', '.join(LOSS_AGGREGATIONS)}")
