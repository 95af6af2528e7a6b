"""Built-in launcher ``local`` (``cluster.backend: local``, the default): the whole run in this
process, one trainer rank and the rollout backend beside it."""

from __future__ import annotations

from typing import Any

from rlcore import PLUGIN_API, hookimpl
from rlcore.errors import ConfigError
from rlcore.types import Cap, LauncherSpec

__all__ = ["PLUGIN_API", "LocalLauncher", "launcher"]

#: what to do when a config asks for more than one process
MULTI_PROCESS = "pip install rlcore-ray, add ray to plugins: and set cluster.backend: ray"


class LocalLauncher:
    """One process: :class:`rlcore.trainer.Trainer` runs the stack here."""

    def check(self, stack: Any) -> None:
        c = stack.config.cluster
        sizes = {f"cluster.trainer.{d}": c.trainer[d] for d in ("dp", "tp", "ep", "pp")}
        sizes["cluster.rollout.replicas"] = c.rollout.replicas
        for key, val in sizes.items():
            if int(val) != 1:
                raise ConfigError(f"bad value for config key {key!r}: {val} needs several processes, which "
                                  f"cluster.backend=local does not start: {MULTI_PROCESS}", key=key)
        sync = stack.weight_sync
        if Cap.LENDS_STORAGE in sync.capabilities:
            raise ConfigError(f"sync.name {sync.name!r} ({sync.distribution}) lends the trainer's parameters to "
                              f"rollout replicas in other processes, which cluster.backend=local does not start "
                              f"(in one process use sync.name=inproc, or {MULTI_PROCESS})", key="sync.name")

    def describe(self, stack: Any) -> str:
        return "one trainer rank and the rollout backend in this process"

    def train(self, stack: Any, *, resume: bool = False, overwrite: bool = False, allow_config_change: bool = False,
              console: Any = None) -> dict[str, Any]:
        from rlcore.parallel.worker import refuse_foreign_launcher
        from rlcore.trainer import Trainer

        refuse_foreign_launcher(stack.config)
        return Trainer(stack, resume=resume, overwrite=overwrite, allow_config_change=allow_config_change).run()


@hookimpl
def launcher():
    yield LauncherSpec(name="local", factory=lambda config: LocalLauncher(),
                       description="this process: one trainer rank, the rollout backend beside it")
