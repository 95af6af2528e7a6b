"""Built-in plugin ``hf``: the transformers training engine."""

from rlcore import PLUGIN_API, hookimpl
from rlcore.types import Cap, EngineSpec

__all__ = ["PLUGIN_API", "engine"]


def _build(ctx):
    from rlcore.engines.hf import build_hf_engine

    return build_hf_engine(ctx)


@hookimpl
def engine():
    yield EngineSpec(
        name="hf",
        factory=_build,
        capabilities={Cap.MOE, Cap.ROUTER_HOOK, Cap.RECORD_ROUTES},
        description="any transformers causal LM (CPU or GPU); tiny models created locally",
    )
