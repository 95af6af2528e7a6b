"""The built-in advantage estimators. Each takes an :class:`~rlcore.algorithms.spec.AdvantageInput`
(one step's rewards, groups, per-token rewards) and returns per-token advantages per sample.

Outcome estimators (GRPO, Dr.GRPO, RLOO) give every token of a sample the sample's advantage;
REINFORCE++ works on per-token returns. A group of one sample has no baseline: its advantage
is 0 (nothing to compare against), as in the trainer before estimators became plugins.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlcore.algorithms.spec import AdvantageInput
from rlcore.errors import ConfigError

STD_MODES = ("population", "unbiased", "none")


def shaped_rewards(rewards: list[float], counts: list[int], penalty: list[torch.Tensor] | None,
                   token_level: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The rewards an advantage estimator sees: per token (each sample's reward on its last
    response token) and per sample. ``penalty``: a per-token KL penalty in the reward (one
    ``[n_i]`` tensor per sample), added per token, and summed into the per-sample reward for
    outcome estimators (``token_level`` false)."""
    token_rewards = [torch.zeros(n) for n in counts]
    for tr, r in zip(token_rewards, rewards, strict=True):
        if tr.numel():
            tr[-1] = r
    seq_rewards = torch.tensor(rewards, dtype=torch.float32)
    if penalty is not None:
        token_rewards = [tr + p for tr, p in zip(token_rewards, penalty, strict=True)]
        if not token_level:
            seq_rewards = seq_rewards + torch.tensor([float(p.sum()) for p in penalty])
    return token_rewards, seq_rewards


def _broadcast(per_sample: torch.Tensor, inp: AdvantageInput) -> list[torch.Tensor]:
    return [torch.full((n,), float(a)) for a, n in zip(per_sample.tolist(), inp.response_lengths, strict=False)]


def group_normalised(rewards: torch.Tensor, groups: torch.Tensor, std: str = "population",
                     eps: float = 1e-6) -> torch.Tensor:
    """``(r_i − mean_g) / (std_g + eps)`` per sample (``std="none"``: ``r_i − mean_g``)."""
    r = rewards.to(torch.float32)
    adv = torch.zeros_like(r)
    for gid in torch.unique(groups):
        sel = groups == gid
        vals = r[sel]
        if vals.numel() < 2:
            continue
        centred = vals - vals.mean()
        if std != "none":
            centred = centred / (vals.std(unbiased=(std == "unbiased")) + eps)
        adv[sel] = centred
    return adv


@dataclass(frozen=True)
class GRPOAdvantage:
    """GRPO: ``A_i = (r_i − mean(r_g)) / (std(r_g) + ε)`` over the group ``g`` of samples of
    one prompt, for every token of sample ``i``. ``std``: ``population`` (divide by G),
    ``unbiased`` (by G−1, as ``torch.std`` and verl's GRPO estimator) or ``none`` (Dr.GRPO).

    Source: Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300), §4.1.2, outcome supervision:
    ``Â_{i,t} = (r_i − mean(r)) / std(r)``.
    """

    std: str = "population"
    eps: float = 1e-6

    def __call__(self, inp: AdvantageInput) -> list[torch.Tensor]:
        return _broadcast(group_normalised(inp.rewards, inp.groups, self.std, self.eps), inp)


@dataclass(frozen=True)
class DrGRPOAdvantage:
    """Dr.GRPO: ``A_i = r_i − mean(r_g)``, no division by the group's std (which biases
    towards too easy and too hard prompts).

    Source: Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"
    (arXiv:2503.20783), eq. 3 / §3.2.
    """

    def __call__(self, inp: AdvantageInput) -> list[torch.Tensor]:
        return _broadcast(group_normalised(inp.rewards, inp.groups, "none"), inp)


@dataclass(frozen=True)
class RLOOAdvantage:
    """RLOO: ``A_i = r_i − (1/(G−1))·Σ_{j≠i} r_j``, the leave-one-out baseline of the other
    samples of the same prompt (``= G/(G−1)·(r_i − mean(r_g))``).

    Sources: Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!";
    Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for
    Learning from Human Feedback in LLMs" (arXiv:2402.14740), eq. 7.
    """

    def __call__(self, inp: AdvantageInput) -> list[torch.Tensor]:
        r = inp.rewards.to(torch.float32)
        adv = torch.zeros_like(r)
        for gid in torch.unique(inp.groups):
            sel = inp.groups == gid
            vals = r[sel]
            k = vals.numel()
            if k < 2:
                continue
            adv[sel] = vals - (vals.sum() - vals) / (k - 1)
        return _broadcast(adv, inp)


def _returns(token_rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = Σ_{s≥t} γ^{s−t} r_s`` over one response."""
    out = torch.zeros_like(token_rewards, dtype=torch.float32)
    running = 0.0
    for t in range(token_rewards.shape[0] - 1, -1, -1):
        running = float(token_rewards[t]) + gamma * running
        out[t] = running
    return out


def _whiten(per_sample: list[torch.Tensor], eps: float) -> list[torch.Tensor]:
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
        return _whiten([_returns(tr, self.gamma) for tr in inp.token_rewards], self.eps)


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
        centred = [_returns(tr, 1.0) - b for tr, b in zip(inp.token_rewards, baseline.tolist(), strict=False)]
        return _whiten(centred, self.eps)


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
        per_token = _broadcast(total, inp)
        return _whiten(per_token, self.batch_eps) if self.batch_norm else per_token
