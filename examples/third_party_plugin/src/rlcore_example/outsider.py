"""An engine and a rollout backend of an outsider, under names of their own: ``outsider-hf`` and
``outsider-local``. They reuse rlcore's built-in ``hf`` engine and ``local`` rollout, reached the
way rlcore reaches every plugin (the ``rlcore`` entry-point group and the hook the entry point's
module implements), and declare only what they promise: the engine runs data-parallel ranks
(``Cap.DATA_PARALLEL``), the backend runs as a rollout replica in a process of its own
(``Cap.REPLICA``) and takes in-process bucket pushes. A launcher decides by these declarations, so
``cluster.backend: ray`` runs them with ``cluster.trainer.dp: 2`` and rollout replicas exactly as it
runs the built-ins, and refuses what they do not declare (``cluster.trainer.tp``, say)."""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

from rlcore.types import Cap, EngineSpec, RolloutBackendSpec

ENGINE_CAPABILITIES = frozenset({Cap.DATA_PARALLEL})
BACKEND_CAPABILITIES = frozenset({Cap.LOGPROBS, Cap.RECEIVE_BUCKETS, Cap.WEIGHT_CHECKSUMS, Cap.REPLICA})


def core_provider(plugin: str, hook: str) -> Any:
    """The provider rlcore's own plugin ``plugin`` registers for ``hook`` (its only one)."""
    (ep,) = [e for e in entry_points(group="rlcore", name=plugin) if e.dist is not None and e.dist.name == "rlcore"]
    (spec,) = list(getattr(ep.load(), hook)())
    return spec


def _build_engine(ctx: Any) -> Any:
    return core_provider("hf", "engine").factory(ctx)


def _build_backend(ctx: Any) -> Any:
    return core_provider("local", "rollout_backend").factory(ctx)


def engines() -> list[EngineSpec]:
    return [EngineSpec(name="outsider-hf", factory=_build_engine, capabilities=ENGINE_CAPABILITIES,
                       description="rlcore's hf engine under an outsider's name: data-parallel ranks only")]


def rollout_backends() -> list[RolloutBackendSpec]:
    return [RolloutBackendSpec(name="outsider-local", factory=_build_backend, capabilities=BACKEND_CAPABILITIES,
                               description="rlcore's local rollout under an outsider's name: runs as a replica")]
