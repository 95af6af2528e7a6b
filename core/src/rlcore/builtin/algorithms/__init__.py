"""Core's built-in ``algorithm`` providers (the ``core_algorithms`` entry point of
core/pyproject.toml), registered by this module from the modules beside it:

- :mod:`.ppo_clip`: outcome estimators under the PPO-clip loss (GRPO, Dr.GRPO, RLOO);
- :mod:`.ppo`: PPO with a critic (GAE from a value model), and the engine capability it needs.

The rest of the zoo (REINFORCE++, OPO, ReMax, GRPO pass@k, GDPO, the optimal-token baseline,
GSPO, CISPO, SAPO, GPG, Clip/KL-Cov, GMPO, DPPO, DRO) is the ``rlcore-algorithms`` distribution
(``plugins: [algorithms]``), registered through the same hook. Each spec carries its settings
dataclass (its keys under ``algorithm:``, beside core's ``loss_agg``, ``kl_*``, ``entropy_coef``,
``mismatch``, ``dapo`` ...) and their check. Cheap to import: the factories import torch and the
implementations of :mod:`rlcore.algorithms`."""

from __future__ import annotations

from rlcore import PLUGIN_API, hookimpl
from rlcore.builtin.algorithms import ppo, ppo_clip

__all__ = ["PLUGIN_API", "algorithm", "constraints"]


@hookimpl
def algorithm():
    yield from ppo_clip.SPECS
    yield ppo.SPEC


@hookimpl
def constraints():
    yield ppo.NEEDS_VALUE_MODEL
