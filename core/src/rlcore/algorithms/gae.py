"""PPO's critic side: generalised advantage estimation, the clipped value loss, and the
explained variance, in verl's definitions (``verl.trainer.ppo.core_algos``:
``compute_gae_advantage_return``, ``compute_value_loss``; ``verl.utils.torch_functional.masked_whiten``).

Token level, over response tokens only: ``V_t`` is the critic's value at the position that
predicts response token ``t`` (the same label-aligned position as the token's log-prob), the
reward sits on the last response token (plus ``-β·kl_t`` on every token with ``kl_in: reward``,
as :func:`rlcore.algorithms.advantages.shaped_rewards` builds it), and the value after the last
token is 0 (a finished or truncated response is not bootstrapped)::

    δ_t = r_t + γ·V_{t+1} − V_t                 (V_{n} = 0)
    A_t = δ_t + γλ·A_{t+1}                       (A_{n} = 0)
    R_t = A_t + V_t                              (the value target, before whitening)
    Â_t = (A_t − mean(A)) / sqrt(var(A) + 1e-8)  (over every response token of the step;
                                                  var with Bessel's correction, as verl)

Sources: Schulman et al. 2015, High-Dimensional Continuous Control Using Generalized Advantage
Estimation (arXiv:1506.02438) eq. 16; Schulman et al. 2017, Proximal Policy Optimization
Algorithms (arXiv:1707.06347) eq. 9 (the value term); the value clip as in OpenAI baselines' ppo2.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlcore.algorithms.spec import AdvantageInput

#: added to the variance before the square root when whitening (verl's masked_whiten)
WHITEN_EPS = 1e-8
#: added to var(returns) in the explained variance (verl's critic/vf_explained_var)
EXPLAINED_VARIANCE_EPS = 1e-5


def pad(per_sample: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One ``[n_i]`` tensor per sample to ``[B, L]`` (right-padded with 0) and its bool mask."""
    longest = max((int(x.shape[0]) for x in per_sample), default=0)
    out = torch.zeros(len(per_sample), longest, dtype=torch.float32)
    mask = torch.zeros(len(per_sample), longest, dtype=torch.bool)
    for i, x in enumerate(per_sample):
        out[i, : x.shape[0]] = x.float()
        mask[i, : x.shape[0]] = True
    return out, mask


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` ``[B, L]`` (not whitened) from per-token rewards and values
    ``[B, L]``; ``mask`` marks response tokens. A masked position passes the next value and
    advantage through unchanged (verl's rule, so a masked gap inside a row is skipped) and is 0
    in both outputs."""
    m = mask.to(torch.float32)
    r, v = token_rewards.float() * m, values.float() * m
    next_value = torch.zeros(r.shape[0])
    last = torch.zeros(r.shape[0])
    adv = torch.zeros_like(r)
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * next_value - v[:, t]
        here = delta + gamma * lam * last
        next_value = v[:, t] * m[:, t] + (1 - m[:, t]) * next_value
        last = here * m[:, t] + (1 - m[:, t]) * last
        adv[:, t] = last
    adv = adv * m
    return adv, (adv + v) * m


def masked_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(x − mean) / sqrt(var + 1e-8)`` over the masked entries, variance with Bessel's
    correction (verl's ``masked_whiten``); one entry: centred only (its variance is undefined)."""
    m = mask.to(torch.float32)
    n = float(m.sum())
    if n == 0:
        return torch.zeros_like(x)
    mean = (x * m).sum() / n
    if n < 2:
        return (x - mean) * m
    var = (((x - mean) * m) ** 2).sum() / (n - 1)
    return (x - mean) * torch.rsqrt(var + WHITEN_EPS) * m


def gae_per_sample(token_rewards: Sequence[torch.Tensor], values: Sequence[torch.Tensor], gamma: float,
                   lam: float, whiten: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """:func:`gae` on one ``[n_i]`` tensor per sample: ``(advantages, returns)`` per sample,
    the advantages whitened over every token of the step (``whiten``), the returns never."""
    lens = [int(x.shape[0]) for x in token_rewards]
    r, mask = pad(token_rewards)
    v, _ = pad(values)
    adv, ret = gae(r, v, mask, gamma, lam)
    if whiten:
        adv = masked_whiten(adv, mask)
    return [adv[i, :n] for i, n in enumerate(lens)], [ret[i, :n] for i, n in enumerate(lens)]


@dataclass(frozen=True)
class GAEAdvantage:
    """The PPO estimator: GAE over the critic's values (``AdvantageInput.values``), whitened
    over the step. Without values (no critic: a plugin reusing it, the conformance suite)
    ``V ≡ 0``, so ``A_t = Σ_k (γλ)^k r_{t+k}`` before whitening."""

    gamma: float = 1.0
    lam: float = 1.0
    whiten: bool = True
    #: the trainer builds a critic for the algorithm and passes its values in
    needs_values: bool = True

    def __call__(self, inp: AdvantageInput) -> list[torch.Tensor]:
        values = getattr(inp, "values", None)
        if values is None:
            values = [torch.zeros_like(tr, dtype=torch.float32) for tr in inp.token_rewards]
        adv, _ = gae_per_sample(inp.token_rewards, values, self.gamma, self.lam, self.whiten)
        return adv


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       cliprange: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: ``(½·max((V − R)², (clip(V, V_old − c, V_old + c) − R)²), clipped)``, the
    second an indicator (1.0 where the clipped term is the larger, verl's ``vf_clipfrac``).
    ``cliprange`` 0 turns the clip off (the plain ½·(V − R)²). Masking and aggregation are the
    caller's (token-mean over the step's response tokens, as verl's default)."""
    unclipped = (values - returns) ** 2
    if cliprange <= 0:
        return 0.5 * unclipped, torch.zeros_like(unclipped)
    clipped_pred = old_values + (values - old_values).clamp(-cliprange, cliprange)
    clipped = (clipped_pred - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """``1 − var(R − V) / (var(R) + 1e-5)`` over the given (response) tokens, variances with
    Bessel's correction (verl's ``critic/vf_explained_var``): 1 for a perfect critic, 0 for one
    that predicts the mean, negative for worse. Fewer than 2 tokens: 0 (no variance to explain)."""
    if values.numel() < 2:
        return 0.0
    v, r = values.double(), returns.double()
    return float(1.0 - torch.var(r - v) / (torch.var(r) + EXPLAINED_VARIANCE_EPS))
