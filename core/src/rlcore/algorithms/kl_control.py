"""The KL coefficient β of the step: fixed (``algorithm.kl_coef``), or adaptive when
``algorithm.kl_control.target`` > 0 (Ziegler et al. 2019, "Fine-Tuning Language Models from Human
Preferences", arXiv:1909.08593 §2.2; verl ``AdaptiveKLController``):

    e = clip(KL / target − 1, −0.2, 0.2)        β ← β · (1 + e · n / horizon)

after each step, ``KL`` the step's mean over sequences of each sequence's mean per-token
estimate (``algorithm.kl_estimator``) between the policy that sampled (the recomputed
log-probs) and the reference, ``n`` the step's number of samples (verl passes its batch size).
β applies to the KL term wherever ``algorithm.kl_in`` puts it (verl adapts only the KL in the
reward). It is checkpointed, so a resumed run continues with the β it had.

Which sequences the mean is over differs from verl on purpose: only those with loss tokens
(verl's ``masked_mean(..., axis=-1)`` then ``mean`` over every row counts an empty or fully
masked response as KL 0, so masking samples, e.g. DAPO's overlong filter, would read as a smaller
KL and shrink β); a step with no loss token at all measures nothing and leaves β unchanged
(verl: KL 0, β shrinks).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from rlcore.algorithms.losses import TokenObjective, kl_penalty

#: the step batch's fields it reads (filled by the no-grad passes)
RECOMPUTED, REF = "recomputed_logprobs", "ref_logprobs"


class KLControl:
    def __init__(self, beta: float, target: float = 0.0, horizon: int = 10000, kl_in: str = "loss",
                 estimator: str = "k3") -> None:
        self.beta, self.target, self.horizon = float(beta), float(target), int(horizon)
        self.kl_in, self.estimator = kl_in, estimator

    @classmethod
    def from_config(cls, a: Any) -> KLControl:
        """From the ``algorithm:`` section."""
        return cls(float(a.kl_coef), float(a.kl_control.target), int(a.kl_control.horizon), a.kl_in, a.kl_estimator)

    @property
    def adaptive(self) -> bool:
        return self.target > 0 and self.beta > 0

    def update(self, kl: float, n_steps: int) -> float:
        """One controller step from the measured ``kl``; returns the new β."""
        if self.adaptive:
            err = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.beta *= 1.0 + err * n_steps / self.horizon
        return self.beta

    def objective(self, objective: TokenObjective) -> TokenObjective:
        """``objective`` with this β on its KL loss term (0 when the KL is in the reward)."""
        return dataclasses.replace(objective, kl_coef=self.beta if self.kl_in == "loss" else 0.0)

    def step_end(self, objective: TokenObjective, batch: Any) -> tuple[TokenObjective, dict[str, float]]:
        """After the step's updates: measure KL on ``batch``, adapt β, and return the objective for
        the next step with the metrics ``kl_control/kl`` and ``kl_control/beta`` (none when fixed;
        no ``kl_control/kl`` and β unchanged on a step without loss tokens)."""
        if not self.adaptive:
            return objective, {}
        with torch.no_grad():
            mask = batch.loss_mask
            kl = kl_penalty(batch.fields[RECOMPUTED].float(), batch.fields[REF].float(), self.estimator)
            m = mask.to(kl.dtype)
            per_seq = batch.seq_sum(torch.where(mask, kl, torch.zeros_like(kl))) / batch.seq_sum(m).clamp_min(1.0)
            has = batch.seq_sum(m) > 0
            if not bool(has.any()):  # nothing measured: no evidence to move β on
                return self.objective(objective), {"kl_control/beta": self.beta}
            measured = float(per_seq[has].mean())
        self.update(measured, batch.num_seqs)
        return self.objective(objective), {"kl_control/kl": measured, "kl_control/beta": self.beta}

    def state(self) -> dict[str, float]:
        """The checkpoint entry (empty when β is fixed)."""
        return {"kl_control_beta": self.beta} if self.adaptive else {}

    def restore(self, state: dict, objective: TokenObjective) -> TokenObjective:
        if "kl_control_beta" in state and self.adaptive:
            self.beta = float(state["kl_control_beta"])
        return self.objective(objective)
