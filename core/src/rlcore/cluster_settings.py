"""The ``cluster:`` config section: where trainer ranks and rollout replicas run.

No torch and no Ray here: :mod:`rlcore.config` imports this for the schema and checks it at
config time, so a bad value fails ``rlcore check`` with the key named, before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlcore.errors import ConfigError

PLACEMENTS = ("colocated", "disaggregated")


@dataclass
class WorkerResources:
    """What one worker (a trainer rank or a rollout replica) asks the launcher for."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0


@dataclass
class TrainerRanks:
    """Trainer ranks along each parallel dimension: ``dp`` data-parallel, ``tp`` tensor-, ``ep``
    expert- and ``pp`` pipeline-parallel (``dp * tp * ep * pp`` ranks). The launcher runs a size
    above 1 only for an engine that declares the dimension's capability (``data_parallel``,
    ``tensor_parallel``, ``expert_parallel``, ``pipeline_parallel``); ``dp`` beside a model split
    needs an engine declaring both (rlcore-megatron: ``dp`` with ``tp`` / ``pp``). rlcore-megatron
    takes its ``tp`` / ``ep`` / ``pp`` from here when ranks are launched (its own sizes may be left
    at 1 or set equal)."""

    dp: int = 1
    tp: int = 1
    ep: int = 1
    pp: int = 1
    resources: WorkerResources = field(default_factory=WorkerResources)


@dataclass
class RolloutReplicas:
    """Rollout replicas, each a copy of ``rollout.backend`` in a process of its own (the backend
    must declare ``replica``); prompts are split across them. ``timeout_s``: a replica that takes longer for one call is an error."""

    replicas: int = 1
    resources: WorkerResources = field(default_factory=WorkerResources)
    timeout_s: float = 600.0


@dataclass
class ClusterConfig:
    """``backend``: the launcher (``local``: this process, the default; ``ray`` with rlcore-ray:
    ``pip install rlcore-ray``, ``plugins: [ray]``, its own ``ray:`` section). ``placement``:
    ``colocated`` puts replica *i* beside trainer rank *i* (same node, shared resources);
    ``disaggregated`` gives replicas resources of their own. ``timeout_s``: torch.distributed
    collectives and worker start-up give up after this long."""

    backend: str = "local"
    placement: str = "disaggregated"
    timeout_s: float = 600.0
    trainer: TrainerRanks = field(default_factory=TrainerRanks)
    rollout: RolloutReplicas = field(default_factory=RolloutReplicas)
    #: what the launcher ``backend`` names declares (``Cap.PLACES_RANKS``, ``Cap.ROLLOUT_REPLICAS``),
    #: derived: core writes it on every load from the launcher's descriptor (a value in the file is
    #: replaced), so plugins decide by capability and never by the launcher's name
    launcher_capabilities: list[str] = field(default_factory=list)


def _bad(key: str, msg: str) -> ConfigError:
    return ConfigError(f"bad value for config key {key!r}: {msg}", key=key)


def check_cluster(cfg: Any) -> None:
    """Config-time checks of ``cluster:`` every launcher shares; what a launcher can run (by the
    selected providers' capabilities) is its own ``check``, run when the stack is resolved."""
    c = cfg.cluster
    if c.placement not in PLACEMENTS:
        raise _bad("cluster.placement", f"{c.placement!r}; choose one of: {', '.join(PLACEMENTS)}")
    sizes = {"trainer.dp": c.trainer.dp, "trainer.tp": c.trainer.tp, "trainer.ep": c.trainer.ep,
             "trainer.pp": c.trainer.pp, "rollout.replicas": c.rollout.replicas}
    for key, val in sizes.items():
        if int(val) < 1:
            raise _bad(f"cluster.{key}", f"{val}; must be >= 1")
    for key, val in (("timeout_s", c.timeout_s), ("rollout.timeout_s", c.rollout.timeout_s)):
        if not val > 0:
            raise _bad(f"cluster.{key}", f"{val!r}; must be > 0")
    for role in ("trainer", "rollout"):
        for k in ("num_cpus", "num_gpus"):
            if c[role].resources[k] < 0:
                raise _bad(f"cluster.{role}.resources.{k}", "must be >= 0")
    world = int(c.trainer.dp * c.trainer.tp * c.trainer.ep * c.trainer.pp)
    if c.placement == "colocated" and c.rollout.replicas > world:
        raise _bad("cluster.rollout.replicas", f"{c.rollout.replicas} colocated replicas need as many trainer "
                   f"ranks (there are {world}): each replica shares a trainer rank's resources")
    if cfg.rollout.seed_per_prompt is False and c.rollout.replicas > 1:
        raise _bad("rollout.seed_per_prompt", "false with cluster.rollout.replicas > 1: the samples would depend "
                   "on how prompts are split across replicas; leave it unset or set it true")


def resolve_seed_per_prompt(cfg: Any) -> None:
    """``rollout.seed_per_prompt`` unset: on exactly when prompts are split across replicas."""
    if cfg.rollout.seed_per_prompt is None:
        cfg.rollout.seed_per_prompt = bool(cfg.cluster.rollout.replicas > 1)
