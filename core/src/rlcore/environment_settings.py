"""The ``environment:`` section: what answers the model's turns (issue 29; docs/agents.md). Kept
apart from :mod:`rlcore.config` as :mod:`rlcore.rollout_settings` is; :func:`check_environment`
names the key it refuses.

* ``name``: the environment provider; ``single_turn`` (one prompt, one completion, scored by
  ``data.reward``) or ``tools`` (the model calls tools), or a plugin's.
* Limits per conversation (each ends the sample with its name in ``Sample.extras["end_reason"]``):
  ``max_turns`` (model turns), ``max_total_tokens`` (prompt + every turn + every observation;
  0: no limit beyond ``rollout.max_new_tokens`` per turn), ``max_tool_calls``.
* Tools (``tools`` environment): ``tools`` (names in the registry: ``calc``; ``python`` needs
  ``code.enable``), ``tool_timeout_seconds`` and ``tool_output_chars`` (every call),
  ``observation_tokens`` (the most tokens one observation inserts), ``tool_call_reward`` (a
  per-turn reward for each successful call), ``tool_format`` (``words``: the turn's first word
  names the tool, the rest is its argument; ``hermes``: ``<tool_call>{"name": ..., "arguments":
  ...}</tool_call>``), ``observation_prefix`` (the words before a tool's output).
* ``code``: the code-execution tool ``python`` (:mod:`rlcore.environments.sandbox`), off unless
  ``enable``: CPU seconds, memory, wall-clock seconds, output bytes, ``scratch_mb`` (each tmpfs the
  code may write). New processes are refused (one process, threads allowed, bounded by memory).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlcore.errors import ConfigError

TOOL_FORMATS = ("words", "hermes")


@dataclass
class CodeToolConfig:
    """The ``python`` tool's limits (``environment.code``); off unless ``enable``."""

    enable: bool = False
    cpu_seconds: int = 2
    memory_mb: int = 256
    wall_seconds: float = 5.0
    output_bytes: int = 4096
    #: the size of each tmpfs the code may write (its working directory /tmp and /dev/shm)
    scratch_mb: int = 16


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
    code: CodeToolConfig = field(default_factory=CodeToolConfig)


def check_environment(cfg: Any) -> None:
    """Refuse ``environment:`` settings that cannot hold."""
    env = cfg.environment
    if not str(env.name):
        raise ConfigError("config key 'environment.name' is empty: name an environment provider "
                          "(single_turn and tools are built in)", key="environment.name")
    positive = {"environment.max_turns": env.max_turns, "environment.tool_timeout_seconds": env.tool_timeout_seconds,
                "environment.tool_output_chars": env.tool_output_chars,
                "environment.observation_tokens": env.observation_tokens,
                "environment.code.cpu_seconds": env.code.cpu_seconds, "environment.code.memory_mb": env.code.memory_mb,
                "environment.code.wall_seconds": env.code.wall_seconds,
                "environment.code.scratch_mb": env.code.scratch_mb,
                "environment.code.output_bytes": env.code.output_bytes}
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
    if "python" in list(env.tools) and not env.code.enable:
        raise ConfigError("config key 'environment.tools' lists 'python', the code-execution tool, which is off unless "
                          "configured: set environment.code.enable=true (and its limits under environment.code)",
                          key="environment.tools")
    if "python" in list(env.tools) and env.tool_timeout_seconds < env.code.wall_seconds:
        raise ConfigError(f"bad value for config key 'environment.tool_timeout_seconds': {env.tool_timeout_seconds:g} is "
                          f"below environment.code.wall_seconds={env.code.wall_seconds:g}: a python call would be "
                          f"reported as timed out while its process still runs; raise it to at least the wall limit",
                          key="environment.tool_timeout_seconds")
    if env.name != "single_turn" and cfg.algorithm.name == "remax":
        raise ConfigError(f"environment.name={env.name!r} runs multi-turn conversations, but algorithm.name=remax's "
                          f"greedy baseline is one greedy completion per prompt: use grpo or rloo (their group "
                          f"baselines cover whole conversations), or environment.name=single_turn",
                          key="environment.name")
