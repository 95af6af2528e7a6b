"""Stack resolution: platform gaps of declared capabilities are reported and enforced."""

import types

import pytest

from rlcore import errors, hookimpl
from rlcore.stack import resolve
from rlcore.types import Cap, RolloutBackendSpec


def _gappy_plugin():
    mod = types.ModuleType("gappy")
    mod.PLUGIN_API = 1

    def rollout_backend():
        yield RolloutBackendSpec(
            name="gappy", factory=lambda ctx: None,
            capabilities={Cap.LOGPROBS, Cap.RELEASE_KV_CACHE, Cap.RECEIVE_BUCKETS, Cap.WEIGHT_CHECKSUMS},
            platform_gaps=lambda cfg: {Cap.RELEASE_KV_CACHE: "no sleep mode on this CPU build", "undeclared": "ignored"},
        )

    mod.rollout_backend = hookimpl(rollout_backend)
    return mod


def test_platform_gap_is_reported(rlcore_plugin_manager, register_plugin, rlcore_config):
    register_plugin(_gappy_plugin(), "gappy")
    stack = resolve(rlcore_config("rollout.backend=gappy"), rlcore_plugin_manager)
    assert stack.gaps["rollout_backend"] == {Cap.RELEASE_KV_CACHE: "no sleep mode on this CPU build"}
    assert "rollout_backend 'gappy' lacks 'release_kv_cache' here: no sleep mode on this CPU build" in stack.notes
    assert any("stays resident during weight sync" in n for n in stack.notes)
    assert not stack.has("rollout_backend", Cap.RELEASE_KV_CACHE)


def test_platform_gap_refuses_a_config_that_needs_it(rlcore_plugin_manager, register_plugin, rlcore_config):
    register_plugin(_gappy_plugin(), "gappy")
    with pytest.raises(errors.MissingCapabilityError) as e:
        resolve(rlcore_config("rollout.backend=gappy", "rollout.release_kv_cache=always"), rlcore_plugin_manager)
    assert "declares it but cannot provide it here: no sleep mode on this CPU build" in str(e.value)


def test_route_layout_select_keeps_moe_layers_and_fills_mtp():
    import torch

    from rlcore.types import RouteLayout

    layout = RouteLayout(layers=(1, 3, 4), topk=2, num_experts=8, num_hidden_layers=4)  # layer 4 = MTP depth 0
    rollout = torch.arange(5 * 4 * 2).view(5, 4, 2)  # what an engine reports: every decoder layer
    got = layout.select(rollout)
    assert got.shape == (5, 3, 2)
    assert torch.equal(got[:, 0], rollout[:, 1]) and torch.equal(got[:, 1], rollout[:, 3])
    assert torch.all(got[:, 2] == -1)
    with pytest.raises(ValueError, match="routes have 2 layers; the model has 4 decoder layers"):
        layout.select(rollout[:, :2])
    both = torch.arange(5 * 5 * 2).view(5, 5, 2)  # decoder + MTP layers: the MTP column is kept
    assert torch.equal(layout.select(both)[:, 2], both[:, 4])


def test_route_layout_select_refuses_a_wider_model():
    """Routes of 7 layers for a 5-layer + MTP model (found by an outside check) were cut to a subset of
    columns and replayed; every count but the model's is an error naming both counts."""
    import torch

    from rlcore.types import RouteLayout

    layout = RouteLayout(layers=(0, 1, 2, 3, 4, 5), topk=2, num_experts=8, num_hidden_layers=5)
    for wrong in (7, 4, 2):
        with pytest.raises(ValueError, match=f"routes have {wrong} layers; the model has 5 decoder layers [+] 1 MTP"):
            layout.select(torch.zeros(3, wrong, 2, dtype=torch.long))
    assert layout.select(torch.zeros(3, 5, 2, dtype=torch.long)).shape == (3, 6, 2)
    assert layout.select(torch.zeros(3, 6, 2, dtype=torch.long)).shape == (3, 6, 2)
