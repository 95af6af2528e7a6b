"""The ``ray:`` section says where the run's processes run, not what they train: it stays out of the
training fingerprint (``PluginSettings.affects_training=False``), so a run resumed on another Ray
cluster (other ``ray.address``, ``ray.local_nodes``, ...) needs no ``--allow-config-change``, as
core's ``cluster:`` section never did."""

from __future__ import annotations

from pathlib import Path

from rlcore.config import training_fingerprint
from rlcore.stack import load_stack

TINY = Path(__file__).resolve().parents[3] / "examples" / "tiny.yaml"
RAY = ["plugins=[ray]", "cluster.backend=ray"]


def _fingerprint(*overrides: str) -> dict:
    stack = load_stack(TINY, [*RAY, *overrides])
    return training_fingerprint(stack.config, stack.plugins.plugin_settings())


def test_the_ray_section_is_not_part_of_the_training_fingerprint():
    one = _fingerprint()
    assert not any(key.startswith("ray.") for key in one)
    assert _fingerprint("ray.local_nodes=3", "ray.strategy=SPREAD") == one


def test_a_section_that_affects_training_still_is():
    # core's own keys (and any plugin section that does not opt out) are compared on --resume
    assert _fingerprint("training.lr=0.002") != _fingerprint()
