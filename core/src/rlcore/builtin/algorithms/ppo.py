"""The built-in ``ppo`` algorithm: PPO-clip with GAE advantages from a separate value model
(critic) trained beside the policy (:mod:`rlcore.critic`, :mod:`rlcore.algorithms.gae`).

Its settings sit under ``algorithm:`` like every algorithm's: the clip ranges, GAE's ``gamma``
and ``lam`` (verl's ``algorithm.gamma``/``algorithm.lam``; rlcore's reinforce_pp has
``algorithm.gamma`` too), and the critic's training under ``algorithm.critic``. Torch-free at
import; the engine's value-model requirement is :data:`NEEDS_VALUE_MODEL`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlcore.algorithms.common import bad_value, check_clip
from rlcore.algorithms.spec import Algorithm, AlgorithmSpec
from rlcore.types import Cap, RequiresCapability


@dataclass
class CriticSettings:
    """``lr``: the critic's AdamW learning rate (0: ``training.lr``; betas and weight decay are
    the policy's). ``cliprange_value``: PPO's value clip ``c`` (0: off). ``grad_clip``: its
    gradient-norm clip (-1: ``training.grad_clip``; 0: off). ``warmup_steps``: the first N steps
    update only the critic, the policy is not stepped (verl's ``trainer.critic_warmup``, which
    counts from step 1: its ``critic_warmup: N`` freezes N−1 steps, this setting's N−1)."""

    lr: float = 0.0
    cliprange_value: float = 0.5
    grad_clip: float = -1.0
    warmup_steps: int = 0


@dataclass
class PPOSettings:
    """``clip_low``/``clip_high``/``clip_ratio_c``: the PPO-clip loss (as grpo's); ``gamma``,
    ``lam``: GAE's discount and λ (verl's defaults, 1.0 and 1.0); ``critic``: the value model."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_ratio_c: float = 3.0
    gamma: float = 1.0
    lam: float = 1.0
    critic: CriticSettings = field(default_factory=CriticSettings)


def validate(s: Any) -> None:
    check_clip(s)
    for key in ("gamma", "lam"):
        if not 0 <= float(s[key]) <= 1:
            raise bad_value(key, "must be in [0, 1]")
    c = s.critic
    if float(c.lr) < 0:
        raise bad_value("critic.lr", "must be >= 0 (0: training.lr)")
    if float(c.cliprange_value) < 0:
        raise bad_value("critic.cliprange_value", "must be >= 0 (0: no value clip)")
    if float(c.grad_clip) < 0 and float(c.grad_clip) != -1:
        raise bad_value("critic.grad_clip", "must be >= 0 (0: off) or -1 (training.grad_clip)")
    if int(c.warmup_steps) < 0:
        raise bad_value("critic.warmup_steps", "must be >= 0 (the first N steps update only the critic)")


def build(s: Any) -> Algorithm:
    from rlcore.algorithms import PPOClip
    from rlcore.algorithms.gae import GAEAdvantage

    # token-level rewards: a KL-in-reward penalty stays on its token, as GAE expects
    return Algorithm(advantages=GAEAdvantage(gamma=float(s.gamma), lam=float(s.lam)),
                     loss=PPOClip(float(s.clip_low), float(s.clip_high), float(s.clip_ratio_c)),
                     token_level_rewards=True)


SPEC = AlgorithmSpec(
    name="ppo", factory=build, settings=PPOSettings, validate=validate, loss_agg="token-mean",
    description="PPO-clip with GAE advantages from a separate value model (critic)",
    source="Schulman et al. 2017, PPO (arXiv:1707.06347); Schulman et al. 2015, GAE (arXiv:1506.02438); "
           "verl's compute_gae_advantage_return and compute_value_loss",
)

#: the engine must build the critic (checked by ``rlcore check`` from declared capabilities)
NEEDS_VALUE_MODEL = RequiresCapability(
    role="engine", capability=Cap.VALUE_MODEL,
    reason="algorithm.name=ppo trains a value model (critic) on the training engine",
    when=lambda cfg: "critic" in cfg.algorithm,
)
