"""Core's environments: ``single_turn`` (one prompt, one completion: the rollout as it always
was) and ``tools`` (the model calls tools from a small registry, bounded by
:func:`rlcore.environments.tools.call_tool`, until it answers).

``tools`` parses a turn (decoded only to read it; the ids the conversation keeps are the
engine's) as a call when it opens with a tool's name (``tool_format: words``: ``calc 7 * 8``; an
empty argument means the task's own ``meta["expression"]``, so a tiny model can call a tool
with one token) or holds ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
(``hermes``). Anything else is the answer: the conversation ends (``answered``) and
``data.reward`` scores it. A call's result becomes the observation ``<observation_prefix>
<output>`` (a failure: ``error <what went wrong>``), encoded once; with a tokenizer that has a
chat template it is rendered as a ``tool`` message (the template's text after a one-message
conversation), so the template's turn markers surround it. Each successful call earns
``tool_call_reward`` for its turn. Its tools are the ``tool`` providers ``environment.tools``
names (built-in ``calc``; rlcore-sandbox's ``python``).
"""

from __future__ import annotations

import json
import re
import warnings
from typing import Any

from rlcore.environments.tools import ToolRegistry, call_tool
from rlcore.types import EnvStep, ToolCall, Turn

_HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


#: how many of the words a tokenizer cannot encode a warning names
UNKNOWN_WORDS_SHOWN = 5


class UnknownWordsWarning(RuntimeWarning):
    """An environment inserted text the run's tokenizer encodes as ``<unk>`` (the tiny model's
    tokenizer knows only ``data.task``'s vocabulary): the model sees the token, not the words."""


def unknown_words(tokenizer: Any, text: str, ids: list[int]) -> list[str]:
    """The words of ``text`` the tokenizer turns into its ``<unk>`` token (``ids``: ``text``
    encoded; checked first, so text without one costs nothing more)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None or unk not in ids:
        return []
    words = dict.fromkeys(text.split())
    return [w for w in words if unk in tokenizer(w, add_special_tokens=False)["input_ids"]]


def warn_unknown_words(words: list[str], environment: str, fix: str) -> None:
    """The one warning an environment gives for words outside the tokenizer's vocabulary."""
    shown = ", ".join(repr(w) for w in words[:UNKNOWN_WORDS_SHOWN])
    more = f" and {len(words) - UNKNOWN_WORDS_SHOWN} more" if len(words) > UNKNOWN_WORDS_SHOWN else ""
    warnings.warn(f"{environment} wrote words its tokenizer does not know, which the model sees as <unk>: {shown}"
                  f"{more} (warned once; {fix})", UnknownWordsWarning, stacklevel=3)


class SingleTurnEnvironment:
    """``single_turn``: every conversation ends after the model's first turn; ``data.reward``
    scores it."""

    def reset(self, prompt: Any, task_prompt: Any) -> Any:
        return None

    def step(self, state: Any, turn: Turn) -> EnvStep:
        return EnvStep(done=True, reason="answered")

    def final_reward(self, state: Any) -> float | None:
        return None


def parse_call(text: str, tool_format: str, registry: ToolRegistry) -> tuple[str, str] | None:
    """``(tool, argument)`` when ``text`` is a tool call in ``tool_format``, else ``None``."""
    if tool_format == "hermes":
        m = _HERMES.search(text)
        if m is None:
            return None
        try:
            call = json.loads(m.group(1))
        except json.JSONDecodeError:
            return "<malformed>", m.group(1)
        if not isinstance(call, dict):
            return "<malformed>", m.group(1)
        args = call.get("arguments", "")
        if isinstance(args, dict):
            args = next(iter(args.values()), "") if len(args) == 1 else json.dumps(args)
        return str(call.get("name", "<malformed>")), str(args)
    words = text.split()
    if words and words[0] in registry:
        return words[0], " ".join(words[1:])
    return None


class ToolEnvironment:
    """``tools``: see the module docstring. ``settings``: the ``environment:`` section;
    ``registry``: the tools (a run's: the ``tool`` providers ``settings.tools`` names)."""

    def __init__(self, tokenizer: Any, settings: Any, registry: ToolRegistry):
        self.tokenizer = tokenizer
        self.settings = settings
        self.registry = registry
        #: whether words outside the tokenizer's vocabulary were warned about (once per environment)
        self.warned_unknown = False

    def reset(self, prompt: Any, task_prompt: Any) -> Any:
        return {"meta": dict(getattr(task_prompt, "meta", None) or getattr(prompt, "meta", {}) or {})}

    def step(self, state: Any, turn: Turn) -> EnvStep:
        s = self.settings
        text = self.tokenizer.decode(turn.ids, skip_special_tokens=True)
        call = parse_call(text, s.tool_format, self.registry)
        if call is None:
            return EnvStep(done=True, reason="answered")
        name, argument = call
        if turn.tool_calls_left <= 0:  # not run: the conversation ends at the limit
            return EnvStep(done=False, tool_calls=[ToolCall(name, False, "over environment.max_tool_calls")])
        if not argument.strip():
            argument = str(state["meta"].get("expression", ""))
        result = call_tool(self.registry, name, argument, timeout=float(s.tool_timeout_seconds),
                           max_chars=int(s.tool_output_chars))
        shown = f"{s.observation_prefix} {result.output}" if result.ok else f"error {result.error}"
        ids = self.observation_ids(shown)[: int(s.observation_tokens)]
        return EnvStep(done=False, observation_ids=ids, reward=float(s.tool_call_reward) if result.ok else 0.0,
                       tool_calls=[ToolCall(name, result.ok, result.error, result.seconds)])

    def final_reward(self, state: Any) -> float | None:
        return None

    def observation_ids(self, text: str) -> list[int]:
        """``text`` as the ids inserted after the model's turn (see the module docstring)."""
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            head = [{"role": "user", "content": "."}]
            before = tok.apply_chat_template(head, tokenize=False)
            after = tok.apply_chat_template([*head, {"role": "tool", "content": text}], tokenize=False,
                                            add_generation_prompt=True)
            if after.startswith(before):
                text = after[len(before):]
        else:
            text = " " + text
        ids = list(tok(text, add_special_tokens=False)["input_ids"])
        if not self.warned_unknown and (words := unknown_words(tok, text, ids)):
            self.warned_unknown = True
            warn_unknown_words(words, "environment 'tools'", "the tiny model's tokenizer has data.task's vocab: add "
                               "the words a tool writes to the task's vocab, or use a model with its own tokenizer")
        return ids
