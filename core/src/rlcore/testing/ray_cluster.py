"""Simulated Ray nodes for tests: the cluster ``cluster.local_nodes`` starts, joined by the test
process for a block, so several runs (and the actors a test makes itself) share one cluster."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def simulated_ray_nodes(nodes: int = 2, cpus_per_node: float = 2.0) -> Iterator[Any]:
    """Start ``nodes`` simulated nodes (:func:`rlcore.cluster.ray_launch.start_local_nodes`), join
    them (``rlcore train`` with ``cluster.backend=ray`` then runs on them), and take both down after."""
    import ray

    from rlcore.cluster.ray_launch import start_local_nodes

    cluster = start_local_nodes(nodes, cpus_per_node)
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
