"""The ``ray`` launcher: its config-time checks (by the selected providers' capabilities, never
their names), its line in ``rlcore check``, and ``train``, which hands the run to
:func:`rlcore_ray.launch.train_on_ray`. Cheap: Ray is imported only by ``train``."""

from __future__ import annotations

from typing import Any

from rlcore.errors import ConfigError
from rlcore.types import Cap

#: a trainer dimension of ``cluster.trainer`` and the engine capability that runs ranks along it
DIMENSIONS = {
    "dp": (Cap.DATA_PARALLEL, "data-parallel ranks (model replicas that split the step's samples)"),
    "tp": (Cap.TENSOR_PARALLEL, "tensor-parallel ranks"),
    "ep": (Cap.EXPERT_PARALLEL, "expert-parallel ranks"),
    "pp": (Cap.PIPELINE_PARALLEL, "pipeline-parallel ranks"),
}


def _declares(spec: Any) -> str:
    return ", ".join(sorted(spec.capabilities)) or "nothing"


def check_ray_stack(stack: Any) -> None:
    """What ``cluster.backend: ray`` runs, asked of the selected providers' capabilities; a gap is a
    :class:`~rlcore.errors.ConfigError` naming the key, the provider and its distribution."""
    c = stack.config.cluster
    engine, backend, sync = stack.engine, stack.rollout_backend, stack.weight_sync
    for dim, (cap, what) in DIMENSIONS.items():
        size = int(c.trainer[dim])
        if size > 1 and not stack.has("engine", cap):
            raise ConfigError(
                f"bad value for config key 'cluster.trainer.{dim}': {size} {what} need an engine that declares "
                f"{cap!r}; engine {engine.name!r} ({engine.distribution}) declares: {_declares(engine)}",
                key=f"cluster.trainer.{dim}")
    if not stack.has("rollout_backend", Cap.REPLICA):
        raise ConfigError(
            f"bad value for config key 'rollout.backend': cluster.backend=ray runs the rollout as replicas in "
            f"processes of their own, which needs a backend that declares {Cap.REPLICA!r}; rollout.backend "
            f"{backend.name!r} ({backend.distribution}) declares: {_declares(backend)}", key="rollout.backend")
    if Cap.FEEDS_REPLICAS not in sync.capabilities:
        raise ConfigError(
            f"bad value for config key 'sync.name': cluster.backend=ray pushes the weights into a fleet of rollout "
            f"replicas, which needs a sync that declares {Cap.FEEDS_REPLICAS!r}; sync.name {sync.name!r} "
            f"({sync.distribution}) declares: {_declares(sync)}", key="sync.name")
    if Cap.LENDS_STORAGE in sync.capabilities:
        if c.placement != "colocated":
            raise ConfigError(
                f"bad value for config key 'cluster.placement': sync.name {sync.name!r} ({sync.distribution}) lends "
                f"the trainer's parameters to colocated rollout replicas: set cluster.placement=colocated (or use "
                f"a sync that copies, such as sync.name=inproc)", key="cluster.placement")
        if not stack.has("engine", Cap.EXPORTS_OWN_PARAMETERS):
            raise ConfigError(
                f"bad value for config key 'sync.name': {sync.name!r} ({sync.distribution}) lends the engine's own "
                f"parameters, which needs an engine that declares {Cap.EXPORTS_OWN_PARAMETERS!r}; engine "
                f"{engine.name!r} ({engine.distribution}) exports tensors made for the push (declares: "
                f"{_declares(engine)}); use sync.name=inproc", key="sync.name")


class RayLauncher:
    """``cluster.backend: ray`` (see :mod:`rlcore_ray.launch`)."""

    def check(self, stack: Any) -> None:
        check_ray_stack(stack)

    def describe(self, stack: Any) -> str:
        c, r = stack.config.cluster, stack.config.ray
        t = c.trainer
        where = r.address or f"started here, {r.local_nodes} node(s)"
        return (f"ray ({where}): trainer ranks dp={t.dp} tp={t.tp} ep={t.ep} pp={t.pp}, {c.rollout.replicas} rollout "
                f"replica(s), {c.placement}, {r.strategy}")

    def train(self, stack: Any, *, resume: bool = False, overwrite: bool = False, allow_config_change: bool = False,
              console: Any = None) -> dict[str, Any]:
        from rlcore.preflight import preflight

        from rlcore_ray.launch import train_on_ray

        preflight(stack)  # on the driver too: a bad config fails here, not inside every actor
        return train_on_ray(stack, resume=resume, overwrite=overwrite, allow_config_change=allow_config_change,
                            console=console)
