"""The ``environment:`` section: what answers the model's turns (issue 29). Kept apart from
:mod:`rlcore.config` as :mod:`rlcore.rollout_settings` is; :func:`check_environment` names the key
it refuses.

``name``: the environment provider; ``single_turn`` (one prompt, one completion, scored by
``data.reward``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlcore.errors import ConfigError


@dataclass
class EnvironmentConfig:
    """Which environment takes the model's turns (see the module docstring)."""

    name: str = "single_turn"


def check_environment(cfg: Any) -> None:
    """Refuse ``environment:`` settings that cannot hold."""
    if not str(cfg.environment.name):
        raise ConfigError("config key 'environment.name' is empty: name an environment provider "
                          "(single_turn is built in)", key="environment.name")
