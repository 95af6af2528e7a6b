"""Tools an environment calls, each call bounded: :class:`Tool` (a name and a function of one
string argument), :class:`ToolRegistry` (the tools a run may call), :func:`call_tool` (one call
with a timeout and an output size limit) and the built-in ``calc``. A run's tools are the ``tool``
providers ``environment.tools`` names (:class:`~rlcore.types.ToolSpec`; ``calc`` is registered
by :mod:`rlcore.builtin.environments`).

A tool's failure is the model's business, never the run's: :func:`call_tool` turns an exception,
a timeout, an unknown tool or a return value that is not a string into a :class:`ToolResult`
with ``ok`` false and an ``error`` the environment shows the model as the observation.

A Python function that never returns cannot be stopped from another thread, so a call runs in a
fresh daemon thread and is abandoned at its timeout (the thread runs on until it returns or the
process exits; the conversation goes on). Code the model wrote never runs this way: the
``python`` tool (rlcore-sandbox) runs it in a separate, fenced process, killed at its limit.
"""

from __future__ import annotations

import ast
import operator
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["CALC", "MAX_TOOL_SECONDS", "Tool", "ToolRegistry", "calculate", "call_tool"]


@dataclass(frozen=True)
class Tool:
    """A tool: ``fn(argument: str) -> str``; ``description`` says what the argument is."""

    name: str
    fn: Callable[[str], str]
    description: str = ""


@dataclass
class ToolResult:
    """One call's outcome: ``output`` (cut to the size limit, ``truncated`` then), or ``ok``
    false with ``error``."""

    tool: str
    ok: bool
    output: str = ""
    error: str = ""
    seconds: float = 0.0
    truncated: bool = False


class ToolRegistry:
    """The tools a conversation may call, by name."""

    def __init__(self, tools: Iterable[Tool] = ()):
        self.tools: dict[str, Tool] = {}
        for t in tools:
            self.add(t)

    def add(self, tool: Tool) -> None:
        if tool.name in self.tools:
            raise ValueError(f"tool {tool.name!r} is registered twice")
        self.tools[tool.name] = tool

    def __contains__(self, name: str) -> bool:
        return name in self.tools

    def names(self) -> list[str]:
        return sorted(self.tools)


def call_tool(registry: ToolRegistry, name: str, argument: str, *, timeout: float, max_chars: int) -> ToolResult:
    """Call tool ``name`` with ``argument``: within ``timeout`` seconds, its output cut to
    ``max_chars`` characters; every failure is a ``ToolResult`` with ``ok`` false (see the
    module docstring)."""
    tool = registry.tools.get(name)
    if tool is None:
        return ToolResult(name, False, error=f"unknown tool {name!r} (tools: {', '.join(registry.names())})")
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = tool.fn(argument)
        except BaseException as exc:  # noqa: BLE001 - a tool's failure is reported to the model
            box["error"] = f"{type(exc).__name__}: {exc}"

    t0 = time.perf_counter()
    worker = threading.Thread(target=run, name=f"rlcore-tool-{name}", daemon=True)
    worker.start()
    worker.join(timeout)
    seconds = time.perf_counter() - t0
    if worker.is_alive():
        return ToolResult(name, False, error=f"tool {name!r} timed out after {timeout:g}s", seconds=seconds)
    if "error" in box:
        return ToolResult(name, False, error=f"tool {name!r} failed: {str(box['error'])[:max_chars]}", seconds=seconds)
    value = box.get("value")
    if not isinstance(value, str):
        return ToolResult(name, False, error=f"tool {name!r} returned {type(value).__name__}, not text",
                          seconds=seconds)
    if "\x00" in value:
        return ToolResult(name, False, error=f"tool {name!r} returned binary data", seconds=seconds)
    return ToolResult(name, True, output=value[:max_chars], seconds=seconds, truncated=len(value) > max_chars)


#: the longest a tool limit may be: a limit is there to stop a call, and one call holds its
#: conversation's turn, so the whole step, for that long (a day is already no limit; Python's
#: thread timeouts overflow past threading.TIMEOUT_MAX, about 292 years, and the kernel's CPU limit
#: past 2**63 seconds)
MAX_TOOL_SECONDS = 86_400.0


# ------------------------------------------------------------------------------- calc ------

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}
#: the largest operand or result ``calc`` works with (keeps ``9**9**9``-style blow-ups out)
CALC_LIMIT = 10**12


def calculate(expression: str) -> str:
    """``calc``: integer arithmetic (``+ - * // %``, parentheses, unary minus) on numbers up to
    :data:`CALC_LIMIT`; digits may be written apart (``4 9`` is 49, as a word-level tokenizer
    writes numbers). Raises ``ValueError`` for anything else."""
    text = expression.strip()
    joined = "".join(ch for ch in text if not ch.isspace())
    try:
        tree = ast.parse(joined, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"cannot parse {text!r}") from exc

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            value = node.value
        elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
                raise ValueError("division by zero")
            value = _OPS[type(node.op)](left, right)
        elif isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            value = _OPS[type(node.op)](ev(node.operand))
        else:
            raise ValueError(f"calc takes integer arithmetic only, not {type(node).__name__}")
        if abs(value) > CALC_LIMIT:
            raise ValueError(f"a number beyond {CALC_LIMIT}")
        return value

    return str(ev(tree))


CALC = Tool("calc", calculate, "integer arithmetic: + - * // % and parentheses")
