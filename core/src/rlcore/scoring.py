"""Built-in rewards, each named in config as ``module:function`` like any other (``data.reward:
rlcore.scoring:math_verify_reward``); docs/tasks.md says what each scores and its edge cases.

They read the row's gold answer from ``meta["answer"]`` (where the dataset loader puts the answer
column, and where a task's :class:`~rlcore.tasks.TaskPrompt` keeps it); an answer that is a list or
tuple holds several accepted answers (any one scores 1).

* :func:`math_verify_reward`: 1.0 when the response's answer (its ``\\boxed{...}``, failing that
  the answer after "answer:"/"final answer is", else the last number or expression) equals the
  gold answer as math-verify decides (``1/2`` = ``0.5`` = ``\\frac{1}{2}``); needs
  ``pip install 'rlcore[math]'``.
* :func:`exact_match_reward` (the whole response), :func:`exact_match_last_line_reward`,
  :func:`exact_match_last_word_reward`: 1.0 when the text equals the answer after
  :func:`normalize_answer` (whitespace, case, one trailing period).
* :func:`boxed_format_reward`: 1.0 when the response has a closed, non-empty ``\\boxed{...}``.
* :func:`regex_reward`: 1.0 when the response matches ``meta["format_pattern"]`` (a row's own) or
  :data:`DEFAULT_FORMAT_PATTERN`; :func:`regex_reward_for` makes a reward for a pattern of your own.
* :func:`by_data_source_reward`: each row scored by the reward that ``data.reward_by_source``
  names for its ``meta["data_source"]`` (verl's per-source choice); a reward factory
  (:func:`rlcore.tasks.reward_factory`).
"""

from __future__ import annotations

import inspect
import logging
import re
import threading
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from rlcore.errors import ConfigError
from rlcore.guards import shorten
from rlcore.tasks import RewardInput, load_callable, resolve_reward, reward_factory

#: the meta key of the gold answer
ANSWER_KEY = "answer"
#: the meta key that names a row's source (the dataset's ``data_source`` column)
SOURCE_KEY = "data_source"
#: the meta key of a row's own pattern for :func:`regex_reward`
PATTERN_KEY = "format_pattern"
#: :func:`regex_reward`'s pattern for rows without ``meta["format_pattern"]``: reasoning in
#: ``<think>...</think>``, then the answer in ``<answer>...</answer>`` and nothing after it
DEFAULT_FORMAT_PATTERN = r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"
#: math-verify's limit on parsing one expression and on comparing two, in seconds, where it can
#: apply it: on the main thread only (it uses ``signal.alarm``). Off the main thread (rlcore's
#: worker thread while ``data.reward_timeout_seconds`` > 0) math-verify runs without its own limit
#: and the call is bounded by ``data.reward_timeout_seconds``
MATH_VERIFY_TIMEOUT_SECONDS = 5

MATH_INSTALL_HINT = "pip install 'rlcore[math]'"


class MetaKeyError(KeyError):
    """A key a built-in reward needs is not in the sample's ``meta`` (a KeyError whose message
    reads as a sentence)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _meta(x: RewardInput, key: str, reward: str) -> Any:
    meta = x.meta if isinstance(x.meta, dict) else {}
    value = meta.get(key)
    if value is None:
        have = ", ".join(repr(k) for k in sorted(meta, key=str)) or "none"
        what = "is None" if key in meta else "is missing"
        raise MetaKeyError(f"{reward} needs meta[{key!r}] and it {what} (meta keys: {have}); a dataset row's "
                           f"answer column or a TaskPrompt's meta supplies it (docs/tasks.md)")
    return value


def _answers(x: RewardInput, reward: str) -> list[str]:
    """The accepted answers of ``x`` as strings (``meta["answer"]``: one, or a list/tuple of them)."""
    value = _meta(x, ANSWER_KEY, reward)
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not values:
        raise MetaKeyError(f"{reward}: meta[{ANSWER_KEY!r}] is an empty list (no accepted answer)")
    return [str(v) for v in values]


# ---------------------------------------------------------------------------- math-verify --

class _QuietTimeoutWarning(logging.Filter):
    """math-verify warns once that its timeout is off; off the main thread rlcore's
    ``data.reward_timeout_seconds`` bounds the call instead, so the warning only misleads."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


_math_verify: Any = None


def _load_math_verify() -> Any:
    global _math_verify
    if _math_verify is None:
        try:
            import math_verify
        except ImportError as exc:
            raise ImportError(f"rlcore.scoring:math_verify_reward needs the math-verify package, which is not "
                              f"installed ({exc}): {MATH_INSTALL_HINT}") from exc
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).addFilter(_QuietTimeoutWarning())
        _math_verify = math_verify
    return _math_verify


def _math_timeout() -> int | None:
    """math-verify's own limit where its signal-based timeout works (the main thread), else None."""
    return MATH_VERIFY_TIMEOUT_SECONDS if threading.current_thread() is threading.main_thread() else None


def _extraction(mv: Any) -> list[Any]:
    # boxed first (priority 0; math-verify's default puts "final answer is" before it), then
    # math-verify's anchored and plain extraction: "answer: 12", else the rightmost $...$ or number.
    # The gold is parsed with the same configs: math-verify caches one compiled set per kind
    return [mv.LatexExtractionConfig(boxed_match_priority=0), mv.ExprExtractionConfig()]


@lru_cache(maxsize=4096)
def _parsed_gold(answer: str, timeout: int | None) -> Any:
    """The gold answer parsed as verl's math-verify reward does: LaTeX inside ``\\boxed{}`` (a bare ``1/2``,
    ``0.5``, ``\\frac{1}{2}``, ``$x=5$`` all parse), else the text as it is."""
    mv = _load_math_verify()
    configs = _extraction(mv)
    text = answer if "\\boxed" in answer else "\\boxed{" + answer + "}"
    gold = mv.parse(text, configs, parsing_timeout=timeout)
    if not gold:
        gold = mv.parse(answer, configs, parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"math-verify cannot parse the gold answer meta[{ANSWER_KEY!r}]={shorten(answer)!r}: "
                         f"fix the row's answer, or score it with exact_match_reward")
    return gold


def math_verify_reward(x: RewardInput) -> float:
    """1.0 when the response's answer equals ``meta["answer"]`` as math-verify decides, else 0.0.

    The response's answer: its ``\\boxed{...}`` (several boxed answers are read together, as a
    set, so hedging between two scores 0 unless the gold is that set); without one that parses,
    the number or expression after "final answer is"/"answer:", else the rightmost ``$...$`` or
    number (``#### 72``, ``1,234``, ``1/2``, ``50%``). A response with none scores 0.0. A gold
    answer math-verify cannot parse raises (every sample of that row would score 0 otherwise).

    On the main thread (``data.reward_timeout_seconds=0`` and ``loop.mode: sync``) math-verify's
    own :data:`MATH_VERIFY_TIMEOUT_SECONDS` limit applies (``signal.alarm``; an expression that
    overruns scores 0); elsewhere it runs without one and ``data.reward_timeout_seconds`` bounds
    the call (an overrun stops the run, naming the sample).
    """
    golds = _answers(x, "rlcore.scoring:math_verify_reward")
    mv = _load_math_verify()
    timeout = _math_timeout()
    pred = mv.parse(x.response_text, _extraction(mv), parsing_timeout=timeout)
    if not pred:
        return 0.0
    for answer in golds:
        if mv.verify(_parsed_gold(answer, timeout), pred, timeout_seconds=timeout):
            return 1.0
    return 0.0


# ---------------------------------------------------------------------------- exact match --

def normalize_answer(text: Any) -> str:
    """``text`` as :func:`exact_match_reward` compares it: stripped, runs of whitespace one space,
    case-folded, and one trailing period dropped (``" The  Answer. "`` -> ``"the answer"``)."""
    out = " ".join(str(text).split()).casefold()
    if out.endswith("."):
        out = out[:-1].rstrip()
    return out


def _matches(candidate: str, x: RewardInput, reward: str) -> float:
    got = normalize_answer(candidate)
    return 1.0 if any(got == normalize_answer(a) for a in _answers(x, reward)) else 0.0


def exact_match_reward(x: RewardInput) -> float:
    """1.0 when the whole response equals ``meta["answer"]`` (or one of a list of them) after
    :func:`normalize_answer`, else 0.0. An empty response scores 0 (an empty answer matches only an
    empty answer)."""
    return _matches(x.response_text, x, "rlcore.scoring:exact_match_reward")


def exact_match_last_line_reward(x: RewardInput) -> float:
    """:func:`exact_match_reward` on the response's last non-blank line (reasoning above it is free)."""
    lines = [line for line in x.response_text.splitlines() if line.strip()]
    return _matches(lines[-1] if lines else "", x, "rlcore.scoring:exact_match_last_line_reward")


def exact_match_last_word_reward(x: RewardInput) -> float:
    """:func:`exact_match_reward` on the response's last whitespace-separated word (its trailing
    period dropped, as :func:`normalize_answer` does: ``... is Paris.`` matches ``paris``)."""
    words = x.response_text.split()
    return _matches(words[-1] if words else "", x, "rlcore.scoring:exact_match_last_word_reward")


# --------------------------------------------------------------------------------- format --

_BOXED = re.compile(r"\\boxed\s*\{")


def last_boxed(text: str) -> str | None:
    """The content of the last closed ``\\boxed{...}`` of ``text`` (braces balanced), or None."""
    found = None
    for m in _BOXED.finditer(text):
        depth, start = 1, m.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    found = text[start:i]
                    break
    return found


def boxed_format_reward(x: RewardInput) -> float:
    """1.0 when the response has a closed ``\\boxed{...}`` with something other than whitespace in
    it (``\\boxed{}`` and an unclosed ``\\boxed{3`` score 0), else 0.0. Says nothing of correctness:
    pair it with :func:`math_verify_reward` (a dict-returning reward of your own, or GDPO)."""
    inner = last_boxed(x.response_text)
    return 1.0 if inner is not None and inner.strip() else 0.0


@lru_cache(maxsize=256)
def _compiled(pattern: str, flags: int) -> re.Pattern[str]:
    return re.compile(pattern, flags)


def regex_reward_for(pattern: str, flags: int = re.DOTALL) -> Callable[[RewardInput], float]:
    """A reward that is 1.0 when ``re.search(pattern, response, flags)`` finds a match, else 0.0
    (anchor with ``^...$`` to require the whole response). For a pattern of your own, in your module::

        answer_tag = regex_reward_for(r"<answer>\\s*\\d+\\s*</answer>")

    then ``data.reward: mymodule:answer_tag``. The pattern is compiled now: a bad one fails at import."""
    compiled = re.compile(pattern, flags)

    def reward(x: RewardInput) -> float:
        return 1.0 if compiled.search(x.response_text) else 0.0

    reward.__name__ = reward.__qualname__ = "regex_reward"
    reward.__doc__ = f"1.0 when the response matches {pattern!r}"
    return reward


def regex_reward(x: RewardInput) -> float:
    """1.0 when the response matches the row's ``meta["format_pattern"]`` (a dataset column) or,
    without one, :data:`DEFAULT_FORMAT_PATTERN` (``<think>...</think>`` then ``<answer>...</answer>``);
    ``re.search`` with ``re.DOTALL``, so ``.`` spans lines and ``^``/``$`` anchor the whole
    response. A pattern that does not compile raises (naming it)."""
    meta = x.meta if isinstance(x.meta, dict) else {}
    pattern = meta.get(PATTERN_KEY) or DEFAULT_FORMAT_PATTERN
    try:
        compiled = _compiled(str(pattern), re.DOTALL)
    except re.error as exc:
        raise ValueError(f"meta[{PATTERN_KEY!r}]={shorten(str(pattern))!r} is not a valid regular "
                         f"expression: {exc}") from exc
    return 1.0 if compiled.search(x.response_text) else 0.0


# ------------------------------------------------------------------------ by data source --

TABLE_KEY = "data.reward_by_source"


@reward_factory
def by_data_source_reward(data: Any) -> Callable[[RewardInput], Any]:
    """``data.reward: rlcore.scoring:by_data_source_reward``: each sample is scored by the reward
    that ``data.reward_by_source`` names for its row's ``meta["data_source"]``::

        data:
          reward: rlcore.scoring:by_data_source_reward
          reward_by_source:
            openai/gsm8k: rlcore.scoring:math_verify_reward
            trivia: rlcore.scoring:exact_match_last_line_reward

    A reward factory (:func:`rlcore.tasks.reward_factory`): called once when the run is built (and
    by ``rlcore check``) with the ``data`` section; every entry is imported then, so a bad one is a
    ``ConfigError`` naming ``data.reward_by_source.<source>`` before the first step. A row whose
    source has no entry (or that has no ``data_source``) raises naming the key and the source.
    The entries should return the same kind of value (all floats, or dicts with the same names):
    a step's samples must agree (docs/tasks.md).
    """
    if isinstance(data, RewardInput):
        raise TypeError("rlcore.scoring:by_data_source_reward is a reward factory: call it with the data config "
                        "section (the trainer does, data.reward_by_source holding the table), then score with what "
                        "it returns")
    table = getattr(data, "reward_by_source", None) or {}
    if not table:
        raise ConfigError(f"{TABLE_KEY} is empty: rlcore.scoring:by_data_source_reward needs a reward per "
                          f"data_source, e.g. {TABLE_KEY}.gsm8k=rlcore.scoring:math_verify_reward", key=TABLE_KEY)
    rewards: dict[str, Callable[[RewardInput], Any]] = {}
    for source, path in table.items():
        key = f"{TABLE_KEY}.{source}"
        if not isinstance(path, str):
            raise ConfigError(f"{key}: {path!r} must be a 'module:function' string", key=key)
        fn = load_callable(path, key)
        if fn is by_data_source_reward:
            raise ConfigError(f"{key}: {path} is the dispatcher itself; name the reward for rows of {source!r}",
                              key=key)
        fn = resolve_reward(fn, data, key)
        try:
            inspect.signature(fn).bind(object())
        except TypeError as exc:
            raise ConfigError(f"{key}: {path} cannot be called with one RewardInput: {exc}", key=key) from exc
        except ValueError:  # no signature to read (a builtin)
            pass
        rewards[str(source)] = fn
    known = ", ".join(repr(s) for s in sorted(rewards))

    def dispatch(x: RewardInput) -> Any:
        meta = x.meta if isinstance(x.meta, dict) else {}
        if SOURCE_KEY not in meta:
            raise MetaKeyError(f"{TABLE_KEY}: the sample's meta has no {SOURCE_KEY!r} to choose its reward by "
                               f"(meta keys: {', '.join(repr(k) for k in sorted(meta, key=str)) or 'none'}; "
                               f"table: {known})")
        source = str(meta[SOURCE_KEY])
        fn = rewards.get(source)
        if fn is None:
            raise MetaKeyError(f"{TABLE_KEY} has no entry for data_source {source!r}: add "
                               f"{TABLE_KEY}.{source}: module:function (table: {known})")
        return fn(x)

    dispatch.__name__ = dispatch.__qualname__ = "by_data_source_reward"
    return dispatch
