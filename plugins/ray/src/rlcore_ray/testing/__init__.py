"""Simulated Ray nodes for tests: the cluster ``ray.local_nodes`` starts, joined by the test
process for a block, so several runs (and the actors a test makes itself) share one cluster."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def simulated_ray_nodes(nodes: int = 2, cpus_per_node: float = 2.0) -> Iterator[Any]:
    """Start ``nodes`` simulated nodes (:func:`rlcore_ray.launch.start_local_nodes`), join
    them (``rlcore train`` with ``cluster.backend=ray`` then runs on them), and take both down after."""
    import ray

    from rlcore_ray.launch import start_local_nodes

    cluster = start_local_nodes(nodes, cpus_per_node)
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def assert_reward_curves_agree(rows: list[dict], one_rows: list[dict], *, samples_per_step: int,
                               identical_at_least: int, first_step_equal: bool = False) -> tuple[list, list]:
    """A multi-process run's reward curve against the single-process run of the same seed
    (``metrics.jsonl`` rows): at most one flipped sample in any step (``1 / samples_per_step`` of a
    step's mean reward) and at least ``identical_at_least`` steps identical; ``first_step_equal``:
    step 0 must be identical too (same initial weights, same samples). The tolerance is argued in
    docs/scale.md. Returns both curves."""
    a = [r["reward_mean"] for r in rows]
    b = [r["reward_mean"] for r in one_rows]
    diffs = [abs(x - y) for x, y in zip(a, b, strict=True)]
    if first_step_equal:
        assert diffs[0] == 0, (a, b)
    assert max(diffs) <= 1 / samples_per_step + 1e-9, (a, b)
    assert sum(d == 0 for d in diffs) >= identical_at_least, (a, b)
    return a, b
