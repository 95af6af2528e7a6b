"""The plugin module named by the entry point ``mtp = "rlcore_mtp.plugin"``.

It registers the ``mtp:`` config section, requires an engine whose model has MTP layers, asks
for MTP hidden states in the train pass (``forward_request``) and returns the MTP loss term and
per-depth metrics (``postprocess``, computed in :mod:`rlcore_mtp.loss` through the run's own
forward_fn). Cheap to import: torch is imported by :mod:`rlcore_mtp.loss` when a hook first runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rlcore import PLUGIN_API, hookimpl
from rlcore.errors import ConfigError
from rlcore.types import Cap, ForwardRequest, PluginSettings, RequiresCapability

__all__ = ["PLUGIN_API", "MTPSettings", "plugin_settings", "constraints", "forward_request", "postprocess"]


@dataclass
class MTPSettings:
    """The ``mtp:`` config section.

    * ``loss_scale`` (0.1): the MTP loss added to the policy loss is
      ``loss_scale / depths · Σ_d CE_d`` (megatron-core's ``mtp_loss_scaling_factor``, same
      default and the same division by the number of depths); ``CE_d`` sums depth ``d``'s
      cross-entropy over its valid tokens and divides by the step's loss tokens, so micro-batches
      add up to a step mean.
    * ``detach_trunk`` (true): the MTP layers' inputs from the trunk — the trunk hidden state
      entering depth 1 and every embedding lookup — are detached, so the MTP loss trains no trunk
      parameter (megatron-core 0.19 ``mtp_detach_heads``' input half; verl ``detach_encoder``
      detaches the embedding only). Off, the MTP CE back-propagates into the whole model, the
      SkyRL #1832 failure (inflated grad norm, entropy collapse) when it was not meant to.
    * ``detach_head`` (true): the MTP logits use a detached LM-head weight, so the MTP loss
      never updates the shared head (the other half of ``mtp_detach_heads``; verl always does).
    * ``depths`` (0): how many MTP depths get a loss, from depth 1; 0 means every MTP layer the
      model has. More than the model has is an error.
    """

    loss_scale: float = 0.1
    detach_trunk: bool = True
    detach_head: bool = True
    depths: int = 0


def validate(section: Any, config: Any = None) -> None:
    scale = section.loss_scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(float(scale)) or scale < 0:
        raise ConfigError(f"mtp.loss_scale must be a finite number >= 0, got {scale!r}", key="mtp.loss_scale")
    for key in ("detach_trunk", "detach_head"):
        if not isinstance(section[key], bool):
            raise ConfigError(f"mtp.{key} must be true or false, got {section[key]!r}", key=f"mtp.{key}")
    depths = section.depths
    if isinstance(depths, bool) or not isinstance(depths, int) or depths < 0:
        raise ConfigError(f"mtp.depths must be an integer >= 0 (0: every MTP layer), got {depths!r}",
                          key="mtp.depths")
    if config is None:
        return
    model = config.engine.model
    if not model.path:  # the tiny model, built from engine.model.tiny by whichever engine is selected
        have = int(model.tiny.mtp_layers)
        if depths > have:
            raise ConfigError(f"mtp.depths={depths} but the tiny model has engine.model.tiny.mtp_layers={have}",
                              key="mtp.depths")


@hookimpl
def plugin_settings():
    return PluginSettings(section="mtp", schema=MTPSettings, validate=validate)


@hookimpl
def constraints():
    yield RequiresCapability(role="engine", capability=Cap.MTP,
                             reason="the mtp plugin trains the model's MTP layers (it needs their hidden states)")


@hookimpl
def forward_request(ctx):
    if ctx.phase != "train" or ctx.config is None:
        return None
    return ForwardRequest(mtp_hidden=True, mtp_detach_trunk=bool(ctx.config.mtp.detach_trunk))


@hookimpl
def postprocess(ctx, output):
    if ctx.phase != "train" or ctx.config is None:
        return None
    from rlcore_mtp.loss import mtp_postprocess

    return mtp_postprocess(ctx, output, ctx.config.mtp)
