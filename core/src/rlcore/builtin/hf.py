"""Built-in plugin ``hf``: the transformers training engine."""

import json
from pathlib import Path

from rlcore import PLUGIN_API, hookimpl
from rlcore.lora import LORA_ADAPTER_PUSH, LORA_ENGINE
from rlcore.model_settings import TINY_MTP_OVER_MOE
from rlcore.types import Cap, EngineSpec

__all__ = ["PLUGIN_API", "constraints", "engine"]


def _build(ctx):
    from rlcore.engines.hf import build_hf_engine

    return build_hf_engine(ctx)


def _gaps(config):
    """``mtp`` is declared because MiMo models have MTP layers; any other model lacks it (read
    from the tiny-model settings or the directory's config.json: no model is built here). With LoRA
    the export is merged weights computed per push, not the engine's own parameters."""
    gaps = {}
    if int(config.lora.rank) > 0:
        gaps[Cap.EXPORTS_OWN_PARAMETERS] = (f"lora.rank={config.lora.rank}: the exported weights are merged per push "
                                            f"(W + scaling * B @ A), not the engine's own parameters")
    return {**gaps, **_model_gaps(config)}


def _model_gaps(config):
    model = config.engine.model
    if model.path:
        cfg_file = Path(str(model.path)) / "config.json"
        try:
            raw = json.loads(cfg_file.read_text())
        except (OSError, ValueError):
            return {Cap.MTP: f"engine.model.path: cannot read {cfg_file} to find MTP layers"}
        if not int(raw.get("num_nextn_predict_layers") or 0):
            return {Cap.MTP: f"engine.model.path {model.path} has no MTP layers (config.json has no "
                             f"num_nextn_predict_layers >= 1)"}
        return {}
    tiny = model.tiny
    if int(tiny.mtp_layers) < 1:
        return {Cap.MTP: "the tiny model has no MTP layers: set engine.model.tiny.mtp_layers >= 1"}
    if tiny.arch != "qwen2":
        return {Cap.MTP: f"engine.model.tiny.mtp_layers needs engine.model.tiny.arch 'qwen2' (MiMo layout), "
                         f"got {tiny.arch!r}"}
    return {}


@hookimpl
def engine():
    yield EngineSpec(
        name="hf",
        factory=_build,
        capabilities={Cap.MOE, Cap.MTP, Cap.ROUTER_HOOK, Cap.RECORD_ROUTES, Cap.VALUE_MODEL, Cap.DATA_PARALLEL,
                      Cap.EXPORTS_OWN_PARAMETERS, Cap.ENGINE_MODEL, Cap.LORA},
        description="any transformers causal LM (CPU or GPU); tiny models created locally; MTP in MiMo's layout",
        platform_gaps=_gaps,
    )


@hookimpl
def constraints():
    yield TINY_MTP_OVER_MOE  # the tiny model's MTP layers over an MoE arch: transformers has none
    yield LORA_ENGINE  # lora.rank > 0: an engine that trains adapters (core's lora section, rlcore.lora)
    yield LORA_ADAPTER_PUSH
