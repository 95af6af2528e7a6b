"""Per-token softmax statistics: the packed record every backend produces, the merge of several
records (vocab splits inside a kernel, or tensor-parallel ranks), the single collective that
exchanges them, and the final log-prob / entropy.

A record is a ``[4, N]`` fp32 tensor over the N computed tokens, for some subset of the vocabulary:

* ``m``  the max logit over the subset (``NEG_BIG`` for an empty subset),
* ``s``  ``Σ e^{z-m}``  (0 for an empty subset),
* ``w``  ``Σ e^{z-m} (z-m)``  — the entropy numerator, shifted so that it has no cancellation,
* ``t``  the target token's logit if the target is in the subset, else ``NEG_BIG``,

and, when ``Σπ²`` is asked for (:attr:`rlcore.types.HeadInput.compute_sum_pi_squared`), a fifth row

* ``q``  ``Σ e^{2(z-m)}``, so that ``Σ_v π(v)² = Q / S²`` once merged (every term ≤ 1: no overflow).

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


def empty_record(n: int, device: torch.device, rows: int = 4) -> torch.Tensor:
    """The record of an empty vocabulary subset (a rank holding only padding rows); ``rows``: 5
    with the ``q`` row."""
    rec = torch.zeros(rows, n, dtype=torch.float32, device=device)
    rec[0] = NEG_BIG
    rec[3] = NEG_BIG
    return rec


def merge_records(parts: torch.Tensor, base2: bool = False) -> torch.Tensor:
    """Merge ``[P, 4, N]`` (or ``[P, 5, N]``) records of disjoint vocabulary subsets into one.

    ``S = Σ_p s_p e^{m_p - M}``, ``W = Σ_p e^{m_p - M} (w_p + (m_p - M) s_p)`` and
    ``Q = Σ_p q_p e^{2(m_p - M)}``, where ``M = max_p m_p``; parts with ``s = 0`` (empty subsets)
    contribute nothing. ``base2`` merges records whose logits are in base-2 units (the Triton
    kernels' splits; their ``s`` and ``q`` are the same numbers in either unit).
    """
    m, s, w, t = parts[:, :4].unbind(1)
    big_m = m.max(dim=0).values
    present = s > 0
    delta = torch.where(present, m - big_m, torch.zeros_like(m))
    factor = torch.exp2(delta) if base2 else torch.exp(delta)
    factor = torch.where(present, factor, torch.zeros_like(factor))
    total_s = (s * factor).sum(dim=0)
    total_w = (factor * (w + delta * s)).sum(dim=0)
    target = t.max(dim=0).values
    merged = [big_m, total_s, total_w, target]
    if parts.shape[1] == 5:
        merged.append((parts[:, 4] * factor * factor).sum(dim=0))
    return torch.stack(merged)


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


def sum_pi_squared(record: torch.Tensor) -> torch.Tensor:
    """``Σ_v π(v)² = Q / S²`` ``[N]`` from a merged 5-row record."""
    return record[4] / (record[1] * record[1])


def finalize(record: torch.Tensor, compute_entropy: bool):
    """``(logprob, entropy, lse, mean_logit, target_missing)`` from a merged record.

    ``entropy = log S − W/S`` (clamped at 0 against rounding); ``lse = m + log S`` and
    ``mean_logit = E_p[z] = m + W/S`` are what the backward needs (all fp32 ``[N]``).
    ``target_missing`` is a 0-d bool tensor, True when some target id was in no vocabulary
    subset: left on the device so that the caller checks it with its other checks in one sync.
    """
    m, s, w, t = record[:4].unbind(0)
    log_s = torch.log(s)
    lse = m + log_s
    logprob = t - lse
    ratio = w / s
    mean_logit = m + ratio
    entropy = (log_s - ratio).clamp_min(0.0) if compute_entropy else None
    return logprob, entropy, lse, mean_logit, (t <= NEG_BIG / 2).any()
