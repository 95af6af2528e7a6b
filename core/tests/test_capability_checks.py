"""Core's config rules that depended on a provider's name are capability checks: a third-party
provider that declares the capability gets the feature, one that lacks it is refused naming the
setting, the provider and its distribution (providers registered as in test_stack.py)."""

import types

import pytest

from rlcore import errors, hookimpl
from rlcore.preflight import preflight
from rlcore.stack import resolve
from rlcore.types import Cap, EngineSpec, RolloutBackendSpec

#: what the built-in inproc sync needs of a backend (so the stack resolves up to the rule under test)
_RECEIVES = {Cap.LOGPROBS, Cap.RECEIVE_BUCKETS, Cap.WEIGHT_CHECKSUMS}


def _backend_plugin(name, capabilities):
    mod = types.ModuleType(name)
    mod.PLUGIN_API = 1

    def rollout_backend():
        yield RolloutBackendSpec(name=name, factory=lambda ctx: None, capabilities=capabilities)

    mod.rollout_backend = hookimpl(rollout_backend)
    return mod


def _engine_plugin(name, capabilities):
    mod = types.ModuleType(name)
    mod.PLUGIN_API = 1

    def engine():
        yield EngineSpec(name=name, factory=lambda ctx: None, capabilities=capabilities)

    mod.engine = hookimpl(engine)
    return mod


@pytest.mark.parametrize("setting,cap", [
    ("rollout.draft_depths=1", Cap.POLICY_MTP_DRAFTS),
    ("rollout.local_update=in_place", Cap.IN_PLACE_LOAD),
])
def test_a_local_rollout_setting_needs_a_backend_that_declares_reading_it(
        rlcore_plugin_manager, register_plugin, rlcore_config, setting, cap):
    register_plugin(_backend_plugin("acme-gen", _RECEIVES), "acme_gen", distribution="acme-gen", version="1.0")
    register_plugin(_backend_plugin("acme-draft", _RECEIVES | {cap}), "acme_draft")
    overrides = [setting, "engine.model.tiny.mtp_layers=1"]
    with pytest.raises(errors.MissingCapabilityError) as refused:
        resolve(rlcore_config(*overrides, "rollout.backend=acme-gen"), rlcore_plugin_manager)
    msg = str(refused.value)
    assert f"capability {cap!r}" in msg and setting.split("=")[0] in msg and "'acme-gen' (acme-gen 1.0)" in msg
    # a third-party backend that declares it runs the setting (refused by name before)
    assert resolve(rlcore_config(*overrides, "rollout.backend=acme-draft"), rlcore_plugin_manager).rollout_backend.name \
        == "acme-draft"
    # the built-in local backend declares both
    assert resolve(rlcore_config(*overrides), rlcore_plugin_manager).rollout_backend.name == "local"


def test_tiny_mtp_layers_over_moe_need_an_engine_that_builds_them(rlcore_plugin_manager, register_plugin,
                                                                   rlcore_config):
    register_plugin(_engine_plugin("acme-mtp", {Cap.MOE, Cap.MTP, Cap.MOE_MTP}), "acme_mtp",
                    distribution="acme-mtp", version="2.0")
    overrides = ["engine.model.tiny.arch=qwen3_moe", "engine.model.tiny.mtp_layers=1"]
    with pytest.raises(errors.MissingCapabilityError) as refused:
        resolve(rlcore_config(*overrides), rlcore_plugin_manager)  # hf: transformers has no MoE MTP layers
    msg = str(refused.value)
    assert "capability 'moe_mtp'" in msg and "engine.model.tiny.mtp_layers=1" in msg and "'qwen3_moe'" in msg
    assert "engine 'hf' (rlcore " in msg
    stack = resolve(rlcore_config(*overrides, "engine.name=acme-mtp"), rlcore_plugin_manager)
    assert stack.engine.distribution == "acme-mtp 2.0"
    # the same shapes without MTP layers, or MTP over qwen2 (MiMo), are the hf engine's
    resolve(rlcore_config("engine.model.tiny.arch=qwen3_moe"), rlcore_plugin_manager)
    resolve(rlcore_config("engine.model.tiny.mtp_layers=1"), rlcore_plugin_manager)


def test_preflight_measures_the_model_of_an_engine_that_builds_it_from_engine_model(
        rlcore_plugin_manager, register_plugin, rlcore_config):
    register_plugin(_engine_plugin("acme-own", set()), "acme_own")
    register_plugin(_engine_plugin("acme-core-model", {Cap.ENGINE_MODEL}), "acme_core_model")
    own = preflight(resolve(rlcore_config("engine.name=acme-own"), rlcore_plugin_manager))
    assert own.model is None and any("engine 'acme-own'" in s and "engine_model" in s for s in own.skipped)
    measured = preflight(resolve(rlcore_config("engine.name=acme-core-model"), rlcore_plugin_manager))
    assert measured.model is not None and measured.model.source.startswith("tiny") and measured.prompts_checked > 0
