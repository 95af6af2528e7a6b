"""Tasks (prompt sources) and rewards. Both are chosen in config as ``module:function``.

A task function takes the ``data`` config section and returns a :class:`Task`: the word-level
vocabulary its prompts and answers use (so a tokenizer can be built locally when the model is
created from scratch) and a prompt generator. A reward function takes a :class:`RewardInput`
and returns a real number; :mod:`rlcore.rewards` calls it (on the writer rank, each call within
``data.reward_timeout_seconds``) and checks what it returns. ``successor`` is the embedded
default: a tiny model trained from scratch learns it by RL alone in a couple of minutes on a
laptop CPU.
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlcore.errors import ConfigError

__all__ = ["RewardInput", "Task", "TaskPrompt", "load_callable", "make_prompts", "resolve_reward", "reward_factory",
           "successor", "successor_reward", "successor_reward_parts", "tool_product", "tool_product_reward"]


@dataclass
class TaskPrompt:
    text: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Task:
    name: str
    vocab: list[str]
    make_prompts: Callable[[random.Random, int], list[TaskPrompt]]
    description: str = ""


@dataclass
class RewardInput:
    """What a reward function sees for one sample."""

    prompt_text: str
    response_text: str
    prompt_ids: list[int]
    response_ids: list[int]
    meta: dict[str, Any]
    finish_reason: str = ""


DIGITS = [str(i) for i in range(10)]


def successor(data_cfg: Any = None) -> Task:
    """Prompt: ``prompt_len`` random digits and ``=``; answer: the last digit plus one (mod 10).

    A random policy answers right about once in |vocab| tries (chance level ~0.07); the reward
    is 1 for a right first response token, else 0.
    """
    n = int(getattr(data_cfg, "prompt_len", 3) or 3)

    def make(rng: random.Random, count: int) -> list[TaskPrompt]:
        out = []
        for _ in range(count):
            digits = [rng.choice(DIGITS) for _ in range(n)]
            answer = str((int(digits[-1]) + 1) % 10)
            out.append(TaskPrompt(" ".join(digits + ["="]), {"answer": answer}))
        return out

    return Task("successor", DIGITS + ["="], make, "answer the successor of the last digit")


def successor_reward(x: RewardInput) -> float:
    words = x.response_text.split()
    return 1.0 if words and words[0] == x.meta.get("answer") else 0.0


def successor_reward_parts(x: RewardInput) -> dict[str, float]:
    """``successor`` scored in two named components (a multi-reward example for ``gdpo``):
    ``correct`` (``successor_reward``) and ``brief`` (1 when the response is one word)."""
    return {"correct": successor_reward(x), "brief": 1.0 if len(x.response_text.split()) == 1 else 0.0}


#: the factors of ``tool_product`` (2..9: products from 4 to 81, 36 of them)
FACTORS = [str(i) for i in range(2, 10)]
TOOL_WORDS = ["*", "=", "calc", "result", "error"]


def tool_product(data_cfg: Any = None) -> Task:
    """Prompt: ``a * b =`` with ``a``, ``b`` in 2..9; answer: the product, one word (``56``).

    A task for the ``tools`` environment (docs/agents.md): a tiny model cannot multiply, but it
    can call the calculator with one word (``calc``: an empty argument means the prompt's own
    ``meta["expression"]``), read ``result 56`` and copy it. A random policy calls ``calc`` about
    once in |vocab| first tokens (~1/50); the reward is 1 when the response's last word is the
    product (``tool_product_reward``).
    """

    def make(rng: random.Random, count: int) -> list[TaskPrompt]:
        out = []
        for _ in range(count):
            a, b = rng.choice(FACTORS), rng.choice(FACTORS)
            out.append(TaskPrompt(f"{a} * {b} =", {"answer": str(int(a) * int(b)), "expression": f"{a} * {b}"}))
        return out

    products = sorted({str(int(a) * int(b)) for a in FACTORS for b in FACTORS}, key=int)
    vocab = list(dict.fromkeys([*FACTORS, *products, *TOOL_WORDS]))
    return Task("tool_product", vocab, make, "multiply two digits, with a calculator tool")


def tool_product_reward(x: RewardInput) -> float:
    """1 when the response's last word is the product (after the tool's ``result`` or without it)."""
    words = x.response_text.split()
    return 1.0 if words and words[-1] == x.meta.get("answer") else 0.0


def make_prompts(task: Task, rng: random.Random, count: int, where: str) -> list[TaskPrompt]:
    """``task.make_prompts(rng, count)``, checked: a list of ``count`` :class:`TaskPrompt`\\ s whose
    ``text`` is a str and ``meta`` a dict (``where`` names the step in the error)."""
    prompts = task.make_prompts(rng, count)
    if not isinstance(prompts, list) or len(prompts) != count:
        got = (("no prompts (an empty list)" if not prompts else f"a list of {len(prompts)}")
               if isinstance(prompts, list) else type(prompts).__name__)
        raise ConfigError(f"data.task: task {task.name!r} returned {got} from make_prompts(rng, {count}) at {where}; "
                          f"expected a list of {count} TaskPrompt (docs/tasks.md)", key="data.task")
    for i, p in enumerate(prompts):
        if not isinstance(p, TaskPrompt) or not isinstance(p.text, str) or not isinstance(p.meta, dict):
            raise ConfigError(f"data.task: task {task.name!r} returned {p!r} as prompt {i} at {where}; expected "
                              f"TaskPrompt(text: str, meta: dict) (docs/tasks.md)", key="data.task")
    return prompts


def load_callable(path: str, key: str) -> Callable[..., Any]:
    """Import ``module:function``; errors name the config ``key``."""
    if ":" not in path:
        raise ConfigError(f"{key}: {path!r} must be 'module:function'", key=key)
    mod_name, func_name = path.split(":", 1)
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as exc:
        raise ConfigError(f"{key}: cannot import module {mod_name!r}: {exc}", key=key) from exc
    fn = getattr(mod, func_name, None)
    if not callable(fn):
        raise ConfigError(f"{key}: module {mod_name!r} has no function {func_name!r}", key=key)
    return fn


#: the attribute :func:`reward_factory` sets on a function
REWARD_FACTORY = "__rlcore_reward_factory__"


def reward_factory(fn: Callable[[Any], Callable[..., Any]]) -> Callable[[Any], Callable[..., Any]]:
    """Mark ``fn`` as a reward *factory*: named as ``data.reward`` (or in ``data.reward_by_source``),
    it is called once when the run is built (and by ``rlcore check``) with the ``data`` config
    section, and the callable it returns scores the samples. For a reward that needs config
    (``rlcore.scoring:by_data_source_reward`` reads ``data.reward_by_source``); a plain reward
    function needs nothing of the kind."""
    setattr(fn, REWARD_FACTORY, True)
    return fn


def resolve_reward(fn: Callable[..., Any], data_cfg: Any, key: str = "data.reward") -> Callable[..., Any]:
    """``fn`` itself, or, for a :func:`reward_factory`, the reward ``fn(data_cfg)`` builds; what the
    factory raises (other than a ConfigError) or a non-callable it returns is a ConfigError naming ``key``."""
    if not getattr(fn, REWARD_FACTORY, False):
        return fn
    name = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', fn)}"
    try:
        built = fn(data_cfg)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - the factory is user code
        raise ConfigError(f"{key}: reward factory {name}(data) raised {type(exc).__name__}: {exc}", key=key) from exc
    if not callable(built):
        raise ConfigError(f"{key}: reward factory {name}(data) returned {type(built).__name__}, not a reward "
                          f"function", key=key)
    return built
