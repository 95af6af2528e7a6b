"""The plugin module named by the entry point ``sandbox = "rlcore_sandbox.plugin"``.

It registers the tool ``python`` (``tool`` hook: the ``tools`` environment calls it when
``environment.tools`` lists it) and the ``sandbox:`` section, its limits. It stays cheap to import:
the sandbox (and libseccomp, through pyseccomp) is imported by the tool's factory, when a run
selects it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from rlcore import PLUGIN_API, hookimpl
from rlcore.environments.tools import MAX_TOOL_SECONDS
from rlcore.errors import ConfigError
from rlcore.types import PluginSettings, ToolSpec

__all__ = ["PLUGIN_API", "SandboxSettings", "plugin_settings", "tool", "validate"]


@dataclass
class SandboxSettings:
    """The ``sandbox:`` section: each ``python`` call's limits. ``cpu_seconds`` (CPU time),
    ``memory_mb`` (address space), ``wall_seconds`` (wall clock: the call is killed there),
    ``output_bytes`` (stdout and stderr together), ``scratch_mb`` (the size of each tmpfs the code
    may write: its working directory ``/tmp`` and ``/dev/shm``). New processes are refused (one
    process, threads allowed, bounded by memory)."""

    cpu_seconds: int = 2
    memory_mb: int = 256
    wall_seconds: float = 5.0
    output_bytes: int = 4096
    scratch_mb: int = 16


def validate(section: Any, cfg: Any) -> None:
    """Limits that limit: each > 0, no time beyond ``MAX_TOOL_SECONDS`` (a day), no size beyond this
    machine's memory; with ``python`` in ``environment.tools``, ``environment.tool_timeout_seconds``
    at least ``wall_seconds`` (a call must not be reported timed out while its process still runs)."""
    for name in ("cpu_seconds", "memory_mb", "wall_seconds", "output_bytes", "scratch_mb"):
        if not getattr(section, name) > 0:
            raise ConfigError(f"bad value for config key 'sandbox.{name}': {getattr(section, name)}; it must be > 0",
                              key=f"sandbox.{name}")
    for name in ("cpu_seconds", "wall_seconds"):
        if float(getattr(section, name)) > MAX_TOOL_SECONDS:
            raise ConfigError(f"sandbox.{name}={float(getattr(section, name)):g}: a tool limit of more than "
                              f"{MAX_TOOL_SECONDS:g} s (a day) does not limit anything (one call holds the whole step "
                              f"that long); use seconds to minutes", key=f"sandbox.{name}")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for name, size in (("memory_mb", int(section.memory_mb) << 20), ("scratch_mb", int(section.scratch_mb) << 20),
                       ("output_bytes", int(section.output_bytes))):
        if size > memory:
            raise ConfigError(f"sandbox.{name}={getattr(section, name)}: {size / 2**30:.1f} GiB, more than this "
                              f"machine's {memory / 2**30:.1f} GiB of RAM", key=f"sandbox.{name}")
    env = cfg.environment
    if "python" in [str(t) for t in env.tools] and float(env.tool_timeout_seconds) < float(section.wall_seconds):
        raise ConfigError(f"bad value for config key 'environment.tool_timeout_seconds': {env.tool_timeout_seconds:g} is "
                          f"below sandbox.wall_seconds={section.wall_seconds:g}: a python call would be reported as "
                          f"timed out while its process still runs; raise it to at least the wall limit",
                          key="environment.tool_timeout_seconds")


@hookimpl
def plugin_settings():
    return PluginSettings(section="sandbox", schema=SandboxSettings, validate=validate)


def _python(ctx):
    from rlcore_sandbox.sandbox import python_tool  # the fence, and libseccomp, only when selected

    return python_tool(ctx.settings)


@hookimpl
def tool():
    yield ToolSpec(name="python", factory=_python,
                   description="runs a Python program under bubblewrap and seccomp; answers with its output")
