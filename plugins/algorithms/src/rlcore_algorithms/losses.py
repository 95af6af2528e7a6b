"""rlcore-algorithms' GSPO and CISPO, each with its value and its derivative w.r.t. the token's
log-prob in closed form (the :class:`rlcore.algorithms.PolicyLoss` contract), on core's bounded
log-ratio and PPO clip branch (:mod:`rlcore.algorithms`). Notation as core's:
``r_t = exp(logp_t − old_t)``, ``A_t`` the advantage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rlcore.algorithms import bounded_log_ratio, clip_branch

#: GSPO's sequence log-ratio is clamped above at this (verl's ``compute_policy_loss_gspo``)
SEQ_LOG_RATIO_MAX = 10.0


@dataclass(frozen=True)
class GSPO:
    """Group Sequence Policy Optimization: the clipped surrogate on the sequence's
    length-normalised ratio ``s_i = exp(mean_{t∈i}(logp_t − old_t))``, in its per-token form
    (GSPO-token): ``s_{i,t} = sg[s_i]·π(y_t)/sg[π(y_t)]``, so the value of every token of
    sequence ``i`` is ``max(−A·s_i, −A·clip(s_i, 1−ε_l, 1+ε_h))`` and
    ``∂pg_t/∂logp_t = −A·s_i`` where unclipped, else 0. With ``seq-mean-token-mean``
    aggregation and one advantage per sequence this is exactly the gradient of the sequence
    objective ``(1/G)·Σ_i max(−A_i·s_i, −A_i·clip(s_i))``. ``log s_i`` is clamped above at
    :data:`SEQ_LOG_RATIO_MAX` (verl's), past which the derivative is 0.

    Source: Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071), eqs. 5-7
    (GSPO) and 11-13 (GSPO-token); clip ranges there are 3e-4 / 4e-4.
    """

    clip_low: float = 3e-4
    clip_high: float = 4e-4
    sequence_level: bool = True

    @staticmethod
    def _srl(logprobs, x, seq_log_ratio):
        if seq_log_ratio is None:
            raise ValueError("GSPO is a sequence-level loss: seq_log_ratio (the sequence's mean log-ratio) is required")
        # masked tokens (and a sequence without loss tokens) carry no ratio: 0, never garbage
        srl = seq_log_ratio.to(logprobs.device, logprobs.dtype).detach()
        return torch.where(x.mask, srl, torch.zeros_like(srl))

    def _seq_ratio(self, logprobs, x, seq_log_ratio):
        # value s_i, derivative w.r.t. logp_t equal to s_i (GSPO-token's stop-gradient form); the
        # log-ratio clamped above at SEQ_LOG_RATIO_MAX (verl's), past which the derivative is 0;
        # (lp − sg[lp]) is exactly 0, so the value is s_i to the bit in any dtype (srl + lp − lp
        # would round at |lp|'s scale: 0.125 nats in bfloat16 at lp = −50)
        lp = torch.where(x.mask, logprobs, torch.zeros_like(logprobs))
        return torch.exp((self._srl(logprobs, x, seq_log_ratio) + (lp - lp.detach())).clamp(max=SEQ_LOG_RATIO_MAX))

    def value(self, logprobs, x, seq_log_ratio=None):
        adv = x.advantages.to(logprobs.device, logprobs.dtype)
        return clip_branch(adv, self._seq_ratio(logprobs, x, seq_log_ratio), self.clip_low, self.clip_high, 0.0)[0]

    def grad(self, logprobs, x, seq_log_ratio=None):
        adv = x.advantages.to(logprobs.device, logprobs.dtype)
        srl = self._srl(logprobs, x, seq_log_ratio)
        s = torch.exp(srl.clamp(max=SEQ_LOG_RATIO_MAX))
        pg, _, flows, _ = clip_branch(adv, s, self.clip_low, self.clip_high, 0.0)
        return pg, torch.where(flows & (srl <= SEQ_LOG_RATIO_MAX) & x.mask, -adv * s, torch.zeros_like(s))

    def metrics(self, logprobs, x, seq_log_ratio=None):
        s = torch.exp(self._srl(logprobs, x, seq_log_ratio).clamp(max=SEQ_LOG_RATIO_MAX))
        clipped = s.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
        return {
            "clipfrac": (((s - clipped).abs() > 0) & x.mask).to(s.dtype),
            "ratio": s,
            "approx_kl_behaviour": -bounded_log_ratio(logprobs, x)[0],
        }


@dataclass(frozen=True)
class CISPO:
    """Clipped IS-weight Policy Optimization: REINFORCE with the importance weight clipped and
    detached, so no token's gradient is dropped: ``pg_t = −sg[clip(r, 1−ε_l, 1+ε_h)]·A·logp_t``,
    ``∂pg_t/∂logp_t = −clip(r, 1−ε_l, 1+ε_h)·A``.

    Source: MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
    Attention" (arXiv:2506.13585), eqs. 4-5 (the paper sets no lower bound, i.e. ε_l ≥ 1, and
    tunes ε_h).
    """

    clip_low: float = 1.0
    clip_high: float = 0.28
    sequence_level: bool = False

    def _weight(self, logprobs, x):
        return torch.exp(bounded_log_ratio(logprobs, x)[0]).detach().clamp(1.0 - self.clip_low, 1.0 + self.clip_high)

    def value(self, logprobs, x, seq_log_ratio=None):
        adv = x.advantages.to(logprobs.device, logprobs.dtype)
        lp = torch.where(x.mask, logprobs, torch.zeros_like(logprobs))
        return -self._weight(logprobs, x) * adv * lp

    def grad(self, logprobs, x, seq_log_ratio=None):
        adv = x.advantages.to(logprobs.device, logprobs.dtype)
        w = self._weight(logprobs, x)
        lp = torch.where(x.mask, logprobs, torch.zeros_like(logprobs))
        return -w * adv * lp, torch.where(x.mask, -w * adv, torch.zeros_like(w))

    def metrics(self, logprobs, x, seq_log_ratio=None):
        log_ratio = bounded_log_ratio(logprobs, x)[0]
        ratio = torch.exp(log_ratio)
        w = ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
        return {
            "clipfrac": (((ratio - w).abs() > 1e-6) & x.mask).to(ratio.dtype),
            "ratio": ratio,
            "approx_kl_behaviour": -log_ratio,
        }
