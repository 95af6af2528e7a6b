"""The built-in ``algorithm`` providers, registered by this module (the ``algorithms`` entry point
of core/pyproject.toml) from the modules beside it, which import only downwards (:mod:`.common`
below all of them):

- :mod:`.ppo_clip`: outcome estimators under the PPO-clip loss (GRPO, Dr.GRPO, RLOO, REINFORCE++,
  OPO, ReMax, GRPO pass@k);
- :mod:`.surrogates`: the other policy losses (GSPO, CISPO, SAPO, GPG, Clip/KL-Cov, GMPO, DPPO, DRO);
- :mod:`.ppo`: PPO with a critic (GAE from a value model), and the engine capability it needs.

Each spec carries its settings dataclass (its keys under ``algorithm:``, beside core's
``loss_agg``, ``kl_*``, ``entropy_coef``, ``mismatch``, ``dapo`` ...) and their check. Cheap to
import: the factories import torch and the implementations of :mod:`rlcore.algorithms`."""

from __future__ import annotations

from rlcore import PLUGIN_API, hookimpl
from rlcore.builtin.algorithms import ppo, ppo_clip, surrogates

__all__ = ["PLUGIN_API", "algorithm", "constraints"]


@hookimpl
def algorithm():
    yield from ppo_clip.SPECS
    yield from surrogates.SPECS
    yield ppo.SPEC


@hookimpl
def constraints():
    yield ppo.NEEDS_VALUE_MODEL
