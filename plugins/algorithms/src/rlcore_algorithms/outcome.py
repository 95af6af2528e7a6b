"""rlcore-algorithms' algorithms that put an advantage estimator under core's PPO-clip loss:
REINFORCE++ (and its baseline variant), OPO, ReMax, GRPO pass@k, GDPO and the optimal-token
baseline. Each spec carries its settings dataclass (core's ``PPOClipSettings``/``GRPOSettings``
and their checks, reused from :mod:`rlcore.algorithms`) and its check; the estimators are this
plugin's, imported when a factory runs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from rlcore.algorithms import (
    PPO_SOURCE,
    Algorithm,
    AlgorithmSpec,
    GRPOSettings,
    PPOClipSettings,
    check_clip,
    check_grpo,
    check_positive,
    estimator,
    ppo_clip,
    with_estimator,
)
from rlcore.errors import ConfigError
from rlcore.types import Cap

#: ``algorithm.advantage`` of the algorithms that take an outcome estimator by name (core's and
#: REINFORCE++'s); the REINFORCE++ ones take per-token rewards
ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
TOKEN_LEVEL = ("reinforce_pp", "reinforce_pp_baseline")


def advantage_estimator(name: str, s: Any):
    """The estimator ``name`` (one of :data:`ADVANTAGES`): REINFORCE++'s here, the others core's."""
    from rlcore_algorithms.advantages import ReinforcePPAdvantage, ReinforcePPBaselineAdvantage

    if name == "reinforce_pp":
        return ReinforcePPAdvantage(gamma=float(s.get("gamma", 1.0)))
    if name == "reinforce_pp_baseline":
        return ReinforcePPBaselineAdvantage()
    return estimator(name, s)


def with_advantage(loss: Any, advantage: str | None = None):
    """``with_estimator`` of core over :func:`advantage_estimator` (REINFORCE++'s per-token rewards)."""
    return with_estimator(loss, advantage, estimators=advantage_estimator, token_level=TOKEN_LEVEL)


@dataclass
class ReinforcePPSettings(PPOClipSettings):
    """``gamma``: discount of the per-token returns."""

    gamma: float = 1.0


@dataclass
class PassKSettings(GRPOSettings):
    """PPO-clip settings and the group std the gap is divided by (``none``: not divided)."""


@dataclass
class GDPOSettings(GRPOSettings):
    """GRPO's settings (``std``, ``eps``: each component's group normalisation) and
    ``reward_weights``: ``{component: weight}`` of the sum (a component not named: 1);
    ``batch_norm``: normalise the sum over the step's response tokens (the paper's last step)."""

    reward_weights: dict[str, float] = field(default_factory=dict)
    batch_norm: bool = True


def _check_gdpo(s: Any) -> None:
    check_grpo(s)
    for name, weight in s.reward_weights.items():
        if not math.isfinite(float(weight)):
            raise ConfigError(f"bad value for config key 'algorithm.reward_weights.{name}': {weight!r}; must be finite",
                              key=f"algorithm.reward_weights.{name}")
    # the components are the reward function's values: a shaping that changes only the summed
    # reward would be lost to the per-component normalisation, so it is refused, not dropped
    if s.get("kl_in") == "reward" and float(s.get("kl_coef", 0.0)) > 0:
        raise ConfigError("algorithm.name=gdpo normalises the reward function's components; a KL penalty in the "
                          "reward is not one of them: use algorithm.kl_in=loss", key="algorithm.kl_in")
    dapo = s.get("dapo")
    if dapo is not None and int(dapo.overlong.buffer_tokens) > 0:
        raise ConfigError("algorithm.name=gdpo normalises the reward function's components; the soft overlong "
                          "penalty is not one of them: set algorithm.dapo.overlong.buffer_tokens=0 (or return the "
                          "penalty as a component)", key="algorithm.dapo.overlong.buffer_tokens")


def _build_gdpo(s: Any) -> Algorithm:
    from rlcore_algorithms.advantages import GDPOAdvantage

    std = s.std if s.normalize_std else "none"
    weights = tuple(sorted((str(k), float(v)) for k, v in s.reward_weights.items()))
    return Algorithm(advantages=GDPOAdvantage(weights=weights, std=std, eps=float(s.eps),
                                              batch_norm=bool(s.batch_norm)), loss=ppo_clip(s))


@dataclass
class OptimalTokenBaselineSettings(PPOClipSettings):
    """``handle_zero_tail``: a group's strictly longest response gets baseline 0 past the
    second-longest (verl's option); ``eps``: added to the baseline's denominator."""

    handle_zero_tail: bool = False
    eps: float = 1e-8


def _check_otb(s: Any) -> None:
    check_clip(s)
    check_positive(s, "eps")


def _build_otb(s: Any) -> Algorithm:
    from rlcore_algorithms.token_baseline import OptimalTokenBaselineAdvantage

    return Algorithm(advantages=OptimalTokenBaselineAdvantage(handle_zero_tail=bool(s.handle_zero_tail),
                                                              eps=float(s.eps)),
                     loss=ppo_clip(s), token_level_rewards=True)


def _check_reinforce(s: Any) -> None:
    check_clip(s)
    if not 0 < float(s.gamma) <= 1:
        raise ConfigError("bad value for config key 'algorithm.gamma': must be in (0, 1]", key="algorithm.gamma")


def _check_remax(s: Any) -> None:
    check_clip(s)
    dapo = s.get("dapo")
    if dapo is not None and dapo.dynamic_sampling.enable:
        raise ConfigError("algorithm.name=remax takes its greedy baselines for the step's own prompts; DAPO's dynamic "
                          "sampling draws more rounds of prompts: set algorithm.dapo.dynamic_sampling.enable=false",
                          key="algorithm.dapo.dynamic_sampling.enable")


def _build_opo(s: Any) -> Algorithm:
    from rlcore_algorithms.baselines import OPOAdvantage

    return Algorithm(advantages=OPOAdvantage(), loss=ppo_clip(s))


def _build_remax(s: Any) -> Algorithm:
    from rlcore_algorithms.advantages import ReMaxAdvantage

    return Algorithm(advantages=ReMaxAdvantage(), loss=ppo_clip(s), token_level_rewards=True, greedy_baseline=True)


def _build_passk(s: Any) -> Algorithm:
    from rlcore_algorithms.baselines import PassKAdvantage

    std = s.std if s.normalize_std else "none"
    return Algorithm(advantages=PassKAdvantage(std=std, eps=float(s.eps)), loss=ppo_clip(s))


SPECS = (
    AlgorithmSpec(
        name="reinforce_pp", factory=with_advantage(ppo_clip, "reinforce_pp"), settings=ReinforcePPSettings,
        validate=_check_reinforce, loss_agg="token-mean",
        description="per-token returns, step-wide normalisation + PPO-clip",
        source=f"Hu 2025, REINFORCE++ (arXiv:2501.03262); {PPO_SOURCE}",
    ),
    AlgorithmSpec(
        name="reinforce_pp_baseline", factory=with_advantage(ppo_clip, "reinforce_pp_baseline"),
        settings=PPOClipSettings, validate=check_clip, loss_agg="token-mean",
        description="group-mean baseline, step-wide normalisation + PPO-clip",
        source=f"Hu 2025, REINFORCE++ (arXiv:2501.03262) §3.2; {PPO_SOURCE}",
    ),
    AlgorithmSpec(
        name="opo", factory=_build_opo, settings=PPOClipSettings, validate=check_clip,
        loss_agg="token-mean", description="length-weighted group baseline + PPO-clip",
        source=f"On-Policy RL with Optimal Reward Baseline (arXiv:2505.23585); verl compute_opo_outcome_advantage; "
               f"{PPO_SOURCE}",
    ),
    AlgorithmSpec(
        name="remax", factory=_build_remax, settings=PPOClipSettings, validate=_check_remax,
        loss_agg="token-mean", single_turn=True, description="REINFORCE with the greedy response's reward as baseline (one more "
        "generation per step) + PPO-clip", source=f"Li et al. 2023, ReMax (arXiv:2310.10505); verl "
        f"compute_remax_outcome_advantage; {PPO_SOURCE}",
    ),
    AlgorithmSpec(
        name="grpo_passk", factory=_build_passk, settings=PassKSettings, validate=check_grpo,
        loss_agg="token-mean", description="only each group's best sample learns (gap to the second) + PPO-clip",
        source=f"verl compute_grpo_passk_outcome_advantage (arXiv:2503.19595); {PPO_SOURCE}",
    ),
    AlgorithmSpec(
        name="gdpo", factory=_build_gdpo, settings=GDPOSettings, validate=_check_gdpo, loss_agg="token-mean",
        description="each reward component group-normalised separately, summed, step-normalised + PPO-clip",
        source=f"Liu et al. 2026, GDPO (arXiv:2601.05242), NVlabs/GDPO verl-GDPO; {PPO_SOURCE}",
    ),
    AlgorithmSpec(
        name="optimal_token_baseline", factory=_build_otb, settings=OptimalTokenBaselineSettings,
        validate=_check_otb, loss_agg="token-mean", head_needs=frozenset({Cap.SUM_PI_SQUARED}),
        description="per-token baseline: the group's returns weighted by each path's accumulated "
        "‖onehot − π‖² (needs Σπ² from the head) + PPO-clip",
        source=f"verl compute_optimal_token_baseline_advantage (docs/algo/otb.md); {PPO_SOURCE}",
    ),
)
