"""Non-finite guards of the training loop: a NaN or inf reward, advantage, loss, gradient or
weight never reaches the optimizer, a push or a checkpoint unnoticed. Each check raises a
:class:`~rlcore.errors.NonFiniteError` (or :class:`~rlcore.errors.RewardError`) that names what
was non-finite, where, and what the run does next (``training.on_nonfinite``)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from rlcore.errors import NonFiniteError, RewardError


def nonfinite_error(step: int, policy: str, what: str, detail: str, skippable: bool = True) -> NonFiniteError:
    """The error for a non-finite ``what`` at ``step``; ``policy`` is ``training.on_nonfinite``."""
    then = ("the step is skipped (training.on_nonfinite=skip)" if skippable and policy == "skip" else
            "the run stops; the weights and checkpoints are the last good ones"
            + (" (training.on_nonfinite=skip drops such steps instead)" if skippable else ""))
    return NonFiniteError(f"step {step}: non-finite {what}: {detail}; {then}", what=what, skippable=skippable)


def checked_reward(value: Any, where: str) -> float:
    """``value`` as a float; ``where`` names the reward function, the sample and the step."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not (
            isinstance(value, torch.Tensor) and value.numel() == 1):
        raise RewardError(f"{where}; a reward must be a real number")
    reward = float(value)
    if not math.isfinite(reward):
        raise NonFiniteError(f"{where}; rewards must be finite", what="reward")
    return reward


def advantages_problem(advantages: torch.Tensor, per_sample: torch.Tensor | None,
                       rewards: list[float]) -> str | None:
    """None when every advantage is finite, else which samples are not (finite rewards can still
    overflow: a group mean of 3e38s is inf)."""
    if bool(torch.isfinite(advantages).all()):
        return None
    per_seq = per_sample.tolist() if per_sample is not None else []
    bad = [i for i, a in enumerate(per_seq) if not math.isfinite(a)]
    return f"samples {bad[:8]} (rewards {[rewards[i] for i in bad[:8]]})"


def grad_norm_problem(parameters: Iterable[torch.Tensor]) -> str | None:
    """None when the gradients' total norm is finite (checked before the optimizer step: a NaN/inf
    gradient would make every weight NaN)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if grads:
        norm = float(torch.nn.utils.get_total_norm(grads))
        if not math.isfinite(norm):
            return f"gradient norm {norm} before the optimizer step"
    return None


def check_weights_finite(engine: Any, step: int, before: str, hint: str = "resume from the last checkpoint") -> None:
    """Never push or checkpoint NaN/inf weights (their checksums would still match)."""
    model = getattr(engine, "model", None)
    named = (model.named_parameters() if hasattr(model, "named_parameters")
             else ((f"parameter {i}", p) for i, p in enumerate(engine.parameters())))
    bad = [n for n, p in named if p.is_floating_point() and not bool(torch.isfinite(p.detach()).all())]
    if bad:
        raise NonFiniteError(
            f"step {step}: {len(bad)} weight tensor(s) are non-finite (e.g. {bad[:3]}) before the "
            f"{before}; nothing was pushed or checkpointed: {hint}", what="weights")
