"""Plugin ``ray`` (distribution rlcore-ray): the ``ray`` launcher, its ``ray:`` config section, and
the ``mapped`` weight sync, which lends the writer's parameters to its colocated replicas
(:mod:`rlcore_ray.mapped_sync`).

``plugins: [ray]`` and ``cluster.backend: ray`` run the trainer ranks and rollout replicas as Ray
actors in one placement group (:mod:`rlcore_ray.launch`). Importing this module imports no Ray.
"""

from __future__ import annotations

from rlcore import PLUGIN_API, hookimpl
from rlcore.types import Cap, LauncherSpec, PluginSettings

from rlcore_ray.settings import RaySettings, validate

__all__ = ["PLUGIN_API", "launcher", "plugin_settings", "weight_sync"]


def _build(config):
    from rlcore_ray.launcher import RayLauncher

    return RayLauncher()


@hookimpl
def plugin_settings():
    return PluginSettings(section="ray", schema=RaySettings, validate=validate, affects_training=False)


@hookimpl
def weight_sync():
    from rlcore_ray.mapped_sync import mapped_sync_spec

    yield mapped_sync_spec()


@hookimpl
def launcher():
    yield LauncherSpec(name="ray", factory=_build, remote_ranks=lambda config: bool(config.ray.address),
                       capabilities={Cap.PLACES_RANKS, Cap.ROLLOUT_REPLICAS},
                       description="trainer ranks and rollout replicas as Ray actors in one placement group")
