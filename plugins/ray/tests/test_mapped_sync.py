"""``sync.name: mapped`` belongs to rlcore-ray: its ``weight_sync`` hook registers it (listing it
imports neither torch nor Ray), it is declared by capability, and a rollout backend that cannot
stage what it is lent (no ``staged_load``) is refused before training, naming it, whoever wrote
it. The runs themselves are in test_cluster_ray.py, the transport in test_transport_mapped.py."""

from __future__ import annotations

import types

import pytest
from rlcore import errors, hookimpl
from rlcore.stack import resolve
from rlcore.testing.imports import modules_loaded_by
from rlcore.types import Cap, RolloutBackendSpec
from rlcore_ray.mapped_sync import mapped_sync_spec

LEND = ["plugins=[ray]", "cluster.backend=ray", "cluster.placement=colocated", "sync.name=mapped"]


def test_the_plugin_registers_mapped_without_importing_torch_or_ray():
    assert modules_loaded_by("import rlcore_ray.plugin as p; next(iter(p.weight_sync()))", ["torch", "ray"]) == []


def test_mapped_is_declared_by_capability_not_by_backend_name():
    spec = mapped_sync_spec()
    assert spec.name == "mapped" and spec.backends is None
    assert spec.capabilities == {Cap.VERIFIED, Cap.ATOMIC, Cap.CUDA_IPC, Cap.FEEDS_REPLICAS, Cap.LENDS_STORAGE}
    assert spec.requires_backend == {Cap.RECEIVE_BUCKETS, Cap.WEIGHT_CHECKSUMS, Cap.STAGED_LOAD}


@pytest.fixture
def with_ray(rlcore_plugin_manager, register_plugin):
    import rlcore_ray.plugin

    register_plugin(rlcore_ray.plugin, "ray", distribution="rlcore-ray", version="0.1.0")
    return rlcore_plugin_manager


def _backend_plugin(capabilities: set[str]) -> types.ModuleType:
    """A third party's rollout backend (core's local sampler under another name) that declares
    only ``capabilities``."""
    from rlcore.builtin import local

    factory = next(iter(local.rollout_backend())).factory
    mod = types.ModuleType("acme")
    mod.PLUGIN_API = 1
    mod.rollout_backend = hookimpl(lambda: [RolloutBackendSpec(name="acme", factory=factory,
                                                               capabilities=capabilities)])
    mod.rollout_backend.__name__ = "rollout_backend"
    return mod


def test_a_backend_that_cannot_stage_a_lent_storage_is_refused_naming_it(with_ray, register_plugin, rlcore_config):
    replica = {Cap.RECEIVE_BUCKETS, Cap.WEIGHT_CHECKSUMS, Cap.LOGPROBS, Cap.REPLICA}
    register_plugin(_backend_plugin(replica), "acme", distribution="acme-stack", version="1.0")
    with pytest.raises(errors.MissingCapabilityError) as err:
        resolve(rlcore_config(*LEND, "rollout.backend=acme"), with_ray)
    assert ("rollout_backend with capability 'staged_load' (sync.name 'mapped' (rlcore-ray 0.1.0) pushes through "
            "it), but the selected rollout_backend 'acme' (acme-stack 1.0) declares") in str(err.value)


def test_a_backend_that_declares_staged_load_is_fed(with_ray, register_plugin, rlcore_config):
    staged = {Cap.RECEIVE_BUCKETS, Cap.WEIGHT_CHECKSUMS, Cap.LOGPROBS, Cap.REPLICA, Cap.STAGED_LOAD}
    register_plugin(_backend_plugin(staged), "acme", distribution="acme-stack", version="1.0")
    stack = resolve(rlcore_config(*LEND, "rollout.backend=acme"), with_ray)
    assert stack.weight_sync.name == "mapped" and stack.weight_sync.distribution == "rlcore-ray 0.1.0"
    assert stack.rollout_backend.name == "acme"


def test_mapped_without_the_ray_plugin_active_names_the_plugin():
    # 'mapped' kept its name when it left core: the hint still finds its plugin (discovery.RENAMED_PROVIDERS)
    from pathlib import Path

    from rlcore.stack import load_stack

    tiny = Path(__file__).resolve().parents[3] / "examples" / "tiny.yaml"
    with pytest.raises(errors.UnknownProviderError, match=r"weight_sync 'mapped' comes with the plugin 'ray' \(rlcore-ray"):
        load_stack(tiny, ["sync.name=mapped"])


def test_mapped_into_a_local_rollout_loading_in_place_is_refused():
    # the local rollout stages a copy of each bucket unless rollout.local_update=in_place: then it
    # lacks staged_load, which a lent storage needs (it could change under the load)
    from pathlib import Path

    from rlcore.stack import load_stack

    tiny = Path(__file__).resolve().parents[3] / "examples" / "tiny.yaml"
    load_stack(tiny, LEND)  # staged (the default): accepted
    with pytest.raises(errors.RLCoreError, match="staged_load"):
        load_stack(tiny, [*LEND, "rollout.local_update=in_place"])
