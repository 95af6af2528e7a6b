"""Built-in ``algorithm`` providers: GRPO, Dr.GRPO, RLOO, REINFORCE++(-baseline) with the
PPO-clip loss, and GSPO and CISPO. Each has its own settings under ``algorithm:`` (next to core's
``loss_agg``, ``kl_*``, ``entropy_coef``, ``old_logprobs``, ``mismatch``). Cheap to import:
the factories import torch. The losses and estimators they build are the public ones of
:mod:`rlcore.algorithms` (``PPOClip``, ``GSPO``, ``CISPO``, ``GRPOAdvantage`` ...)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlcore import PLUGIN_API, hookimpl
from rlcore.algorithm_settings import check_clip
from rlcore.algorithms.spec import Algorithm, AlgorithmSpec
from rlcore.builtin import ppo
from rlcore.errors import ConfigError

__all__ = ["PLUGIN_API", "algorithm"]

ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
STD_MODES = ("population", "unbiased", "none")


@dataclass
class PPOClipSettings:
    """``clip_low``/``clip_high``: ε of ``clip(r, 1−ε_l, 1+ε_h)``; ``clip_ratio_c``: the
    dual-clip bound for negative advantages (> 1; 0 turns it off)."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_ratio_c: float = 3.0


@dataclass
class GRPOSettings(PPOClipSettings):
    """``std``: the group std GRPO divides by, ``population`` or ``unbiased`` (``none``:
    no division); ``normalize_std: false`` is the older spelling of ``std: none``."""

    std: str = "population"
    normalize_std: bool = True
    eps: float = 1e-6


@dataclass
class ReinforcePPSettings(PPOClipSettings):
    """``gamma``: discount of the per-token returns."""

    gamma: float = 1.0


@dataclass
class GSPOSettings:
    """Sequence-ratio clip ranges (the paper's 3e-4 / 4e-4) and the advantage estimator."""

    clip_low: float = 3e-4
    clip_high: float = 4e-4
    advantage: str = "grpo"
    std: str = "population"


@dataclass
class CISPOSettings:
    """IS-weight clip ranges (``clip_low`` ≥ 1: no lower bound, as the paper) and the
    advantage estimator."""

    clip_low: float = 1.0
    clip_high: float = 0.28
    advantage: str = "grpo"
    std: str = "population"


def _check_choice(s: Any, key: str, choices: tuple[str, ...]) -> None:
    val = s[key]
    if val not in choices:
        raise ConfigError(f"bad value for config key 'algorithm.{key}': {val!r}; choose one of: {', '.join(choices)}",
                          key=f"algorithm.{key}")


def _validate_ppo(s: Any) -> None:
    check_clip(s)


def _validate_grpo(s: Any) -> None:
    check_clip(s)
    _check_choice(s, "std", STD_MODES)
    if float(s.eps) <= 0:
        raise ConfigError("bad value for config key 'algorithm.eps': must be > 0", key="algorithm.eps")


def _validate_reinforce(s: Any) -> None:
    check_clip(s)
    if not 0 < float(s.gamma) <= 1:
        raise ConfigError("bad value for config key 'algorithm.gamma': must be in (0, 1]", key="algorithm.gamma")


def _validate_with_advantage(ppo_low: bool):
    def check(s: Any) -> None:
        check_clip(s, ppo_low=ppo_low)
        _check_choice(s, "advantage", ADVANTAGES)
        _check_choice(s, "std", STD_MODES)
    return check


def _estimator(name: str, s: Any):
    from rlcore.algorithms import advantages as adv

    if name == "grpo":
        std = s.get("std", "population")
        if not s.get("normalize_std", True):
            std = "none"
        return adv.GRPOAdvantage(std=std, eps=float(s.get("eps", 1e-6)))
    if name == "dr_grpo":
        return adv.DrGRPOAdvantage()
    if name == "rloo":
        return adv.RLOOAdvantage()
    if name == "reinforce_pp":
        return adv.ReinforcePPAdvantage(gamma=float(s.get("gamma", 1.0)))
    if name == "reinforce_pp_baseline":
        return adv.ReinforcePPBaselineAdvantage()
    raise ValueError(f"unknown advantage estimator {name!r}")


def _ppo(s: Any):
    from rlcore.algorithms import PPOClip  # the public loss a third-party algorithm can reuse too

    return PPOClip(float(s.clip_low), float(s.clip_high), float(s.clip_ratio_c))


def _ppo_family(estimator: str):
    def build(s: Any) -> Algorithm:
        return Algorithm(advantages=_estimator(estimator, s), loss=_ppo(s),
                         token_level_rewards=estimator.startswith("reinforce_pp"))
    return build


def _build_gspo(s: Any) -> Algorithm:
    from rlcore.algorithms import GSPO

    return Algorithm(advantages=_estimator(s.advantage, s), loss=GSPO(float(s.clip_low), float(s.clip_high)),
                     token_level_rewards=s.advantage.startswith("reinforce_pp"))


def _build_cispo(s: Any) -> Algorithm:
    from rlcore.algorithms import CISPO

    return Algorithm(advantages=_estimator(s.advantage, s), loss=CISPO(float(s.clip_low), float(s.clip_high)),
                     token_level_rewards=s.advantage.startswith("reinforce_pp"))


PPO = "PPO-clip (Schulman et al. 2017) with clip-higher (DAPO) and dual-clip (Ye et al. 2020)"


@hookimpl
def algorithm():
    yield AlgorithmSpec(
        name="grpo", factory=_ppo_family("grpo"), settings=GRPOSettings, validate=_validate_grpo,
        loss_agg="token-mean", description="group-normalised advantages + PPO-clip",
        source=f"Shao et al. 2024, DeepSeekMath (arXiv:2402.03300) §4.1.2; {PPO}",
    )
    yield AlgorithmSpec(
        name="dr_grpo", factory=_ppo_family("dr_grpo"), settings=PPOClipSettings, validate=_validate_ppo,
        loss_agg="seq-mean-token-sum-norm", description="mean-centred group advantages, constant length normaliser",
        source=f"Liu et al. 2025, Understanding R1-Zero-Like Training (arXiv:2503.20783); {PPO}",
    )
    yield AlgorithmSpec(
        name="rloo", factory=_ppo_family("rloo"), settings=PPOClipSettings, validate=_validate_ppo,
        loss_agg="token-mean", description="leave-one-out baseline + PPO-clip",
        source=f"Ahmadian et al. 2024 (arXiv:2402.14740) eq. 7; Kool et al. 2019; {PPO}",
    )
    yield AlgorithmSpec(
        name="reinforce_pp", factory=_ppo_family("reinforce_pp"), settings=ReinforcePPSettings,
        validate=_validate_reinforce, loss_agg="token-mean",
        description="per-token returns, step-wide normalisation + PPO-clip",
        source=f"Hu 2025, REINFORCE++ (arXiv:2501.03262); {PPO}",
    )
    yield AlgorithmSpec(
        name="reinforce_pp_baseline", factory=_ppo_family("reinforce_pp_baseline"), settings=PPOClipSettings,
        validate=_validate_ppo, loss_agg="token-mean",
        description="group-mean baseline, step-wide normalisation + PPO-clip",
        source=f"Hu 2025, REINFORCE++ (arXiv:2501.03262) §3.2; {PPO}",
    )
    yield AlgorithmSpec(
        name="gspo", factory=_build_gspo, settings=GSPOSettings, validate=_validate_with_advantage(True),
        loss_agg="seq-mean-token-mean", description="sequence-level (length-normalised) ratio, clipped",
        source="Zheng et al. 2025, Group Sequence Policy Optimization (arXiv:2507.18071) eqs. 5-7, 11-13",
    )
    yield AlgorithmSpec(
        name="cispo", factory=_build_cispo, settings=CISPOSettings, validate=_validate_with_advantage(False),
        loss_agg="token-mean", description="clipped, detached IS weight on REINFORCE (no token dropped)",
        source="MiniMax 2025, MiniMax-M1 (arXiv:2506.13585) eqs. 4-5",
    )
    from rlcore.builtin.more_algorithms import specs  # SAPO, GPG, Clip/KL-Cov, GMPO, DPPO, OPO, pass@k

    yield from specs()
    yield ppo.SPEC  # PPO with a critic: rlcore/builtin/ppo.py


@hookimpl
def constraints():
    yield ppo.NEEDS_VALUE_MODEL
