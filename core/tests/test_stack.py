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


def test_every_role_of_one_name_is_selected_from_its_key_in_the_role_table(rlcore_plugin_manager, rlcore_config):
    """resolve reads the role table (rlcore.hookspecs.ROLES): each role with a key of one name
    holds the provider that key names, as Stack.role(hook) and as the field of that name."""
    from omegaconf import OmegaConf
    from rlcore.hookspecs import ROLES
    from rlcore.stack import ONE_ROLES

    cfg = rlcore_config()
    stack = resolve(cfg, rlcore_plugin_manager)
    keyed = [hook for hook, role in ROLES.items() if role.selects == "one" and role.key]
    assert set(keyed) <= set(ONE_ROLES) and {"engine", "launcher", "environment", "algorithm"} <= set(keyed)
    for hook in keyed:
        assert stack.role(hook).name == str(OmegaConf.select(cfg, ROLES[hook].key)), hook
        assert stack.role(hook) is getattr(stack, hook)
    assert stack.role("platform").name == "cpu"  # core's rule: engine.device's kind
    with pytest.raises(ValueError, match="'tool' is not a role that selects one provider"):
        stack.role("tool")


def test_a_capability_rule_on_any_role_of_one_the_launcher_too(rlcore_plugin_manager, register_plugin, rlcore_config):
    """RequiresCapability takes any role of the table: here a plugin that needs a launcher that
    places the ranks, refused under core's local launcher naming it."""
    from rlcore.types import RequiresCapability

    mod = types.ModuleType("needs_ranks")
    mod.PLUGIN_API = 1
    mod.constraints = hookimpl(lambda: [RequiresCapability("launcher", Cap.PLACES_RANKS, "it shards over ranks")])
    register_plugin(mod, "needs_ranks")
    with pytest.raises(errors.MissingCapabilityError,
                       match="needs launcher with capability 'places_ranks' \\(it shards over ranks\\), but the "
                             "selected launcher 'local'"):
        resolve(rlcore_config(), rlcore_plugin_manager)


def test_rlcore_plugins_roles_lists_the_role_table():
    import json
    import subprocess
    import sys

    from rlcore.hookspecs import ROLES

    out = subprocess.run([sys.executable, "-m", "rlcore.cli", "plugins", "--roles", "--json"], capture_output=True,
                         text=True, check=True)
    rows = {row["role"]: row for row in json.loads(out.stdout)}
    assert list(rows) == list(ROLES)
    assert rows["engine"]["key"] == "engine.name" and "hf" in rows["engine"]["provided"]
    assert rows["launcher"]["key"] == "cluster.backend" and "local" in rows["launcher"]["provided"]
    assert rows["platform"]["key"] is None and "engine.device" in rows["platform"]["selected_by"]
    assert rows["tool"]["selects"] == "many"
