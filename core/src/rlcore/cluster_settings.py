"""The ``cluster:`` config section: where trainer ranks and rollout replicas run.

No torch and no Ray here: :mod:`rlcore.config` imports this for the schema and checks it at
config time, so a bad value fails ``rlcore check`` with the key named, before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlcore.errors import ConfigError

BACKENDS = ("local", "ray")
PLACEMENTS = ("colocated", "disaggregated")
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
#: rollout backends whose replicas the cluster layer can run as actors (built inside the actor
#: from the same config, so they must not need the trainer's engine): the local rollout, and
#: rlcore-vllm's engine (vLLM is imported only inside the replica actor)
REPLICA_BACKENDS = ("local", "vllm")
#: weight syncs that feed a fleet of replicas (the fleet is a BucketReceiver and a DiskReceiver):
#: core's ``inproc`` / ``disk`` / ``mapped`` (local replicas) and rlcore-vllm's ``vllm`` (its ``shm`` transport:
#: every replica loads each bucket through its engine's layerwise reload; the plugin refuses the
#: other transports under Ray)
FLEET_SYNCS = ("inproc", "disk", "mapped", "vllm")
#: training engines whose ranks the cluster layer runs, and the parallel dimensions each has:
#: ``hf`` ranks are data-parallel (each holds the whole model, samples are split over them:
#: rlcore.parallel.data_parallel); ``megatron`` ranks are tensor/expert-parallel (each holds a
#: shard, every rank runs the same step on the same samples: rlcore.parallel.model_parallel).
#: Megatron data parallelism (dp > 1 next to tp/ep) is not implemented.
ENGINE_DIMS = {"hf": ("dp",), "megatron": ("tp", "ep")}


@dataclass
class WorkerResources:
    """What one worker (a trainer rank or a rollout replica) asks Ray for."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0


@dataclass
class TrainerRanks:
    """Trainer ranks: ``dp`` data-parallel ranks (the hf engine); ``tp`` / ``ep`` the tensor- and
    expert-parallel sizes of rlcore-megatron (``tp * ep`` ranks; under ``cluster.backend=ray`` they
    are the source of truth for ``megatron.tensor_parallel_size`` / ``expert_parallel_size``, which
    may be left at 1 or set equal). ``pp`` (pipeline) must be 1."""

    dp: int = 1
    tp: int = 1
    ep: int = 1
    pp: int = 1
    resources: WorkerResources = field(default_factory=WorkerResources)


@dataclass
class RolloutReplicas:
    """Rollout replicas, each a copy of ``rollout.backend`` in its own actor; prompts are split
    across them. ``timeout_s``: a replica that takes longer for one call is an error."""

    replicas: int = 1
    resources: WorkerResources = field(default_factory=WorkerResources)
    timeout_s: float = 600.0


@dataclass
class ClusterConfig:
    """``backend``: ``local`` (one process, the default) or ``ray`` (trainer ranks and rollout
    replicas as Ray actors in one placement group; ``pip install 'rlcore[ray]'``).
    ``address``: the Ray cluster to join (``auto``, ``ray://head:10001``); unset, a Ray cluster
    is started on this machine with ``local_nodes`` simulated nodes (``ray.cluster_utils.Cluster``
    when more than one). ``placement``: ``colocated`` puts replica *i* in trainer rank *i*'s
    bundle (same node, shared resources); ``disaggregated`` gives replicas bundles of their own.
    ``strategy``: the placement group's strategy. ``timeout_s``: torch.distributed collectives
    and actor start-up give up after this long."""

    backend: str = "local"
    address: str | None = None
    local_nodes: int = 1
    local_node_cpus: float = 2.0
    placement: str = "disaggregated"
    strategy: str = "PACK"
    timeout_s: float = 600.0
    trainer: TrainerRanks = field(default_factory=TrainerRanks)
    rollout: RolloutReplicas = field(default_factory=RolloutReplicas)


def _bad(key: str, msg: str) -> ConfigError:
    return ConfigError(f"bad value for config key {key!r}: {msg}", key=key)


def check_cluster(cfg: Any) -> None:
    """Config-time checks of ``cluster:`` against the rest of the config (engine, rollout, sync)."""
    c = cfg.cluster
    check_mapped_sync(cfg)
    if c.backend not in BACKENDS:
        raise _bad("cluster.backend", f"{c.backend!r}; choose one of: {', '.join(BACKENDS)}")
    if c.placement not in PLACEMENTS:
        raise _bad("cluster.placement", f"{c.placement!r}; choose one of: {', '.join(PLACEMENTS)}")
    if c.strategy not in STRATEGIES:
        raise _bad("cluster.strategy", f"{c.strategy!r}; choose one of: {', '.join(STRATEGIES)}")
    sizes = {"trainer.dp": c.trainer.dp, "trainer.tp": c.trainer.tp, "trainer.ep": c.trainer.ep,
             "trainer.pp": c.trainer.pp, "rollout.replicas": c.rollout.replicas, "local_nodes": c.local_nodes}
    for key, val in sizes.items():
        if int(val) < 1:
            raise _bad(f"cluster.{key}", f"{val}; must be >= 1")
    for key, val in (("timeout_s", c.timeout_s), ("rollout.timeout_s", c.rollout.timeout_s),
                     ("local_node_cpus", c.local_node_cpus)):
        if not val > 0:
            raise _bad(f"cluster.{key}", f"{val!r}; must be > 0")
    for role in ("trainer", "rollout"):
        for k in ("num_cpus", "num_gpus"):
            if c[role].resources[k] < 0:
                raise _bad(f"cluster.{role}.resources.{k}", "must be >= 0")
    world = int(c.trainer.dp * c.trainer.tp * c.trainer.ep * c.trainer.pp)
    if c.backend == "local":
        for key, val in sizes.items():
            if key != "local_nodes" and val != 1:
                raise _bad(f"cluster.{key}", f"{val} needs several processes: set cluster.backend=ray "
                           f"(pip install 'rlcore[ray]')")
        if c.address:
            raise _bad("cluster.address", "is for cluster.backend=ray")
        return
    engine = str(cfg.engine.name)
    dims = ENGINE_DIMS.get(engine)
    if dims is None:
        raise _bad("cluster.backend", f"'ray' runs the engines {', '.join(ENGINE_DIMS)}; engine.name is {engine!r}")
    why = {"dp": "data parallelism over megatron ranks is not implemented (tp/ep ranks all train on the same "
                 "samples; see docs/scale.md)",
           "tp": "tp/ep are rlcore-megatron's (engine.name=megatron)",
           "ep": "tp/ep are rlcore-megatron's (engine.name=megatron)",
           "pp": "pipeline parallelism is not supported (megatron.pipeline_parallel_size must be 1 too)"}
    for dim in ("dp", "tp", "ep", "pp"):
        if dim not in dims and int(c.trainer[dim]) != 1:
            raise _bad(f"cluster.trainer.{dim}", f"{c.trainer[dim]}; engine {engine!r} runs only "
                       f"{', '.join(dims)} ranks: {why[dim]}")
    if str(cfg.rollout.backend) not in REPLICA_BACKENDS:
        raise _bad("rollout.backend", f"{cfg.rollout.backend!r} cannot run as a cluster rollout replica yet; "
                   f"cluster.backend=ray runs: {', '.join(REPLICA_BACKENDS)}")
    if str(cfg.sync.name) not in FLEET_SYNCS:
        raise _bad("sync.name", f"{cfg.sync.name!r} cannot feed cluster rollout replicas; "
                   f"cluster.backend=ray takes: {', '.join(FLEET_SYNCS)}")
    if c.placement == "colocated" and c.rollout.replicas > world:
        raise _bad("cluster.rollout.replicas", f"{c.rollout.replicas} colocated replicas need as many trainer "
                   f"ranks (there are {world}): each replica shares a trainer rank's bundle")
    if cfg.rollout.seed_per_prompt is False and c.rollout.replicas > 1:
        raise _bad("rollout.seed_per_prompt", "false with cluster.rollout.replicas > 1: the samples would depend "
                   "on how prompts are split across replicas; leave it unset or set it true")


def resolve_seed_per_prompt(cfg: Any) -> None:
    """``rollout.seed_per_prompt`` unset: on exactly when prompts are split across replicas."""
    if cfg.rollout.seed_per_prompt is None:
        cfg.rollout.seed_per_prompt = bool(cfg.cluster.backend == "ray" and cfg.cluster.rollout.replicas > 1)


#: rollout backends a ``sync.name: mapped`` push has been run into (their loader stages a copy)
MAPPED_BACKENDS = ("local",)


def check_mapped_sync(cfg: Any) -> None:
    """``sync.name: mapped`` lends the writer's parameters to replicas in other processes on its
    machine (:mod:`rlcore.mapped_sync`): Ray, colocated placement, and a replica backend
    it has run into; the hf engine's export is its parameters (a gathered export has none)."""
    if str(cfg.sync.name) != "mapped":
        return
    c = cfg.cluster
    if c.backend != "ray" or c.placement != "colocated":
        raise _bad("sync.name", "'mapped' lends the trainer's parameters to colocated rollout replicas: set "
                   "cluster.backend=ray and cluster.placement=colocated (in one process use sync.name=inproc)")
    if str(cfg.engine.name) != "hf":
        raise _bad("sync.name", f"'mapped' lends the engine's own parameters; engine {cfg.engine.name!r} exports "
                   f"tensors gathered for the push (use sync.name=inproc)")
    if str(cfg.rollout.backend) not in MAPPED_BACKENDS:
        raise _bad("sync.name", f"'mapped' into rollout.backend={cfg.rollout.backend!r} has not been built; it "
                   f"feeds: {', '.join(MAPPED_BACKENDS)} (use sync.name=inproc)")
