"""The built-in advantage estimators. Each takes an :class:`~rlcore.algorithms.spec.AdvantageInput`
(one step's rewards, groups, per-token rewards) and returns per-token advantages per sample.

Core's outcome estimators (GRPO, Dr.GRPO, RLOO) give every token of a sample the sample's
advantage (the others, REINFORCE++, GDPO, OPO ..., are rlcore-algorithms'). A group of one
sample has no baseline: its advantage is 0 (nothing to compare against), as in the trainer
before estimators became plugins.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlcore.algorithms.spec import AdvantageInput


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


def broadcast(per_sample: torch.Tensor, inp: AdvantageInput) -> list[torch.Tensor]:
    """One advantage per sample (``[N]``) to every token of that sample (``[n_i]`` each)."""
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
        return broadcast(group_normalised(inp.rewards, inp.groups, self.std, self.eps), inp)


@dataclass(frozen=True)
class DrGRPOAdvantage:
    """Dr.GRPO: ``A_i = r_i − mean(r_g)``, no division by the group's std (which biases
    towards too easy and too hard prompts).

    Source: Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"
    (arXiv:2503.20783), eq. 3 / §3.2.
    """

    def __call__(self, inp: AdvantageInput) -> list[torch.Tensor]:
        return broadcast(group_normalised(inp.rewards, inp.groups, "none"), inp)


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
        return broadcast(adv, inp)
