"""Built-in environments ``single_turn`` (the default: one prompt, one completion) and ``tools``
(the model calls tools; docs/agents.md), registered through the ``environment`` hook."""

from rlcore import PLUGIN_API, hookimpl
from rlcore.types import EnvironmentSpec

__all__ = ["PLUGIN_API", "environment"]


def _single_turn(ctx):
    from rlcore.environments.standard import SingleTurnEnvironment

    return SingleTurnEnvironment()


def _tools(ctx):
    from rlcore.environments.standard import ToolEnvironment

    return ToolEnvironment(ctx.engine.tokenizer, ctx.config.environment)


@hookimpl
def environment():
    yield EnvironmentSpec(name="single_turn", factory=_single_turn,
                          description="one prompt, one completion, scored by data.reward")
    yield EnvironmentSpec(name="tools", factory=_tools,
                          description="the model calls tools (calc; python when environment.code.enable) until it "
                                      "answers")
