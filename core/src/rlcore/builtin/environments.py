"""Built-in environments ``single_turn`` (the default: one prompt, one completion) and ``tools``
(the model calls the tools ``environment.tools`` names; docs/agents.md), registered through the
``environment`` hook, and the built-in tool ``calc``, registered through the ``tool`` hook."""

from rlcore import PLUGIN_API, hookimpl
from rlcore.types import EnvironmentSpec, ToolSpec

__all__ = ["PLUGIN_API", "environment", "tool"]


def _single_turn(ctx):
    from rlcore.environments.standard import SingleTurnEnvironment

    return SingleTurnEnvironment()


def _tools(ctx):
    from rlcore.environments.standard import ToolEnvironment
    from rlcore.environments.tools import ToolRegistry

    return ToolEnvironment(ctx.engine.tokenizer, ctx.config.environment, ToolRegistry(ctx.extras["tools"]))


def _calc(ctx):
    from rlcore.environments.tools import CALC

    return CALC


@hookimpl
def environment():
    yield EnvironmentSpec(name="single_turn", factory=_single_turn, multi_turn=False,
                          description="one prompt, one completion, scored by data.reward")
    yield EnvironmentSpec(name="tools", factory=_tools, uses_tools=True,
                          description="the model calls the tools environment.tools names until it answers")


@hookimpl
def tool():
    yield ToolSpec(name="calc", factory=_calc, description="integer arithmetic: + - * // % and parentheses")
