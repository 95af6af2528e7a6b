"""Built-in ``algorithm`` providers added beside GRPO's family (issue 30): SAPO, GPG, Clip-Cov,
KL-Cov, GMPO, DPPO (binary TV and KL), DRO, OPO, ReMax and pass@k, yielded by
:func:`rlcore.builtin.algorithms.algorithm`. Each has its own settings under ``algorithm:``;
docs/algorithms.md lists formula, settings and source. Cheap to import: the factories import
torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlcore.algorithm_settings import check_clip
from rlcore.algorithms.spec import Algorithm, AlgorithmSpec
from rlcore.builtin.algorithms import (
    PPO,
    GRPOSettings,
    _check_choice,
    _estimator,
    _ppo,
    _validate_grpo,
)
from rlcore.errors import ConfigError

__all__ = ["specs"]


@dataclass
class SAPOSettings:
    """``tau_pos``/``tau_neg``: the gate's temperatures for positive / non-positive advantages."""

    tau_pos: float = 1.0
    tau_neg: float = 1.05
    advantage: str = "grpo"
    std: str = "population"


@dataclass
class GPGSettings:
    """``f_norm``: GPG's advantage divisor F."""

    f_norm: float = 1.0


@dataclass
class ClipCovSettings:
    """PPO clip ranges (no dual-clip) and the covariance band and fraction of detached tokens."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    advantage: str = "grpo"
    std: str = "population"


@dataclass
class KLCovSettings:
    """The fraction of tokens penalised and the coefficient κ of ``|logp − old|`` on them."""

    kl_cov_ratio: float = 2e-4
    ppo_kl_coef: float = 1.0
    advantage: str = "grpo"
    std: str = "population"


@dataclass
class GMPOSettings:
    """Log-ratio clip range (−clip_low, clip_high) per token."""

    clip_low: float = 0.4
    clip_high: float = 0.4
    advantage: str = "grpo"
    std: str = "population"


@dataclass
class DPPOSettings:
    """``clip_low``/``clip_high``: the divergence thresholds δ_l / δ_h (TV: probability
    difference; KL: binary KL in nats); ``clip_ratio_c``: the truncation of the detached ratio."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_ratio_c: float = 20.0
    advantage: str = "grpo"
    std: str = "population"


@dataclass
class DPPOKLSettings(DPPOSettings):
    clip_low: float = 0.05
    clip_high: float = 0.05


@dataclass
class DROSettings:
    """``beta``: the weight of the quadratic log-ratio penalty."""

    beta: float = 1.0
    advantage: str = "grpo"
    std: str = "population"


@dataclass
class PassKSettings(GRPOSettings):
    """PPO-clip settings and the group std the gap is divided by (``none``: not divided)."""


def _positive(s: Any, *keys: str) -> None:
    for key in keys:
        if not float(s[key]) > 0:
            raise ConfigError(f"bad value for config key 'algorithm.{key}': must be > 0", key=f"algorithm.{key}")


def _fraction(s: Any, key: str) -> None:
    if not 0 < float(s[key]) <= 1:
        raise ConfigError(f"bad value for config key 'algorithm.{key}': must be in (0, 1] (a fraction of the loss "
                          f"tokens)", key=f"algorithm.{key}")


def _validate_sapo(s: Any) -> None:
    _positive(s, "tau_pos", "tau_neg")
    _check_choice_pair(s)


def _check_choice_pair(s: Any) -> None:
    from rlcore.builtin.algorithms import ADVANTAGES, STD_MODES

    _check_choice(s, "advantage", ADVANTAGES)
    _check_choice(s, "std", STD_MODES)


def _validate_clip_cov(s: Any) -> None:
    check_clip(s)
    _fraction(s, "clip_cov_ratio")
    if float(s.clip_cov_lb) >= float(s.clip_cov_ub):
        raise ConfigError("bad value for config key 'algorithm.clip_cov_lb': must be below clip_cov_ub",
                          key="algorithm.clip_cov_lb")
    _check_choice_pair(s)


def _validate_kl_cov(s: Any) -> None:
    _fraction(s, "kl_cov_ratio")
    if float(s.ppo_kl_coef) < 0:
        raise ConfigError("bad value for config key 'algorithm.ppo_kl_coef': must be >= 0", key="algorithm.ppo_kl_coef")
    _check_choice_pair(s)


def _validate_gmpo(s: Any) -> None:
    check_clip(s, ppo_low=False)
    _check_choice_pair(s)


def _validate_dppo(s: Any) -> None:
    check_clip(s, ppo_low=False)
    if float(s.clip_ratio_c) < 1:
        raise ConfigError("bad value for config key 'algorithm.clip_ratio_c': must be >= 1 (the detached ratio is "
                          "truncated at it)", key="algorithm.clip_ratio_c")
    _check_choice_pair(s)


def _with(loss_factory):
    """An algorithm of ``loss_factory(settings)`` and the estimator ``settings.advantage``."""
    def build(s: Any) -> Algorithm:
        return Algorithm(advantages=_estimator(s.advantage, s), loss=loss_factory(s),
                         token_level_rewards=s.advantage.startswith("reinforce_pp"))
    return build


def _sapo(s):
    from rlcore.algorithms.surrogates import SAPO

    return SAPO(float(s.tau_pos), float(s.tau_neg))


def _clip_cov(s):
    from rlcore.algorithms.surrogates import ClipCov

    return ClipCov(float(s.clip_low), float(s.clip_high), float(s.clip_cov_ratio), float(s.clip_cov_lb),
                   float(s.clip_cov_ub))


def _kl_cov(s):
    from rlcore.algorithms.surrogates import KLCov

    return KLCov(float(s.kl_cov_ratio), float(s.ppo_kl_coef))


def _gmpo(s):
    from rlcore.algorithms.surrogates import GMPO

    return GMPO(float(s.clip_low), float(s.clip_high))


def _dppo(divergence: str):
    def make(s):
        from rlcore.algorithms.surrogates import DPPO

        return DPPO(divergence, float(s.clip_low), float(s.clip_high), float(s.clip_ratio_c))
    return make


def _dro(s):
    from rlcore.algorithms.surrogates import DRO

    return DRO(float(s.beta))


def _validate_dro(s: Any) -> None:
    if float(s.beta) < 0:
        raise ConfigError("bad value for config key 'algorithm.beta': must be >= 0", key="algorithm.beta")
    _check_choice_pair(s)


def _build_gpg(s: Any) -> Algorithm:
    from rlcore.algorithms.baselines import GPGAdvantage
    from rlcore.algorithms.surrogates import GPG

    return Algorithm(advantages=GPGAdvantage(float(s.f_norm)), loss=GPG())


def _build_opo(s: Any) -> Algorithm:
    from rlcore.algorithms.baselines import OPOAdvantage

    return Algorithm(advantages=OPOAdvantage(), loss=_ppo(s))


def _build_passk(s: Any) -> Algorithm:
    from rlcore.algorithms.baselines import PassKAdvantage

    std = s.std if s.normalize_std else "none"
    return Algorithm(advantages=PassKAdvantage(std=std, eps=float(s.eps)), loss=_ppo(s))


def _validate_gpg(s: Any) -> None:
    _positive(s, "f_norm")


def _build_remax(s: Any) -> Algorithm:
    from rlcore.algorithms.remax import ReMaxAdvantage

    return Algorithm(advantages=ReMaxAdvantage(), loss=_ppo(s), token_level_rewards=True, greedy_baseline=True)


def _validate_remax(s: Any) -> None:
    check_clip(s)
    dapo = s.get("dapo")
    if dapo is not None and dapo.dynamic_sampling.enable:
        raise ConfigError("algorithm.name=remax takes its greedy baselines for the step's own prompts; DAPO's dynamic "
                          "sampling draws more rounds of prompts: set algorithm.dapo.dynamic_sampling.enable=false",
                          key="algorithm.dapo.dynamic_sampling.enable")


def specs():
    from rlcore.builtin.algorithms import PPOClipSettings

    yield AlgorithmSpec(
        name="sapo", factory=_with(_sapo), settings=SAPOSettings, validate=_validate_sapo,
        loss_agg="seq-mean-token-mean", description="soft sigmoid gate on the token ratio instead of a hard clip",
        source="Soft Adaptive Policy Optimization (arXiv:2511.20347); verl compute_policy_loss_sapo",
    )
    yield AlgorithmSpec(
        name="gpg", factory=_build_gpg, settings=GPGSettings, validate=_validate_gpg, loss_agg="token-mean",
        description="REINFORCE on logp, group-mean baseline rescaled by the fraction of nonzero rewards",
        source="GPG (arXiv:2504.02546); verl compute_gpg_outcome_advantage, compute_policy_loss_gpg",
    )
    yield AlgorithmSpec(
        name="clip_cov", factory=_with(_clip_cov), settings=ClipCovSettings, validate=_validate_clip_cov,
        loss_agg="token-mean", description="PPO-clip; a few high-covariance tokens lose their gradient",
        source="The Entropy Mechanism of RL for Reasoning LMs (arXiv:2505.22617); verl compute_policy_loss_clip_cov",
    )
    yield AlgorithmSpec(
        name="kl_cov", factory=_with(_kl_cov), settings=KLCovSettings, validate=_validate_kl_cov,
        loss_agg="token-mean", description="policy gradient; |log-ratio| penalty on a few high-covariance tokens",
        source="The Entropy Mechanism of RL for Reasoning LMs (arXiv:2505.22617); verl compute_policy_loss_kl_cov",
    )
    yield AlgorithmSpec(
        name="gmpo", factory=_with(_gmpo), settings=GMPOSettings, validate=_validate_gmpo,
        loss_agg="seq-mean-token-mean", description="geometric mean of sign-clipped token ratios per sequence",
        source="Geometric-Mean Policy Optimization (arXiv:2507.20673); verl compute_policy_loss_geo_mean",
    )
    for div, settings in (("tv", DPPOSettings), ("kl", DPPOKLSettings)):
        yield AlgorithmSpec(
            name=f"dppo_{div}", factory=_with(_dppo(div)), settings=settings, validate=_validate_dppo,
            loss_agg="token-mean", description=f"REINFORCE with a truncated ratio inside a binary-{div.upper()} "
            f"trust region", source=f"Rethinking the Trust Region in LLM RL (arXiv:2602.04879); verl "
            f"compute_policy_loss_dppo_{div}",
        )
    yield AlgorithmSpec(
        name="dro", factory=_with(_dro), settings=DROSettings, validate=_validate_dro, loss_agg="token-mean",
        description="REINFORCE on logp with a quadratic penalty on the log-ratio to the sampling policy",
        source="Tinker's dro loss; Richemond et al. 2024 (arXiv:2405.19107), Direct Reward Optimization",
    )
    yield AlgorithmSpec(
        name="opo", factory=_build_opo, settings=PPOClipSettings, validate=lambda s: check_clip(s),
        loss_agg="token-mean", description="length-weighted group baseline + PPO-clip",
        source=f"On-Policy RL with Optimal Reward Baseline (arXiv:2505.23585); verl compute_opo_outcome_advantage; {PPO}",
    )
    yield AlgorithmSpec(
        name="remax", factory=_build_remax, settings=PPOClipSettings, validate=_validate_remax,
        loss_agg="token-mean", description="REINFORCE with the greedy response's reward as baseline (one more "
        "generation per step) + PPO-clip", source=f"Li et al. 2023, ReMax (arXiv:2310.10505); verl "
        f"compute_remax_outcome_advantage; {PPO}",
    )
    yield AlgorithmSpec(
        name="grpo_passk", factory=_build_passk, settings=PassKSettings, validate=_validate_grpo,
        loss_agg="token-mean", description="only each group's best sample learns (gap to the second) + PPO-clip",
        source=f"verl compute_grpo_passk_outcome_advantage (arXiv:2503.19595); {PPO}",
    )
