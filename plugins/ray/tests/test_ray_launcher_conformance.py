"""The ``ray`` launcher against core's launcher conformance suite
(:mod:`rlcore.testing.launcher_conformance`): two data-parallel trainer ranks and one rollout
replica on two simulated nodes train the tiny GRPO run, write the run directory core promises,
refuse to write over it and resume it, as the built-in ``local`` launcher does."""

from __future__ import annotations

import pytest
from rlcore.testing.launcher_conformance import LauncherConformance



@pytest.fixture(scope="module")
def two_nodes():
    from rlcore_ray.testing import simulated_ray_nodes

    with simulated_ray_nodes(2, 2) as cluster:
        yield cluster


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("two_nodes")]


class TestRayLauncher(LauncherConformance):
    overrides = ["plugins=[ray]", "cluster.backend=ray", "cluster.trainer.dp=2", "cluster.rollout.replicas=1",
                 "cluster.timeout_s=240", "output.progress=false"]
