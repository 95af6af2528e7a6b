"""GRPO: group-normalised advantages and the PPO-clip policy loss (with optional KL and entropy
terms), aggregated so that splitting a step into micro-batches does not change the gradient."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from rlcore.batch import PackedBatch


def grpo_advantages(rewards: Sequence[float], groups: Sequence[int], normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """``(r - mean_group) / (std_group + eps)`` per sample (population std; groups of one get 0)."""
    r = torch.as_tensor(list(rewards), dtype=torch.float32)
    g = torch.as_tensor(list(groups), dtype=torch.long)
    adv = torch.zeros_like(r)
    for gid in torch.unique(g):
        sel = g == gid
        vals = r[sel]
        if vals.numel() < 2:
            continue
        centred = vals - vals.mean()
        if normalize_std:
            centred = centred / (vals.std(unbiased=False) + eps)
        adv[sel] = centred
    return adv


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL(π || π_ref) estimates from sampled tokens (Schulman's k1/k2/k3)."""
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}")


@dataclass
class StepTotals:
    """Normalisers over the whole step (all micro-batches)."""

    loss_tokens: int
    num_seqs: int


def policy_loss(
    mb: PackedBatch,
    logprobs: torch.Tensor,
    entropy: torch.Tensor | None,
    algo: Any,
    totals: StepTotals,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip loss of one micro-batch against the behaviour log-probs in ``mb.fields``.

    Returns the loss contribution of this micro-batch (already divided by the step totals) and
    per-micro-batch metric sums (weighted by this micro-batch's tokens, for exact averaging).
    """
    mask = mb.loss_mask
    m = mask.to(logprobs.dtype)
    old = mb.fields["old_logprobs"].to(logprobs.device, logprobs.dtype)
    adv = mb.fields["advantages"].to(logprobs.device, logprobs.dtype)
    log_ratio = torch.where(mask, logprobs - old, torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - algo.clip_low, 1.0 + algo.clip_high)
    per_token = torch.maximum(-adv * ratio, -adv * clipped)
    kl = None
    if ref_logprobs is not None and algo.kl_coef > 0:
        kl = kl_penalty(logprobs, ref_logprobs.to(logprobs.device), algo.kl_estimator)
        per_token = per_token + algo.kl_coef * kl
    if entropy is not None and algo.entropy_coef:
        per_token = per_token - algo.entropy_coef * entropy
    per_token = per_token * m

    if algo.loss_agg == "token-mean":
        loss = per_token.sum() / max(totals.loss_tokens, 1)
    else:
        seq_sum = mb.seq_sum(per_token)
        if algo.loss_agg == "seq-mean-token-mean":
            seq_tokens = mb.seq_sum(m).clamp_min(1.0)
            seq_sum = seq_sum / seq_tokens
        loss = seq_sum.sum() / max(totals.num_seqs, 1)

    with torch.no_grad():
        n = float(m.sum())
        clip_hit = ((ratio - clipped).abs() > 1e-6) & mask
        stats = {
            "clipfrac": float(clip_hit.sum()),
            "ratio": float((ratio * m).sum()),
            "approx_kl_behaviour": float((-log_ratio * m).sum()),
            "entropy": float((entropy * m).sum()) if entropy is not None else 0.0,
            "kl": float((kl * m).sum()) if kl is not None else 0.0,
            "_tokens": n,
        }
    return loss, stats
