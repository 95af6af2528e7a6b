"""The ``loop:`` section: how generation and training overlap (issue 28). Kept apart from
:mod:`rlcore.config` as :mod:`rlcore.rollout_settings` is; :func:`check_loop` names the key it refuses.

``mode``: ``sync`` (generate, train, push: every sample comes from the weights being trained).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlcore.errors import ConfigError

LOOP_MODES = ("sync",)


@dataclass
class LoopConfig:
    """How a step's generation relates to the training of earlier steps (see the module docstring)."""

    mode: str = "sync"


def check_loop(cfg: Any) -> None:
    """Refuse ``loop:`` settings that cannot hold."""
    mode = cfg.loop.mode
    if mode not in LOOP_MODES:
        raise ConfigError(f"bad value for config key 'loop.mode': {mode!r}; choose one of: {', '.join(LOOP_MODES)}",
                          key="loop.mode")
