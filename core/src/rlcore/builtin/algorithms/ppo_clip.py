"""Core's built-in algorithms that put an outcome advantage estimator under the PPO-clip loss:
GRPO, Dr.GRPO and RLOO (the others, REINFORCE++, OPO, ReMax, GDPO ..., are rlcore-algorithms').
Each spec carries its settings dataclass and their check; the estimators are the public ones of
:mod:`rlcore.algorithms` (``GRPOAdvantage`` ...), imported when a factory runs."""

from __future__ import annotations

from rlcore.algorithms.common import (
    PPO_SOURCE,
    GRPOSettings,
    PPOClipSettings,
    check_clip,
    check_grpo,
    ppo_clip,
    with_estimator,
)
from rlcore.algorithms.spec import AlgorithmSpec

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
)
