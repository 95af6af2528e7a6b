"""The optimal-token baseline (OTB): a baseline per token position, the group's returns weighted
by each trajectory's accumulated gradient energy up to that token.

Per group ``g`` (the samples of one prompt) and response position ``t``::

    G_it = Σ_{s≥t} r_is                              return-to-go of the token rewards
    w_it = (1 − 2·π_it + Σ_v π_it(v)²) · c_it²       ‖∂logπ(y_t)/∂logits‖² = ‖onehot − π‖², × the
                                                     mismatch correction's weight squared (when on)
    W_it = Σ_{s≤t} w_is                              the path's "realized energy" so far
    B_t  = Σ_{i: |y_i|>t} G_it·W_it / (Σ_{i: |y_i|>t} W_it + ε)
    A_it = G_it − B_t

``π_it`` is the sampled token's probability and ``Σπ²`` the sum of squared probabilities of the
whole softmax, both from the trainer's old-log-prob pass (the policy that sampled, at the rollout
temperature): ``AdvantageInput.recomputed_logprobs`` and ``AdvantageInput.sum_pi_squared``, which
core fills for an algorithm whose spec needs ``Cap.SUM_PI_SQUARED``. From one pass, ``w ≥ 0``
(a squared norm); mixing the rollout engine's ``π`` with the trainer's ``Σπ²`` could make it negative.

``handle_zero_tail``: where one trajectory of a group is strictly the longest, its positions past
the second-longest have no other trajectory to compare with (``B_t ≈ G_t``, advantage ≈ 0); the
option sets its baseline there to 0 (advantage = return), as verl's ``handle_zero_tail``.

A group of one sample gets advantage 0, as every group baseline here (verl: the return).

Source: verl ``compute_optimal_token_baseline_advantage`` (``verl/trainer/ppo/core_algos.py``,
``algorithm.adv_estimator: optimal_token_baseline``; docs/algo/otb.md and the "Optimal Token
Baseline" write-up it links, richardli.xyz/optimal-token-baseline).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rlcore.algorithms import AdvantageInput


def returns_to_go(token_rewards: torch.Tensor) -> torch.Tensor:
    """``G_t = Σ_{s≥t} r_s`` over one response (``[n]`` → ``[n]``)."""
    return token_rewards.flip(0).cumsum(0).flip(0)


@dataclass(frozen=True)
class OptimalTokenBaselineAdvantage:
    """``A_it = G_it − B_t`` with the optimal token baseline of the module docstring. ``eps``:
    added to the baseline's denominator (verl's ``epsilon``, 1e-8)."""

    handle_zero_tail: bool = False
    eps: float = 1e-8

    def __call__(self, inp: AdvantageInput) -> list[torch.Tensor]:
        if inp.sum_pi_squared is None or inp.recomputed_logprobs is None:
            raise ValueError(
                "the optimal-token baseline needs AdvantageInput.sum_pi_squared and recomputed_logprobs (the "
                "old-log-prob pass's); core fills them for an algorithm whose spec lists Cap.SUM_PI_SQUARED in "
                "head_needs"
            )
        lengths = inp.response_lengths
        out = [torch.zeros(n, dtype=torch.float32) for n in lengths]
        for gid in torch.unique(inp.groups):
            members = [i for i in torch.nonzero(inp.groups == gid).flatten().tolist() if lengths[i] > 0]
            if len(members) < 2:
                continue  # no other sample of the prompt to compare with: advantage 0
            n_max = max(lengths[i] for i in members)
            ret = torch.zeros(len(members), n_max, dtype=torch.float64)
            energy = torch.zeros_like(ret)
            valid = torch.zeros(len(members), n_max, dtype=torch.bool)
            for row, i in enumerate(members):
                n = lengths[i]
                ret[row, :n] = returns_to_go(inp.token_rewards[i].double())
                w = 1.0 - 2.0 * inp.recomputed_logprobs[i].double().exp() + inp.sum_pi_squared[i].double()
                if inp.correction is not None:
                    w = w * inp.correction[i].double() ** 2
                energy[row, :n] = w.cumsum(0)
                valid[row, :n] = True
            energy = energy * valid
            baseline = (ret * energy).sum(0) / (energy.sum(0) + self.eps)  # [n_max], one per position
            base = baseline.expand(len(members), -1).clone()
            if self.handle_zero_tail:
                by_len = sorted(lengths[i] for i in members)
                longest, second = by_len[-1], by_len[-2]
                if longest > second:  # one trajectory alone past `second`
                    row = next(r for r, i in enumerate(members) if lengths[i] == longest)
                    base[row, second:] = 0.0
            for row, i in enumerate(members):
                n = lengths[i]
                out[i] = (ret[row, :n] - base[row, :n]).float()
        return out
