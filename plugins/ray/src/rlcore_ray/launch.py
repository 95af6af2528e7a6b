"""``cluster.backend: ray``: trainer ranks and rollout replicas as Ray actors in one placement group.

The driver (the ``rlcore train`` process) joins or starts a Ray cluster, reserves one placement
group (a bundle per trainer rank, and per rollout replica when disaggregated; colocated, replica
*i* shares trainer rank *i*'s bundle), starts the replicas, then the trainer ranks, which join
torch.distributed (gloo on CPU, NCCL on GPU) with rank 0's node as the master. Rank 0 (the
writer) drives the replicas through a :class:`~rlcore_ray.fleet.RolloutFleet`. The driver
waits for every rank; the first rank to fail ends the run: every actor is killed and that rank's
error is raised here (nobody is left waiting in a collective).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from rlcore.errors import ConfigError, RLCoreError

INSTALL = "pip install rlcore-ray"


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(f"cluster.backend=ray needs Ray, which is not installed (rlcore-ray depends on it): {INSTALL}",
                          key="cluster.backend") from exc
    return ray


class TrainerRankActor:
    """A trainer rank (made a Ray actor below)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def where(self) -> dict[str, Any]:
        import ray

        return {"rank": self.rank, "pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()}

    def master_address(self) -> str:
        import ray
        from rlcore.parallel.worker import free_port

        return f"{ray.util.get_node_ip_address()}:{free_port()}"

    def run(self, config_yaml: str, master: str, replicas: list[Any] | None, timeout_s: float,
            flags: dict[str, bool], placement: dict[str, Any]) -> dict[str, Any]:
        from rlcore.parallel.worker import run_rank

        from rlcore_ray.fleet import RolloutFleet

        fleet = RolloutFleet(replicas, timeout_s) if replicas else None
        summary = run_rank(config_yaml, self.rank, self.world, master, rollout=fleet, **flags)
        if self.rank == 0 and summary.get("output"):
            (Path(summary["output"]) / "cluster.json").write_text(json.dumps(placement, indent=2) + "\n")
        return summary


def _bundle(res: Any, extra: Any = None) -> dict[str, float]:
    cpus = float(res.num_cpus) + (float(extra.num_cpus) if extra is not None else 0.0)
    gpus = float(res.num_gpus) + (float(extra.num_gpus) if extra is not None else 0.0)
    out = {"CPU": cpus}
    if gpus:
        out["GPU"] = gpus
    return out


def plan_bundles(c: Any) -> tuple[list[dict[str, float]], list[int], list[int]]:
    """Bundles of the placement group, trainer rank *i*'s bundle index and replica *j*'s."""
    world = int(c.trainer.dp * c.trainer.tp * c.trainer.ep * c.trainer.pp)
    replicas = int(c.rollout.replicas)
    if c.placement == "colocated":
        bundles = [_bundle(c.trainer.resources, c.rollout.resources if i < replicas else None) for i in range(world)]
        return bundles, list(range(world)), list(range(replicas))
    bundles = [_bundle(c.trainer.resources) for _ in range(world)] + [_bundle(c.rollout.resources)] * replicas
    return bundles, list(range(world)), [world + j for j in range(replicas)]


def start_local_nodes(nodes: int, cpus_per_node: float) -> Any:
    """A Ray cluster of ``nodes`` simulated nodes on this machine (``ray.cluster_utils.Cluster``),
    not yet joined; ``.shutdown()`` stops it."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus_per_node})
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=cpus_per_node)
    return cluster


class _Cluster:
    """The Ray connection this run made (and the local cluster it started, if any); ``r``: the
    ``ray:`` section."""

    def __init__(self, ray: Any, r: Any):
        self.ray, self.local, self.started = ray, None, False
        if ray.is_initialized():
            return
        if r.address:
            ray.init(address=r.address, log_to_driver=True)
        elif r.local_nodes > 1:
            self.local = start_local_nodes(int(r.local_nodes), float(r.local_node_cpus))
            ray.init(address=self.local.address, log_to_driver=True)
        else:
            ray.init(include_dashboard=False, log_to_driver=True)
        self.started = True

    def close(self) -> None:
        if self.started:
            self.ray.shutdown()
        if self.local is not None:
            self.local.shutdown()


def _cause(exc: BaseException) -> BaseException:
    from ray.exceptions import RayTaskError

    cause = getattr(exc, "cause", None) if isinstance(exc, RayTaskError) else None
    return cause if isinstance(cause, BaseException) else exc


def train_on_ray(stack: Any, *, resume: bool = False, overwrite: bool = False, allow_config_change: bool = False,
                 console: Any = None) -> dict[str, Any]:
    """Run the stack's training on Ray (see the module docstring); the writer rank's summary."""
    ray = import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    from rlcore.parallel.worker import config_yaml

    from rlcore_ray.fleet import RolloutReplica

    cfg = stack.config
    c = cfg.cluster
    # every process must agree on the output directory (a default one is named by the clock)
    cfg.output.dir = str(Path(cfg.output.dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}").resolve())
    text = config_yaml(cfg)
    say = console.print if console is not None else print
    tag = uuid.uuid4().hex[:8]  # actor names of this run (a previous run's may not be released yet)
    strategy = str(cfg.ray.strategy)
    conn = _Cluster(ray, cfg.ray)
    pg, actors = None, []
    try:
        bundles, rank_bundle, replica_bundle = plan_bundles(c)
        pg = placement_group(bundles, strategy=strategy)
        ready, _ = ray.wait([pg.ready()], timeout=float(c.timeout_s))
        if not ready:
            raise RLCoreError(f"the placement group {bundles} ({strategy}) could not be placed within "
                              f"cluster.timeout_s={c.timeout_s:g} s; the cluster has {ray.cluster_resources()}")

        def on(bundle: int, res: Any, **kw: Any) -> dict[str, Any]:
            return dict(num_cpus=float(res.num_cpus), num_gpus=float(res.num_gpus), max_restarts=0,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle),
                        **kw)

        replicas = [ray.remote(RolloutReplica).options(**on(b, c.rollout.resources, name=f"rlcore-{tag}-rollout-{j}"))
                    .remote(text, j, cfg.output.dir) for j, b in enumerate(replica_bundle)]
        world = len(rank_bundle)
        ranks = [ray.remote(TrainerRankActor).options(**on(b, c.trainer.resources, name=f"rlcore-{tag}-trainer-{i}"))
                 .remote(i, world) for i, b in enumerate(rank_bundle)]
        actors = replicas + ranks
        placement = {"trainer_ranks": ray.get([r.where.remote() for r in ranks], timeout=float(c.timeout_s)),
                     "rollout_replicas": ray.get([r.where.remote() for r in replicas], timeout=float(c.timeout_s)),
                     "placement": str(c.placement), "bundles": bundles}
        nodes = sorted({w["node"] for w in placement["trainer_ranks"] + placement["rollout_replicas"]})
        say(f"ray: {world} trainer rank(s), {len(replicas)} rollout replica(s) ({c.placement}) on {len(nodes)} "
            f"node(s): " + ", ".join(f"rank {w['rank']}@{nodes.index(w['node'])}" for w in placement["trainer_ranks"])
            + "; " + ", ".join(f"replica {w['replica']}@{nodes.index(w['node'])}"
                               for w in placement["rollout_replicas"]))
        master = ray.get(ranks[0].master_address.remote(), timeout=float(c.timeout_s))
        flags = {"resume": resume, "overwrite": overwrite, "allow_config_change": allow_config_change}
        refs = [r.run.remote(text, master, replicas if i == 0 else None, float(c.rollout.timeout_s), flags, placement)
                for i, r in enumerate(ranks)]
        results: dict[Any, Any] = {}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                results[done[0]] = ray.get(done[0])
            except Exception as exc:  # the first rank to fail ends the run
                cause = _cause(exc)
                rank = refs.index(done[0])
                if isinstance(cause, RLCoreError):
                    raise cause from None
                raise RLCoreError(f"trainer rank {rank} failed: {type(cause).__name__}: {cause}") from exc
        summary = dict(results[refs[0]])
        summary["cluster"] = placement
        return summary
    finally:
        for a in actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if pg is not None:
            remove_placement_group(pg)
        conn.close()
