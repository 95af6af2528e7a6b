"""Built-in plugin ``platforms``: the ``cpu`` (gloo) and ``cuda`` (nccl) device platforms."""

from rlcore import PLUGIN_API, hookimpl

__all__ = ["PLUGIN_API", "platform"]


@hookimpl
def platform():
    from rlcore.platforms import builtin_platforms

    yield from builtin_platforms().values()
