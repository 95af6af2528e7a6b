"""The Ascend NPU platform: ``engine.device: npu`` (or ``npu:N``), HCCL between ranks.

``torch_npu`` is imported here and nowhere else, only when the platform is activated (core calls
:func:`activate` once per run when ``engine.device`` selects ``npu``). It is not a dependency of
rlcore-npu: it must match the Ascend CANN toolkit installed on the machine, it does not import
without CANN's libraries (``libhccl.so``), and once installed it makes ``import torch`` itself
fail where CANN is absent (torch's device-backend autoload imports it;
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns that off). So its absence, or a broken install, is a
:class:`~rlcore.errors.ConfigError` naming ``engine.device`` and the install line.

What rlcore uses of torch_npu is exactly this (the test double ``tests/torch_npu_double.py``
implements this much and nothing more): importing ``torch_npu`` registers the device module
``torch.npu`` with ``is_available()``, ``device_count()``, ``set_device(index)``,
``current_device()`` and ``synchronize()``, and the ``npu`` device type of ``torch.device``.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from rlcore.errors import ConfigError
from rlcore.platforms import TorchDevicePlatform

DEVICE_TYPE = "npu"
DIST_BACKEND = "hccl"
INSTALL_LINE = (
    "pip install torch-npu==<the version matching your torch, e.g. 2.13.0> on a machine with the Ascend CANN "
    "toolkit, after `source /usr/local/Ascend/ascend-toolkit/set_env.sh` (rlcore-npu does not install it: "
    "plugins/npu/README.md)"
)


def torch_npu_installed() -> bool:
    """Cheap: is a ``torch_npu`` package on the path (nothing is imported)."""
    return importlib.util.find_spec("torch_npu") is not None


def load_torch_npu() -> Any:
    """Import ``torch_npu`` (which registers ``torch.npu``); a clear error when it is missing or
    cannot load its CANN libraries."""
    try:
        module = importlib.import_module("torch_npu")
    except ModuleNotFoundError as exc:
        if exc.name not in (None, "torch_npu"):
            raise ConfigError(
                f"engine.device npu: torch_npu is installed but imports a missing module {exc.name!r} ({exc}); "
                f"reinstall it: {INSTALL_LINE}", key="engine.device") from exc
        raise ConfigError(f"engine.device npu needs torch_npu, which is not installed: {INSTALL_LINE}",
                          key="engine.device") from exc
    except (ImportError, OSError) as exc:
        raise ConfigError(
            f"engine.device npu: torch_npu is installed but does not import ({exc}). It needs the Ascend CANN "
            f"libraries (libhccl.so ...): `source /usr/local/Ascend/ascend-toolkit/set_env.sh` first, or "
            f"reinstall: {INSTALL_LINE}", key="engine.device") from exc
    import torch

    npu = getattr(torch, DEVICE_TYPE, None)
    if npu is None or not hasattr(npu, "device_count"):
        raise ConfigError("engine.device npu: torch_npu imported but registered no torch.npu device module; "
                          f"its version does not match this torch {torch.__version__}: {INSTALL_LINE}",
                          key="engine.device")
    return module


class NPUPlatform(TorchDevicePlatform):
    """``torch.npu`` (registered by torch_npu) and HCCL."""

    def __init__(self) -> None:
        super().__init__(DEVICE_TYPE, DIST_BACKEND)


def activate(ctx: Any = None) -> NPUPlatform:
    """The ``npu`` platform's factory: import torch_npu, check a device is visible, and set up
    MindSpeed compatibility for routing replay (``npu.mindspeed``)."""
    load_torch_npu()
    import torch

    if not torch.npu.is_available() or int(torch.npu.device_count()) < 1:
        raise ConfigError("engine.device npu: torch_npu imported but sees no NPU (torch.npu.is_available() is "
                          "False): check the driver and ASCEND_RT_VISIBLE_DEVICES", key="engine.device")
    settings = getattr(ctx, "settings", None)
    mode = str(getattr(settings, "mindspeed", "auto")) if settings is not None else "auto"
    from rlcore_npu.mindspeed import setup_mindspeed

    setup_mindspeed(mode)
    return NPUPlatform()
