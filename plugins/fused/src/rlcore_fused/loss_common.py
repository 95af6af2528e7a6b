"""What both backends share on the fused-loss path (``Cap.FUSED_LOSS``).

The head hands a backend the compacted unmasked rows and a callback ``objective(lo, hi, logp,
entropy) -> (value, d_logp, d_entropy)`` that evaluates the step's per-token objective in closed
form (:meth:`rlcore.algorithms.losses.TokenObjective.closed_form`) for compact rows ``[lo, hi)``.
A backend walks the tokens in chunks; per chunk it forms the logits once, the fp32 softmax
record, merges it over the tensor-parallel group (one all-gather of ``[4, chunk]``), calls the
objective, and turns the logits into ``∂L/∂logits`` for the dX and dW GEMMs: three GEMMs in all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

#: (lo, hi, logp [n], entropy [n]) -> (value [n], d_logp [n], d_entropy [n]), all fp32
ObjectiveFn = Callable[[int, int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass
class LossResult:
    """A backend's result over the N compacted rows: the summed loss (0-d fp32), detached
    log-probs and entropy ``[N]`` fp32, and the gradients (``dx`` ``[N, H]`` in the hidden dtype,
    ``dw`` ``[V_valid, H]`` in the weight dtype)."""

    loss: torch.Tensor
    logprobs: torch.Tensor
    entropy: torch.Tensor
    dx: torch.Tensor
    dw: torch.Tensor


def chunk_tokens_for(budget_mib: float, v: int, bytes_per_logit: int, most: int | None = None) -> int:
    """Tokens per chunk so that a ``[chunk, v]`` logits block fits ``budget_mib``."""
    n = max(1, int(float(budget_mib) * 2**20) // max(1, v * bytes_per_logit))
    return n if most is None else max(1, min(n, most))
