"""Advantage estimators of rlcore-algorithms over per-token returns or reward components:
REINFORCE++ (and its baseline variant), GDPO and ReMax. Each takes an
:class:`rlcore.algorithms.AdvantageInput` and returns per-token advantages per sample; core's own
estimators (GRPO, Dr.GRPO, RLOO) and helpers (``group_normalised``, ``broadcast``) are reused
from :mod:`rlcore.algorithms`. A group of one sample has no baseline: its advantage is 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rlcore.algorithms import AdvantageInput, broadcast, group_normalised
from rlcore.errors import ConfigError


def returns(token_rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = Σ_{s≥t} γ^{s−t} r_s`` over one response."""
    out = torch.zeros_like(token_rewards, dtype=torch.float32)
    running = 0.0
    for t in range(token_rewards.shape[0] - 1, -1, -1):
        running = float(token_rewards[t]) + gamma * running
        out[t] = running
    return out


def whiten(per_sample: list[torch.Tensor], eps: float) -> list[torch.Tensor]:
    """Normalise over every response token of the step: ``(x − mean) / sqrt(var + eps)``
    (population variance)."""
    flat = torch.cat(per_sample) if per_sample else torch.zeros(0)
    if flat.numel() < 2:
        return [torch.zeros_like(x) for x in per_sample]
    mean = flat.mean()
    scale = torch.rsqrt(flat.var(unbiased=False) + eps)
    return [(x - mean) * scale for x in per_sample]


@dataclass(frozen=True)
class ReinforcePPAdvantage:
    """REINFORCE++: per-token returns of the token rewards (the outcome reward on the last
    token, ``−β·KL_t`` on every token when the KL penalty is in the reward), normalised over
    the whole step's tokens: ``A_t = (G_t − mean(G)) / sqrt(var(G) + ε)``,
    ``G_t = Σ_{s≥t} γ^{s−t} r_s``.

    Source: Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
    Models" (arXiv:2501.03262), §3 (token-level KL penalty, eq. 3; global advantage
    normalisation, eq. 5).
    """

    gamma: float = 1.0
    eps: float = 1e-8

    def __call__(self, inp: AdvantageInput) -> list[torch.Tensor]:
        return whiten([returns(tr, self.gamma) for tr in inp.token_rewards], self.eps)


@dataclass(frozen=True)
class ReinforcePPBaselineAdvantage:
    """REINFORCE++-baseline: the group mean of the sample rewards as baseline, then the same
    step-wide normalisation: ``A_t = whiten(G_t − mean(r_g))`` with ``γ = 1`` returns.

    Source: Hu 2025, "REINFORCE++" (arXiv:2501.03262, v3+), §3.2 "REINFORCE++-baseline"
    (group-mean baseline for multi-sample prompts, global batch normalisation).
    """

    eps: float = 1e-8

    def __call__(self, inp: AdvantageInput) -> list[torch.Tensor]:
        r = inp.rewards.to(torch.float32)
        baseline = torch.zeros_like(r)
        for gid in torch.unique(inp.groups):
            sel = inp.groups == gid
            baseline[sel] = r[sel].mean()
        centred = [returns(tr, 1.0) - b for tr, b in zip(inp.token_rewards, baseline.tolist(), strict=False)]
        return whiten(centred, self.eps)


@dataclass(frozen=True)
class GDPOAdvantage:
    """GDPO: each reward component normalised within its group separately, the weighted sum,
    then (``batch_norm``) normalised over every response token of the step::

        A_i = whiten_step( Σ_k w_k · (r_ik − mean_g r_k) / (std_g r_k + ε) )

    ``weights``: ``(name, w_k)`` pairs (a component not named: 1); a name the reward function
    does not return is a :class:`ConfigError` naming ``algorithm.reward_weights.<name>``. A
    reward of single values is one component (with ``batch_norm`` off: GRPO's advantages).

    Source: Liu et al. 2026, "GDPO: Group reward-Decoupled Normalization Policy Optimization for
    Multi-reward RL Optimization" (arXiv:2601.05242, NVIDIA); reference implementation
    NVlabs/GDPO (``verl-GDPO``: verl's GRPO estimator per component, summed, ``masked_whiten``).
    """

    weights: tuple[tuple[str, float], ...] = ()
    std: str = "population"
    eps: float = 1e-6
    batch_norm: bool = True
    batch_eps: float = 1e-8

    def __call__(self, inp: AdvantageInput) -> list[torch.Tensor]:
        components = inp.reward_components or {"reward": inp.rewards}
        weights = dict(self.weights)
        for name in weights:
            if name not in components:
                raise ConfigError(f"algorithm.reward_weights.{name}: the reward function returns no component "
                                  f"{name!r} (its components: {', '.join(sorted(components))})",
                                  key=f"algorithm.reward_weights.{name}")
        total = torch.zeros(inp.rewards.shape[0], dtype=torch.float32)
        for name in sorted(components):
            total += weights.get(name, 1.0) * group_normalised(components[name], inp.groups, self.std, self.eps)
        per_token = broadcast(total, inp)
        return whiten(per_token, self.batch_eps) if self.batch_norm else per_token


@dataclass(frozen=True)
class ReMaxAdvantage:
    """ReMax: REINFORCE whose baseline is the reward of the policy's own greedy response to the
    same prompt, ``A_t = G_t − b_i`` with ``G_t = Σ_{s≥t} r_s`` the return of the token rewards
    (the outcome reward on the last token, ``−β·kl_t`` per token with ``kl_in: reward``) and
    ``b_i`` the greedy response's reward for sample ``i``'s prompt
    (``AdvantageInput.baseline_rewards``, required: core generates it for an algorithm with
    ``Algorithm.greedy_baseline``, ``rlcore.algorithms.remax``).

    Source: Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning
    Method for Aligning Large Language Models" (arXiv:2310.10505) Algorithm 1; verl
    ``compute_remax_outcome_advantage``.
    """

    def __call__(self, inp: AdvantageInput) -> list[torch.Tensor]:
        if inp.baseline_rewards is None:
            raise ValueError("ReMax needs AdvantageInput.baseline_rewards (the greedy response's reward per sample); "
                             "set Algorithm.greedy_baseline so that the trainer generates them")
        return [returns(tr, 1.0) - float(b) for tr, b in zip(inp.token_rewards, inp.baseline_rewards.tolist(),
                                                               strict=True)]
