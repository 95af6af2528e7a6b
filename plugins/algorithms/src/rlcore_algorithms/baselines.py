"""More outcome advantage estimators: OPO's length-weighted baseline, pass@k (only the best sample
of a group learns) and GPG's rescaled group-mean baseline. As the estimators of
core's (:mod:`rlcore.algorithms`), a group of one sample has no baseline and gets advantage 0
(verl gives OPO's and GPG's a baseline of 0, i.e. its reward, and refuses one for pass@k);
docs/algorithms.md lists the differences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rlcore.algorithms import AdvantageInput, broadcast


def _groups(inp: AdvantageInput):
    for gid in torch.unique(inp.groups):
        sel = inp.groups == gid
        if int(sel.sum()) >= 2:
            yield sel


@dataclass(frozen=True)
class OPOAdvantage:
    """On-Policy RL with Optimal reward baseline: ``A_i = r_i − Σ_j |y_j|·r_j / Σ_j |y_j|`` over
    the group, the baseline weighted by response length ``|y_j|`` (the variance-minimising
    baseline of a sequence-level policy gradient whose gradient norm grows with length).

    Source: "On-Policy RL with Optimal Reward Baseline" (2025, arXiv:2505.23585); verl
    ``compute_opo_outcome_advantage``.
    """

    def __call__(self, inp: AdvantageInput) -> list[torch.Tensor]:
        r = inp.rewards.to(torch.float32)
        lens = torch.tensor(inp.response_lengths, dtype=torch.float32)
        adv = torch.zeros_like(r)
        for sel in _groups(inp):
            w = lens[sel]
            base = (w * r[sel]).sum() / w.sum() if float(w.sum()) > 0 else r[sel].mean()
            adv[sel] = r[sel] - base
        return broadcast(adv, inp)


@dataclass(frozen=True)
class PassKAdvantage:
    """Pass@k training: only the best sample of each group learns, with advantage ``r_max −
    r_second`` (a tie at the top: 0), divided by the group's ``std + ε`` unless ``std: none``;
    every other sample gets 0. Which of several equal best samples gets it does not matter (the
    gap is then 0).

    Source: verl ``compute_grpo_passk_outcome_advantage``, which cites arXiv:2503.19595 (its
    ``torch.std`` is ``std: unbiased``).
    """

    std: str = "population"
    eps: float = 1e-6

    def __call__(self, inp: AdvantageInput) -> list[torch.Tensor]:
        r = inp.rewards.to(torch.float32)
        adv = torch.zeros_like(r)
        for sel in _groups(inp):
            idx = torch.nonzero(sel).flatten()
            vals = r[idx]
            top = torch.topk(vals, 2)
            gap = top.values[0] - top.values[1]
            if self.std != "none":
                gap = gap / (vals.std(unbiased=(self.std == "unbiased")) + self.eps)
            adv[idx[top.indices[0]]] = gap
        return broadcast(adv, inp)


@dataclass(frozen=True)
class GPGAdvantage:
    """GPG: ``A_i = α·(r_i − mean_g r)/F``, ``α = B / #{i: r_i ≠ 0}`` over the step's ``B``
    samples (verl's reading of the paper's correction for samples that carry no gradient),
    ``F = f_norm`` (1).

    Source: "GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning"
    (2025, arXiv:2504.02546); verl ``compute_gpg_outcome_advantage`` (which counts nonzero
    rewards for α).
    """

    f_norm: float = 1.0

    def __call__(self, inp: AdvantageInput) -> list[torch.Tensor]:
        r = inp.rewards.to(torch.float32)
        alpha = r.numel() / max(int(torch.count_nonzero(r)), 1)
        adv = torch.zeros_like(r)
        for sel in _groups(inp):
            adv[sel] = alpha * (r[sel] - r[sel].mean()) / self.f_norm
        return broadcast(adv, inp)
