"""rlcore-algorithms' algorithms with their own policy loss (:mod:`.losses`, :mod:`.surrogates`)
over an outcome estimator chosen by ``algorithm.advantage``: GSPO, CISPO, SAPO, GPG, Clip-Cov, KL-Cov, GMPO, DPPO (binary TV
and KL) and DRO. Each spec carries its settings dataclass and their check; docs/algorithms.md
gives formula, settings and source."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlcore.algorithms import (
    STD_MODES,
    Algorithm,
    AlgorithmSpec,
    bad_value,
    check_choice,
    check_clip,
    check_positive,
)

from rlcore_algorithms.outcome import ADVANTAGES, with_advantage


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


def check_estimator(s: Any) -> None:
    """``algorithm.advantage`` and ``algorithm.std`` of an algorithm that takes an estimator by name."""
    check_choice(s, "advantage", ADVANTAGES)
    check_choice(s, "std", STD_MODES)


def _check_fraction(s: Any, key: str) -> None:
    if not 0 < float(s[key]) <= 1:
        raise bad_value(key, "must be in (0, 1] (a fraction of the loss tokens)")


def _check_clipped(ppo_low: bool):
    def check(s: Any) -> None:
        check_clip(s, ppo_low=ppo_low)
        check_estimator(s)
    return check


def _check_sapo(s: Any) -> None:
    check_positive(s, "tau_pos", "tau_neg")
    check_estimator(s)


def _check_clip_cov(s: Any) -> None:
    check_clip(s)
    _check_fraction(s, "clip_cov_ratio")
    if float(s.clip_cov_lb) >= float(s.clip_cov_ub):
        raise bad_value("clip_cov_lb", "must be below clip_cov_ub")
    check_estimator(s)


def _check_kl_cov(s: Any) -> None:
    _check_fraction(s, "kl_cov_ratio")
    if float(s.ppo_kl_coef) < 0:
        raise bad_value("ppo_kl_coef", "must be >= 0")
    check_estimator(s)


def _check_dppo(s: Any) -> None:
    check_clip(s, ppo_low=False)
    if float(s.clip_ratio_c) < 1:
        raise bad_value("clip_ratio_c", "must be >= 1 (the detached ratio is truncated at it)")
    check_estimator(s)


def _check_dro(s: Any) -> None:
    if float(s.beta) < 0:
        raise bad_value("beta", "must be >= 0")
    check_estimator(s)


def _check_gpg(s: Any) -> None:
    check_positive(s, "f_norm")


def _gspo(s):
    from rlcore_algorithms.losses import GSPO

    return GSPO(float(s.clip_low), float(s.clip_high))


def _cispo(s):
    from rlcore_algorithms.losses import CISPO

    return CISPO(float(s.clip_low), float(s.clip_high))


def _sapo(s):
    from rlcore_algorithms.surrogates import SAPO

    return SAPO(float(s.tau_pos), float(s.tau_neg))


def _clip_cov(s):
    from rlcore_algorithms.surrogates import ClipCov

    return ClipCov(float(s.clip_low), float(s.clip_high), float(s.clip_cov_ratio), float(s.clip_cov_lb),
                   float(s.clip_cov_ub))


def _kl_cov(s):
    from rlcore_algorithms.surrogates import KLCov

    return KLCov(float(s.kl_cov_ratio), float(s.ppo_kl_coef))


def _gmpo(s):
    from rlcore_algorithms.surrogates import GMPO

    return GMPO(float(s.clip_low), float(s.clip_high))


def _dppo(divergence: str):
    def make(s):
        from rlcore_algorithms.surrogates import DPPO

        return DPPO(divergence, float(s.clip_low), float(s.clip_high), float(s.clip_ratio_c))
    return make


def _dro(s):
    from rlcore_algorithms.surrogates import DRO

    return DRO(float(s.beta))


def _build_gpg(s: Any) -> Algorithm:
    from rlcore_algorithms.baselines import GPGAdvantage
    from rlcore_algorithms.surrogates import GPG

    return Algorithm(advantages=GPGAdvantage(float(s.f_norm)), loss=GPG())


SPECS = (
    AlgorithmSpec(
        name="gspo", factory=with_advantage(_gspo), settings=GSPOSettings, validate=_check_clipped(True),
        loss_agg="seq-mean-token-mean", description="sequence-level (length-normalised) ratio, clipped",
        source="Zheng et al. 2025, Group Sequence Policy Optimization (arXiv:2507.18071) eqs. 5-7, 11-13",
    ),
    AlgorithmSpec(
        name="cispo", factory=with_advantage(_cispo), settings=CISPOSettings, validate=_check_clipped(False),
        loss_agg="token-mean", description="clipped, detached IS weight on REINFORCE (no token dropped)",
        source="MiniMax 2025, MiniMax-M1 (arXiv:2506.13585) eqs. 4-5",
    ),
    AlgorithmSpec(
        name="sapo", factory=with_advantage(_sapo), settings=SAPOSettings, validate=_check_sapo,
        loss_agg="seq-mean-token-mean", description="soft sigmoid gate on the token ratio instead of a hard clip",
        source="Soft Adaptive Policy Optimization (arXiv:2511.20347); verl compute_policy_loss_sapo",
    ),
    AlgorithmSpec(
        name="gpg", factory=_build_gpg, settings=GPGSettings, validate=_check_gpg, loss_agg="token-mean",
        description="REINFORCE on logp, group-mean baseline rescaled by the fraction of nonzero rewards",
        source="GPG (arXiv:2504.02546); verl compute_gpg_outcome_advantage, compute_policy_loss_gpg",
    ),
    AlgorithmSpec(
        name="clip_cov", factory=with_advantage(_clip_cov), settings=ClipCovSettings, validate=_check_clip_cov,
        loss_agg="token-mean", description="PPO-clip; a few high-covariance tokens lose their gradient",
        source="The Entropy Mechanism of RL for Reasoning LMs (arXiv:2505.22617); verl compute_policy_loss_clip_cov",
    ),
    AlgorithmSpec(
        name="kl_cov", factory=with_advantage(_kl_cov), settings=KLCovSettings, validate=_check_kl_cov,
        loss_agg="token-mean", description="policy gradient; |log-ratio| penalty on a few high-covariance tokens",
        source="The Entropy Mechanism of RL for Reasoning LMs (arXiv:2505.22617); verl compute_policy_loss_kl_cov",
    ),
    AlgorithmSpec(
        name="gmpo", factory=with_advantage(_gmpo), settings=GMPOSettings, validate=_check_clipped(False),
        loss_agg="seq-mean-token-mean", description="geometric mean of sign-clipped token ratios per sequence",
        source="Geometric-Mean Policy Optimization (arXiv:2507.20673); verl compute_policy_loss_geo_mean",
    ),
    *(AlgorithmSpec(
        name=f"dppo_{div}", factory=with_advantage(_dppo(div)), settings=settings, validate=_check_dppo,
        loss_agg="token-mean", description=f"REINFORCE with a truncated ratio inside a binary-{div.upper()} "
        f"trust region", source=f"Rethinking the Trust Region in LLM RL (arXiv:2602.04879); verl "
        f"compute_policy_loss_dppo_{div}",
    ) for div, settings in (("tv", DPPOSettings), ("kl", DPPOKLSettings))),
    AlgorithmSpec(
        name="dro", factory=with_advantage(_dro), settings=DROSettings, validate=_check_dro, loss_agg="token-mean",
        description="REINFORCE on logp with a quadratic penalty on the log-ratio to the sampling policy",
        source="Tinker's dro loss; Richemond et al. 2024 (arXiv:2405.19107), Direct Reward Optimization",
    ),
)
