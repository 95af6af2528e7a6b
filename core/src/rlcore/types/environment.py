"""Environments: what answers the model's turns in a multi-turn rollout (issue 29).

What an ``environment`` provider builds (:class:`Environment`), what it is handed per turn
(:class:`Turn`) and what it answers (:class:`EnvStep`, with the :class:`ToolCall`\\ s it ran).
Import these from :mod:`rlcore.types`.

Everything is token ids: the model's turn arrives as the exact ids the rollout engine produced,
and the observation goes back as the exact ids core inserts into the conversation; core never
decodes and re-encodes what is already there (an environment may decode a turn to parse it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

from rlcore.types.providers import ProviderSpec


@dataclass(frozen=True)
class EnvironmentSpec(ProviderSpec):
    """An environment provider: ``factory(ctx: BuildContext) -> Environment``, selected by
    ``environment.name`` (built-in ``single_turn`` and ``tools``). The factory gets the run's
    config (``ctx.config.environment``: limits, tools), the plugin's own section as
    ``ctx.settings``, the training engine (``ctx.engine.tokenizer``) and the task
    (``ctx.extras["task"]``). ``uses_tools``: the environment calls the tools ``environment.tools``
    names (each a ``tool`` provider, selected when the config is resolved); its factory gets them
    built, in that order, as ``ctx.extras["tools"]`` (a list of
    :class:`~rlcore.environments.tools.Tool`). ``multi_turn``: false for an environment of one
    prompt and one completion (the built-in ``single_turn``): an algorithm whose spec is
    ``single_turn`` runs only with such an environment, and no conversation metrics are logged."""

    uses_tools: bool = False
    multi_turn: bool = True
    kind: str = field(default="environment", init=False, repr=False)


@dataclass(frozen=True)
class ToolSpec(ProviderSpec):
    """A tool an environment calls: ``factory(ctx: BuildContext) -> Tool``
    (:class:`rlcore.environments.tools.Tool`), selected **many at a time** by the list
    ``environment.tools`` for an environment whose spec ``uses_tools`` (built-in ``calc``; the
    code tool ``python`` comes with rlcore-sandbox). The factory gets the run's config and the
    providing plugin's own section as ``ctx.settings``; it runs once per run, before the
    environment is built, and raises :class:`rlcore.errors.ConfigError` where its tool cannot
    work on this machine."""

    kind: str = field(default="tool", init=False, repr=False)
    selects: ClassVar[Literal["one", "many"]] = "many"


@dataclass
class Turn:
    """The model's turn in one conversation: ``ids`` are exactly the tokens the rollout engine
    generated this turn (stop token included when it stopped on one), ``finish_reason``
    ``"stop"`` or ``"length"``; ``index`` counts turns from 0; ``context_ids`` is the whole
    conversation so far (prompt, earlier turns and observations, this turn);
    ``tool_calls_left``: how many tool calls the conversation may still make."""

    ids: list[int]
    finish_reason: str
    index: int
    context_ids: list[int]
    tool_calls_left: int


@dataclass
class ToolCall:
    """One tool call an environment ran: the tool's name, whether it succeeded (``ok`` false:
    it raised, timed out, was unknown or returned garbage; ``error`` says which), and seconds."""

    tool: str
    ok: bool
    error: str = ""
    seconds: float = 0.0


@dataclass
class EnvStep:
    """An environment's answer to a turn.

    ``done``: the conversation ends here (``observation_ids`` is then ignored). Otherwise
    ``observation_ids`` are inserted verbatim after the turn and the model takes the next turn.
    ``reward``: this turn's reward (added to the sample's reward; estimators that take
    per-token rewards see it on the turn's last token). ``tool_calls``: the calls this turn
    made. ``reason``: why the conversation ended, when ``done`` (``"answered"``,
    ``"no_tool_call"``, ...).
    """

    done: bool
    observation_ids: Sequence[int] = ()
    reward: float = 0.0
    tool_calls: list[ToolCall] = field(default_factory=list)
    reason: str = ""


@runtime_checkable
class Environment(Protocol):
    """What an :class:`EnvironmentSpec`'s factory returns. Core calls ``reset`` once per
    conversation, ``step`` after each of the model's turns until it answers ``done`` or a limit
    of ``environment:`` ends the conversation, then ``final_reward``.

    ``reset(prompt, task_prompt)``: the state of a new conversation (any object; the prompt's
    ``ids`` and ``meta``, the task's :class:`~rlcore.tasks.TaskPrompt`). ``step(state, turn)``:
    an :class:`EnvStep`; it must not raise for anything the model wrote (a bad tool call is an
    observation saying so). ``final_reward(state)``: the conversation's outcome reward, or
    ``None`` to have ``data.reward`` score the sample (with every turn and observation as its
    response), as a single-turn run does.
    """

    def reset(self, prompt: Any, task_prompt: Any) -> Any: ...

    def step(self, state: Any, turn: Turn) -> EnvStep: ...

    def final_reward(self, state: Any) -> float | None: ...
