"""The ``environment:`` section: what answers the model's turns (issue 29; docs/agents.md). Kept
apart from :mod:`rlcore.config` as :mod:`rlcore.rollout_settings` is; :func:`check_environment`
names the key it refuses.

* ``name``: the environment provider; ``single_turn`` (one prompt, one completion, scored by
  ``data.reward``) or ``tools`` (the model calls tools), or a plugin's.
* Limits per conversation (each ends the sample with its name in ``Sample.extras["end_reason"]``):
  ``max_turns`` (model turns), ``max_total_tokens`` (prompt + every turn + every observation;
  0: no limit beyond ``rollout.max_new_tokens`` per turn), ``max_tool_calls``.
* Tools (``tools`` environment): ``tools`` (the ``tool`` providers it calls: built-in ``calc``;
  ``python`` comes with rlcore-sandbox), ``tool_timeout_seconds`` and ``tool_output_chars`` (every call),
  ``observation_tokens`` (the most tokens one observation inserts), ``tool_call_reward`` (a
  per-turn reward for each successful call), ``tool_format`` (``words``: the turn's first word
  names the tool, the rest is its argument; ``hermes``: ``<tool_call>{"name": ..., "arguments":
  ...}</tool_call>``), ``observation_prefix`` (the words before a tool's output).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlcore.errors import ConfigError

TOOL_FORMATS = ("words", "hermes")


@dataclass
class EnvironmentConfig:
    """Which environment takes the model's turns, and its limits (see the module docstring)."""

    name: str = "single_turn"
    max_turns: int = 4
    max_total_tokens: int = 0
    max_tool_calls: int = 4
    tools: list[str] = field(default_factory=lambda: ["calc"])
    tool_timeout_seconds: float = 5.0
    tool_output_chars: int = 512
    observation_tokens: int = 64
    tool_call_reward: float = 0.0
    tool_format: str = "words"
    observation_prefix: str = "result"


def check_environment(cfg: Any) -> None:
    """Refuse ``environment:`` settings that cannot hold."""
    env = cfg.environment
    if not str(env.name):
        raise ConfigError("config key 'environment.name' is empty: name an environment provider "
                          "(single_turn and tools are built in)", key="environment.name")
    positive = {"environment.max_turns": env.max_turns, "environment.tool_timeout_seconds": env.tool_timeout_seconds,
                "environment.tool_output_chars": env.tool_output_chars,
                "environment.observation_tokens": env.observation_tokens}
    for key, val in positive.items():
        if not val > 0:
            raise ConfigError(f"bad value for config key {key!r}: {val}; it must be > 0", key=key)
    for key, val in {"environment.max_total_tokens": env.max_total_tokens,
                     "environment.max_tool_calls": env.max_tool_calls}.items():
        if val < 0:
            raise ConfigError(f"bad value for config key {key!r}: {val}; it must be >= 0 (max_total_tokens 0: no "
                              f"limit)", key=key)
    if env.tool_format not in TOOL_FORMATS:
        raise ConfigError(f"bad value for config key 'environment.tool_format': {env.tool_format!r}; choose one of "
                          f"{', '.join(TOOL_FORMATS)}", key="environment.tool_format")
    # an algorithm that is single-turn only (AlgorithmSpec.single_turn: ReMax) is refused with a
    # multi-turn environment where the spec is known (rlcore.config._resolve_algorithm)
