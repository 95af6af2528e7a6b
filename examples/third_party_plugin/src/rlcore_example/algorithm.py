"""The example's algorithm: plain REINFORCE with a group-mean baseline, written against rlcore's
public algorithm contract only (``rlcore.algorithms``). Imported by the factory, not at plugin
load (it needs torch).

Per token ``pg_t = −A_t · logp_t`` and ``∂pg_t/∂logp_t = −A_t`` (no importance ratio, no
clipping: strictly on-policy). ``A_i = r_i − mean(r_group)`` (``baseline: mean``) or ``r_i``
(``baseline: none``). Source: Williams 1992, "Simple Statistical Gradient-Following Algorithms
for Connectionist Reinforcement Learning", eq. 11 (REINFORCE with a baseline).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rlcore.algorithms import AdvantageInput, Algorithm, TokenInputs


@dataclass(frozen=True)
class GroupBaselineAdvantage:
    baseline: str = "mean"

    def __call__(self, inp: AdvantageInput) -> list[torch.Tensor]:
        r = inp.rewards.float()
        b = torch.zeros_like(r)
        if self.baseline == "mean":
            for gid in torch.unique(inp.groups):
                sel = inp.groups == gid
                b[sel] = r[sel].mean()
        return [torch.full((n,), float(a)) for a, n in zip((r - b).tolist(), inp.response_lengths, strict=False)]


@dataclass(frozen=True)
class ReinforceLoss:
    sequence_level: bool = False

    def value(self, logprobs: torch.Tensor, x: TokenInputs, seq_log_ratio=None) -> torch.Tensor:
        lp = torch.where(x.mask, logprobs, torch.zeros_like(logprobs))
        return -x.advantages.to(lp.dtype) * lp

    def grad(self, logprobs: torch.Tensor, x: TokenInputs, seq_log_ratio=None):
        a = x.advantages.to(logprobs.dtype)
        return self.value(logprobs, x), torch.where(x.mask, -a, torch.zeros_like(a))

    def metrics(self, logprobs: torch.Tensor, x: TokenInputs, seq_log_ratio=None) -> dict[str, torch.Tensor]:
        old = x.old_logprobs.to(logprobs.dtype)
        return {"ratio": torch.exp(torch.where(x.mask, logprobs - old, torch.zeros_like(old)))}


def build(settings) -> Algorithm:
    return Algorithm(advantages=GroupBaselineAdvantage(settings.baseline), loss=ReinforceLoss())
