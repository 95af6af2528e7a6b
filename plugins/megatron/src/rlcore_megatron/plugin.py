"""Plugin ``megatron`` (distribution ``rlcore-megatron``): the megatron-core training engine.

Registered through the ``rlcore`` entry-point group (``megatron = "rlcore_megatron.plugin"``);
select it with ``plugins: [megatron]`` and ``engine: {name: megatron}``. Importing this module is
cheap: megatron-core is imported by the factory, only when the config selects the engine. The
``megatron:`` config section holds the engine's settings.
"""

from rlcore import PLUGIN_API, hookimpl
from rlcore.errors import PluginError
from rlcore.types import Cap, EngineSpec, PluginSettings, RequiresCapability

from rlcore_megatron.settings import (
    ENGINE_CAPABILITIES,
    MegatronSettings,
    exports_mtp_beyond_mimo,
    mtp_export_reason,
    resolve_parallel,
    section_settings,
    validate_settings,
)

__all__ = ["PLUGIN_API", "constraints", "engine", "plugin_settings", "MegatronSettings", "INSTALL_HINT"]

#: megatron-core is an extra, not a dependency: it is large, and on 0.12/0.13 its wheel declares
#: megatron-LM's whole training stack (see README.md for the lean install of those versions)
INSTALL_HINT = "pip install 'rlcore-megatron[megatron-core]'"


def _build(ctx):
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        raise PluginError(
            f"engine.name=megatron needs megatron-core, which is not installed ({exc}). "
            f"Install it with: {INSTALL_HINT}"
        ) from exc
    from rlcore_megatron.engine import build_megatron_engine

    return build_megatron_engine(ctx)


@hookimpl
def plugin_settings():
    return PluginSettings(section="megatron", schema=MegatronSettings, validate=validate_settings)


@hookimpl
def engine():
    yield EngineSpec(
        name="megatron",
        factory=_build,
        capabilities=ENGINE_CAPABILITIES,
        description="megatron-core GPTModel (dense, MoE, MTP); needs " + INSTALL_HINT,
    )


def _megatron_selected(cfg) -> bool:
    return cfg.engine.name == "megatron"


def _tp(cfg) -> int:
    """The run's tensor-parallel size (cluster.trainer.tp under cluster.backend=ray)."""
    return resolve_parallel(section_settings(cfg.megatron), cfg).tensor_parallel_size


@hookimpl
def constraints():
    """What the engine's parallel layout asks of the head: under tensor parallelism the LM-head
    weight each rank holds is a shard of the vocabulary (the head must combine the softmax over
    the group); under sequence parallelism each rank holds a slice of the hidden states."""
    yield RequiresCapability(
        "forward_fn", Cap.VOCAB_PARALLEL,
        lambda cfg: (f"megatron.tensor_parallel_size={_tp(cfg)} shards the LM-head "
                     f"vocabulary over the tensor-parallel ranks; a head without it computes a softmax over "
                     f"its own shard"),
        when=lambda cfg: _megatron_selected(cfg) and _tp(cfg) > 1,
    )
    yield RequiresCapability(
        "forward_fn", Cap.SEQUENCE_PARALLEL,
        "megatron.sequence_parallel=true hands the head a slice of the hidden states per rank",
        when=lambda cfg: _megatron_selected(cfg) and bool(cfg.megatron.sequence_parallel),
    )
    yield RequiresCapability("rollout_backend", Cap.ANY_MTP_LAYOUT, mtp_export_reason, when=exports_mtp_beyond_mimo)
