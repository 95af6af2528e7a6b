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
    with pytest.raises(ValueError, match="needs decoder layer 3"):
        layout.select(rollout[:, :2])
