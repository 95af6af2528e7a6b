"""Device platforms: which device a run uses and how its ranks talk, through the ``platform``
providers (built-in ``cpu`` and ``cuda``; ``npu`` from rlcore-npu).

Core resolves ``engine.device`` once per run (:func:`resolve_device`): its device type selects a
:class:`~rlcore.types.PlatformSpec`, whose factory activates the platform (a vendor extension is
imported there and nowhere else), and engines get ``BuildContext.device`` / ``.platform``.
Code that only holds a ``torch.device`` asks :func:`platform_for` (the torch.distributed backend
of its ranks, ``set_device``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlcore.errors import ConfigError
from rlcore.types import Platform, PlatformSpec, implements

if TYPE_CHECKING:  # pragma: no cover - torch is imported only when a device is resolved
    import torch

__all__ = [
    "TorchDevicePlatform", "builtin_platforms", "cuda_free_bytes", "dist_backend_for", "platform_for",
    "resolve_device", "run_device", "select_platform",
]

AUTO = "auto"

#: activated platforms by device type (``cpu`` and ``cuda`` need no activation)
_ACTIVE: dict[str, Platform] = {}


class TorchDevicePlatform:
    """A platform whose device module is ``torch.<device_type>`` (``torch.cuda``; ``torch.npu``
    once torch_npu has registered it), or the CPU."""

    def __init__(self, device_type: str, dist_backend: str):
        self.device_type = device_type
        self.dist_backend = dist_backend

    def _module(self) -> Any:
        import torch

        mod = getattr(torch, self.device_type, None)
        if mod is None:
            raise ConfigError(f"torch has no {self.device_type!r} device module here", key="engine.device")
        return mod

    def device(self, index: int | None = None) -> torch.device:
        import torch

        if self.device_type == "cpu" or index is None:
            return torch.device(self.device_type)
        return torch.device(self.device_type, index)

    def device_count(self) -> int:
        return 1 if self.device_type == "cpu" else int(self._module().device_count())

    def set_device(self, index: int) -> None:
        if self.device_type != "cpu":
            self._module().set_device(index)

    def synchronize(self) -> None:
        if self.device_type != "cpu":
            self._module().synchronize()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device_type!r}, {self.dist_backend!r})"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def cuda_free_bytes() -> int | None:
    """Free memory of this process's current CUDA device, or None without one. A measurement
    (e.g. what a colocated engine's memory release freed): it never raises."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.mem_get_info()[0])
    except Exception:  # noqa: BLE001 - a measurement, not a reason to fail the caller
        return None


def builtin_platforms() -> dict[str, PlatformSpec]:
    """The specs core registers itself (``rlcore.builtin.platforms``)."""
    return {
        "cpu": PlatformSpec(name="cpu", factory=lambda ctx=None: TorchDevicePlatform("cpu", "gloo"),
                            dist_backend="gloo", is_available=lambda: True,
                            description="the host CPU; gloo between ranks"),
        "cuda": PlatformSpec(name="cuda", factory=lambda ctx=None: TorchDevicePlatform("cuda", "nccl"),
                             dist_backend="nccl", is_available=_cuda_available,
                             description="NVIDIA GPUs through torch.cuda; nccl between ranks"),
    }


@dataclass(frozen=True)
class ResolvedDevice:
    spec: PlatformSpec
    platform: Platform
    device: torch.device


def select_platform(device: str, platforms: Mapping[str, PlatformSpec] | None = None, *,
                    select: Any = None) -> PlatformSpec:
    """The platform spec ``device`` (``engine.device``) names. ``auto``: the one available
    accelerator, else ``cpu``. ``select(hook, name, key=...)`` (the plugin manager's) makes an
    unknown device type an error that names the plugin providing it."""
    specs = dict(builtin_platforms() if platforms is None else platforms)
    text = str(device).strip().lower()
    if text == AUTO:
        found = [s for name, s in sorted(specs.items()) if name != "cpu" and s.available()]
        if len(found) > 1:
            raise ConfigError(f"engine.device: auto finds several accelerators ({', '.join(s.name for s in found)}); "
                              f"name one", key="engine.device")
        return found[0] if found else specs["cpu"]
    kind = text.split(":", 1)[0]
    if select is not None:
        return select("platform", kind, key="engine.device")
    if kind not in specs:
        raise ConfigError(f"engine.device {device!r}: no platform provides device type {kind!r} "
                          f"(known: {', '.join(sorted(specs))})", key="engine.device")
    return specs[kind]


def resolve_device(device: str, platforms: Mapping[str, PlatformSpec] | None = None, ctx: Any = None, *,
                   select: Any = None, spec: PlatformSpec | None = None) -> ResolvedDevice:
    """Select and activate the platform of ``device`` and return the ``torch.device`` to use
    (an index is kept as given: ``npu:1``; ``npu`` means the platform's current device)."""
    spec = spec or select_platform(device, platforms, select=select)
    platform = spec.factory(ctx)
    if not implements(platform, Platform):
        raise TypeError(f"platform {spec.name!r} ({spec.source()}): its factory returned {type(platform).__name__}, "
                        f"not a Platform (device, device_count, set_device, synchronize, dist_backend)")
    _ACTIVE[spec.device_type] = platform
    text = str(device).strip().lower()
    index = int(text.split(":", 1)[1]) if ":" in text else None
    return ResolvedDevice(spec, platform, platform.device(index))


def run_device(ctx: Any) -> torch.device:
    """The device a provider factory builds on: ``ctx.device`` when core resolved it for the run,
    else ``ctx.config.engine.device`` through the built-in platforms (a factory called directly)."""
    device = getattr(ctx, "device", None)
    return device if device is not None else resolve_device(ctx.config.engine.device).device


def platform_for(device: torch.device | str) -> Platform:
    """The activated platform of ``device`` (``cpu`` and ``cuda`` always answer; another device
    type only after :func:`resolve_device` activated its platform)."""
    import torch

    kind = torch.device(device).type
    if kind in _ACTIVE:
        return _ACTIVE[kind]
    builtins = builtin_platforms()
    if kind in builtins:
        return builtins[kind].factory(None)
    raise ConfigError(f"no platform is active for device type {kind!r}: set engine.device and activate the "
                      f"plugin that provides it", key="engine.device")


def dist_backend_for(device: torch.device | str) -> str:
    """The torch.distributed backend for ranks on ``device`` (gloo, nccl, hccl...)."""
    return platform_for(device).dist_backend
