"""The plugin module named by the entry point ``npu = "rlcore_npu.plugin"``.

It registers the ``npu`` device platform (``engine.device: npu``, HCCL) and the ``npu:`` config
section. Cheap to import: torch_npu and MindSpeed are imported by the platform's factory
(:func:`rlcore_npu.platform.activate`), only when ``engine.device`` selects ``npu``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlcore import PLUGIN_API, hookimpl
from rlcore.errors import ConfigError
from rlcore.types import PlatformSpec, PluginSettings

__all__ = ["PLUGIN_API", "NPUSettings", "plugin_settings", "platform"]


@dataclass
class NPUSettings:
    """The ``npu:`` config section.

    * ``mindspeed``: ``auto`` (default) imports MindSpeed's megatron adaptor when it is installed,
      before the model is built, and keeps rlcore's router seam installed after its patches;
      ``required`` makes a missing MindSpeed an error; ``off`` leaves MindSpeed alone.
    """

    mindspeed: str = "auto"


def _validate(section: Any) -> None:
    from rlcore_npu.mindspeed import MODES

    if str(section.mindspeed) not in MODES:
        raise ConfigError(f"npu.mindspeed must be one of {', '.join(MODES)}, got {section.mindspeed!r}",
                          key="npu.mindspeed")


def _activate(ctx: Any = None) -> Any:
    from rlcore_npu.platform import activate

    return activate(ctx)


def _installed() -> bool:
    from rlcore_npu.platform import torch_npu_installed

    return torch_npu_installed()


@hookimpl
def plugin_settings():
    return PluginSettings(section="npu", schema=NPUSettings, validate=_validate)


@hookimpl
def platform():
    yield PlatformSpec(name="npu", factory=_activate, dist_backend="hccl", is_available=_installed,
                       description="Ascend NPUs through torch_npu (imported only when selected); hccl between ranks")
