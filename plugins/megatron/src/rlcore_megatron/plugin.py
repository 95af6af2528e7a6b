"""Built-in plugin ``megatron``: the megatron-core training engine (``rlcore[megatron]``).

Importing this module is cheap: megatron-core is imported by the factory, only when the config
selects ``engine.name: megatron``. The ``megatron:`` config section holds the engine's settings.
"""

from rlcore import PLUGIN_API, hookimpl
from rlcore.engines.megatron.settings import MegatronSettings
from rlcore.errors import PluginError
from rlcore.types import Cap, EngineSpec, PluginSettings

__all__ = ["PLUGIN_API", "engine", "plugin_settings", "MegatronSettings"]

INSTALL_HINT = "pip install 'rlcore[megatron]'"


def _build(ctx):
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        raise PluginError(
            f"engine.name=megatron needs megatron-core, which is not installed ({exc}). "
            f"Install it with: {INSTALL_HINT}"
        ) from exc
    from rlcore.engines.megatron.engine import build_megatron_engine

    return build_megatron_engine(ctx)


@hookimpl
def plugin_settings():
    return PluginSettings(section="megatron", schema=MegatronSettings)


@hookimpl
def engine():
    yield EngineSpec(
        name="megatron",
        factory=_build,
        capabilities={Cap.MOE, Cap.MTP, Cap.ROUTER_HOOK, Cap.RECORD_ROUTES, Cap.TENSOR_PARALLEL,
                      Cap.EXPERT_PARALLEL},
        description="megatron-core GPTModel (dense, MoE, MTP); needs " + INSTALL_HINT,
    )
