"""The ``ray:`` config section: which Ray cluster the run joins and how its placement group packs.

Core's ``cluster:`` section holds what every multi-process launcher reads (the sizes, placement,
resources, timeouts); these keys are Ray's own. No Ray import here: ``rlcore check`` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlcore.errors import ConfigError

#: Ray's placement-group strategies
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass
class RaySettings:
    """``address``: the Ray cluster to join (``auto``, ``ray://head:10001``); unset, a Ray cluster
    is started on this machine with ``local_nodes`` simulated nodes of ``local_node_cpus`` CPUs
    each (``ray.cluster_utils.Cluster`` when more than one). ``strategy``: the placement group's
    strategy (``STRICT_PACK`` keeps every bundle on one node, ``STRICT_SPREAD`` one per node)."""

    address: str | None = None
    local_nodes: int = 1
    local_node_cpus: float = 2.0
    strategy: str = "PACK"


def _bad(key: str, msg: str) -> ConfigError:
    return ConfigError(f"bad value for config key {key!r}: {msg}", key=key)


def validate(section: Any) -> None:
    if section.strategy not in STRATEGIES:
        raise _bad("ray.strategy", f"{section.strategy!r}; choose one of: {', '.join(STRATEGIES)}")
    if int(section.local_nodes) < 1:
        raise _bad("ray.local_nodes", f"{section.local_nodes}; must be >= 1")
    if not float(section.local_node_cpus) > 0:
        raise _bad("ray.local_node_cpus", f"{section.local_node_cpus!r}; must be > 0")
