"""The built-in algorithms that put an outcome advantage estimator under the PPO-clip loss:
GRPO, Dr.GRPO, RLOO, REINFORCE++ (and its baseline variant), OPO, ReMax, GRPO pass@k, GDPO and the
optimal-token baseline. Each
spec carries its settings dataclass and their check; the estimators are the public ones of
:mod:`rlcore.algorithms` (``GRPOAdvantage`` ...), imported when a factory runs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from rlcore.algorithms.spec import Algorithm, AlgorithmSpec
from rlcore.builtin.algorithms.common import (
    PPO_SOURCE,
    GRPOSettings,
    PPOClipSettings,
    check_clip,
    check_grpo,
    check_positive,
    ppo_clip,
    with_estimator,
)
from rlcore.errors import ConfigError
from rlcore.types.providers import Cap


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
    from rlcore.algorithms.advantages import GDPOAdvantage

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
    from rlcore.algorithms.token_baseline import OptimalTokenBaselineAdvantage

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
    from rlcore.algorithms.baselines import OPOAdvantage

    return Algorithm(advantages=OPOAdvantage(), loss=ppo_clip(s))


def _build_remax(s: Any) -> Algorithm:
    from rlcore.algorithms.remax import ReMaxAdvantage

    return Algorithm(advantages=ReMaxAdvantage(), loss=ppo_clip(s), token_level_rewards=True, greedy_baseline=True)


def _build_passk(s: Any) -> Algorithm:
    from rlcore.algorithms.baselines import PassKAdvantage

    std = s.std if s.normalize_std else "none"
    return Algorithm(advantages=PassKAdvantage(std=std, eps=float(s.eps)), loss=ppo_clip(s))


SPECS = (
    AlgorithmSpec(
        name="grpo", factory=with_estimator(ppo_clip, "grpo"), settings=GRPOSettings, validate=check_grpo,
        loss_agg="token-mean", description="group-normalised advantages + PPO-clip",
        source=f"Shao et al. 2024, DeepSeekMath (arXiv:2402.03300) §4.1.2; {PPO_SOURCE}",
    ),
    AlgorithmSpec(
        name="dr_grpo", factory=with_estimator(ppo_clip, "dr_grpo"), settings=PPOClipSettings, validate=check_clip,
        loss_agg="seq-mean-token-sum-norm", description="mean-centred group advantages, constant length normaliser",
        source=f"Liu et al. 2025, Understanding R1-Zero-Like Training (arXiv:2503.20783); {PPO_SOURCE}",
    ),
    AlgorithmSpec(
        name="rloo", factory=with_estimator(ppo_clip, "rloo"), settings=PPOClipSettings, validate=check_clip,
        loss_agg="token-mean", description="leave-one-out baseline + PPO-clip",
        source=f"Ahmadian et al. 2024 (arXiv:2402.14740) eq. 7; Kool et al. 2019; {PPO_SOURCE}",
    ),
    AlgorithmSpec(
        name="reinforce_pp", factory=with_estimator(ppo_clip, "reinforce_pp"), settings=ReinforcePPSettings,
        validate=_check_reinforce, loss_agg="token-mean",
        description="per-token returns, step-wide normalisation + PPO-clip",
        source=f"Hu 2025, REINFORCE++ (arXiv:2501.03262); {PPO_SOURCE}",
    ),
    AlgorithmSpec(
        name="reinforce_pp_baseline", factory=with_estimator(ppo_clip, "reinforce_pp_baseline"),
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
        loss_agg="token-mean", description="REINFORCE with the greedy response's reward as baseline (one more "
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
