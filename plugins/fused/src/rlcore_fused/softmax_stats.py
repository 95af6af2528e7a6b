"""Per-token softmax statistics: the packed record every backend produces, the merge of several
records (vocab splits inside a kernel, or tensor-parallel ranks), the single collective that
exchanges them, and the final log-prob / entropy.

A record is a ``[4, N]`` fp32 tensor over the N computed tokens, for some subset of the vocabulary:

* ``m``  the max logit over the subset (``NEG_BIG`` for an empty subset),
* ``s``  ``Σ e^{z-m}``  (0 for an empty subset),
* ``w``  ``Σ e^{z-m} (z-m)``  — the entropy numerator, shifted so that it has no cancellation,
* ``t``  the target token's logit if the target is in the subset, else ``NEG_BIG``.

Merging needs only a max-rescale, so one all-gather of the ``[4, N]`` record is the whole
tensor-parallel exchange (not per-split maxima, not separate MAX and SUM all-reduces).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from rlcore.distributed import group_size

#: a finite stand-in for -inf: exp of it underflows to 0, and 0·(it) is 0, not NaN
NEG_BIG = -1.0e30
LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)


def empty_record(n: int, device: torch.device) -> torch.Tensor:
    """The record of an empty vocabulary subset (a rank holding only padding rows)."""
    rec = torch.zeros(4, n, dtype=torch.float32, device=device)
    rec[0] = NEG_BIG
    rec[3] = NEG_BIG
    return rec


def merge_records(parts: torch.Tensor, base2: bool = False) -> torch.Tensor:
    """Merge ``[P, 4, N]`` records of disjoint vocabulary subsets into one ``[4, N]`` record.

    ``S = Σ_p s_p e^{m_p - M}`` and ``W = Σ_p e^{m_p - M} (w_p + (m_p - M) s_p)``, where
    ``M = max_p m_p``; parts with ``s = 0`` (empty subsets) contribute nothing. ``base2`` merges
    records whose logits are in base-2 units (the Triton kernels' splits).
    """
    m, s, w, t = parts.unbind(1)
    big_m = m.max(dim=0).values
    present = s > 0
    delta = torch.where(present, m - big_m, torch.zeros_like(m))
    factor = torch.exp2(delta) if base2 else torch.exp(delta)
    factor = torch.where(present, factor, torch.zeros_like(factor))
    total_s = (s * factor).sum(dim=0)
    total_w = (factor * (w + delta * s)).sum(dim=0)
    target = t.max(dim=0).values
    return torch.stack([big_m, total_s, total_w, target])


def exchange_records(local: torch.Tensor, group: Any) -> torch.Tensor:
    """Combine the ranks' records of a vocab-sharded head: one all-gather of ``[4, N]`` fp32."""
    world = group_size(group)
    if world == 1:
        return local
    local = local.contiguous()
    if dist.get_backend(group) == "gloo":
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local, group=group)
        gathered = torch.stack(parts)
    else:
        gathered = torch.empty((world, *local.shape), dtype=local.dtype, device=local.device)
        dist.all_gather_into_tensor(gathered, local, group=group)
    return merge_records(gathered)


def finalize(record: torch.Tensor, compute_entropy: bool):
    """``(logprob, entropy, lse, mean_logit, target_missing)`` from a merged record.

    ``entropy = log S − W/S`` (clamped at 0 against rounding); ``lse = m + log S`` and
    ``mean_logit = E_p[z] = m + W/S`` are what the backward needs (all fp32 ``[N]``).
    ``target_missing`` is a 0-d bool tensor, True when some target id was in no vocabulary
    subset: left on the device so that the caller checks it with its other checks in one sync.
    """
    m, s, w, t = record.unbind(0)
    log_s = torch.log(s)
    lse = m + log_s
    logprob = t - lse
    ratio = w / s
    mean_logit = m + ratio
    entropy = (log_s - ratio).clamp_min(0.0) if compute_entropy else None
    return logprob, entropy, lse, mean_logit, (t <= NEG_BIG / 2).any()
