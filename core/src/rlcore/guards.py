"""Non-finite guards of the training loop: a NaN or inf reward, advantage, loss, gradient or
weight never reaches the optimizer, a push or a checkpoint unnoticed. Each check raises a
:class:`~rlcore.errors.NonFiniteError` (or :class:`~rlcore.errors.RewardError`) that names what
was non-finite, where, and what the run does next (``training.on_nonfinite``)."""

from __future__ import annotations

import math
import numbers
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


#: the largest reward magnitude: the trainer holds rewards in float32 tensors (advantages, the
#: reward-shaped token rewards), and a larger one cannot be stored there (it raised a bare
#: ``RuntimeError: value cannot be converted to type float without overflow``). Rewards within it
#: whose group statistics still overflow (±3e38 summed) are the advantages guard's case below.
REWARD_LIMIT = float(torch.finfo(torch.float32).max)


def shorten(text: str, limit: int = 80) -> str:
    """``text`` cut to about ``limit`` characters (``repr(10**400)`` has 401 digits)."""
    return text if len(text) <= limit else f"{text[:limit // 2]}...{text[-12:]} ({len(text)} characters)"


def _real(value: Any) -> Any:
    """``value`` as a Python int or float when it is a real number, else None. NumPy integer and
    floating scalars (registered as ``numbers.Real``) and one-element tensors and arrays count;
    ``bool`` (and NumPy's) does not: a predicate returned by mistake would train as a 0/1 reward."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return None
    if isinstance(value, numbers.Real):
        return value
    if isinstance(value, torch.Tensor):
        ok = value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool
        return value.item() if ok else None
    dtype = getattr(value, "dtype", None)  # a NumPy array (without importing NumPy)
    if type(value).__module__ == "numpy" and getattr(value, "size", None) == 1 and getattr(dtype, "kind", "") in (
            "i", "u", "f"):
        return value.item()
    return None


def checked_reward(value: Any, where: str) -> float:
    """``value`` as a float; ``where`` names the reward function, the value, the sample and the step."""
    real = _real(value)
    if real is None:
        hint = " (for a 0/1 reward return float(...))" if type(value).__name__ in ("bool", "bool_") else ""
        raise RewardError(f"{where}; a reward must be a real number (int, float, a NumPy integer or floating scalar, "
                          f"a one-element tensor or array), not {type(value).__module__}.{type(value).__qualname__}"
                          .replace("builtins.", "") + hint)
    too_large = (f"{where}; its magnitude exceeds {REWARD_LIMIT:.7g}, the largest float32, in which the trainer "
                 f"holds rewards and advantages: scale the reward down")
    try:
        reward = float(real)
    except OverflowError:  # an int beyond any float (10**400)
        raise RewardError(too_large) from None
    if not math.isfinite(reward):
        raise NonFiniteError(f"{where}; rewards must be finite", what="reward")
    if abs(reward) > REWARD_LIMIT:
        raise RewardError(too_large)
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
