"""The ``ray`` launcher's config-time side, without starting Ray: it is selected like every plugin's
provider (``plugins: [ray]``), its ``ray:`` section is checked naming the key, and what it runs is
decided by the providers' declared capabilities, never their names: a provider that lacks one is
refused naming the key, the provider and its distribution, whoever wrote it."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
import tomllib
from rlcore import errors, hookimpl
from rlcore.stack import load_stack, resolve
from rlcore.types import Cap, EngineSpec, RolloutBackendSpec, WeightSyncSpec

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "tiny.yaml"
RAY = ["plugins=[ray]", "cluster.backend=ray"]


def test_ray_is_a_plugin_to_activate():
    with pytest.raises(errors.UnknownProviderError) as err:
        load_stack(str(EXAMPLE), ["cluster.backend=ray"])
    assert err.value.key == "cluster.backend"
    assert "comes with the plugin 'ray' (rlcore-ray 0.1.0), which is installed but not active: add ray" in str(err.value)
    stack = load_stack(str(EXAMPLE), RAY)
    assert stack.launcher.name == "ray" and stack.launcher.distribution == "rlcore-ray 0.1.0"
    assert stack.config.ray.local_nodes == 1 and stack.config.ray.strategy == "PACK"
    assert not stack.launcher.ranks_are_remote(stack.config)
    remote = load_stack(str(EXAMPLE), [*RAY, "ray.address=auto"])
    assert remote.launcher.ranks_are_remote(remote.config)


@pytest.mark.parametrize("override,key", [
    ("ray.strategy=EVERYWHERE", "ray.strategy"),
    ("ray.local_nodes=0", "ray.local_nodes"),
    ("ray.local_node_cpus=0", "ray.local_node_cpus"),
    ("ray.nodes=2", "ray.nodes"),
])
def test_bad_ray_values_name_the_key(override, key):
    with pytest.raises(errors.ConfigError) as err:
        load_stack(str(EXAMPLE), [*RAY, override])
    assert err.value.key == key and key in str(err.value)


def test_the_cluster_section_keeps_only_what_every_launcher_reads():
    with pytest.raises(errors.ConfigError) as err:
        load_stack(str(EXAMPLE), [*RAY, "cluster.local_nodes=2"])
    assert err.value.key == "cluster.local_nodes"


def test_what_the_built_in_providers_can_run_comes_from_their_capabilities():
    with pytest.raises(errors.ConfigError) as err:
        load_stack(str(EXAMPLE), [*RAY, "cluster.trainer.tp=2"])
    assert err.value.key == "cluster.trainer.tp"
    assert "'tensor_parallel'; engine 'hf' (rlcore 0.1.0) declares: data_parallel" in str(err.value)
    with pytest.raises(errors.ConfigError, match="'pipeline_parallel'") as err:
        load_stack(str(EXAMPLE), [*RAY, "cluster.trainer.pp=2"])
    assert err.value.key == "cluster.trainer.pp"
    with pytest.raises(errors.ConfigError, match="colocated replicas need as many trainer ranks"):
        load_stack(str(EXAMPLE), [*RAY, "cluster.placement=colocated", "cluster.rollout.replicas=2"])
    with pytest.raises(errors.ConfigError, match="depend on how prompts are split") as err:
        load_stack(str(EXAMPLE), [*RAY, "cluster.rollout.replicas=2", "rollout.seed_per_prompt=false"])
    assert err.value.key == "rollout.seed_per_prompt"
    stack = load_stack(str(EXAMPLE), [*RAY, "cluster.trainer.dp=2", "cluster.rollout.replicas=2"])
    assert stack.config.rollout.seed_per_prompt is True
    assert load_stack(str(EXAMPLE)).config.rollout.seed_per_prompt is False


def _providers(name, *, engine_caps, backend_caps, sync_caps):
    """A third party's engine, backend and sync (the built-in hf engine, local rollout and inproc
    push under other names) declaring only the given capabilities."""
    from rlcore.builtin import hf, inproc, local

    def first(module, hook):
        return next(iter(getattr(module, hook)()))

    mod = types.ModuleType(name)
    mod.PLUGIN_API = 1
    e, b, s = first(hf, "engine"), first(local, "rollout_backend"), first(inproc, "weight_sync")
    mod.engine = hookimpl(lambda: [EngineSpec(name="plain", factory=e.factory, capabilities=engine_caps)])
    mod.engine.__name__ = "engine"
    mod.rollout_backend = hookimpl(lambda: [RolloutBackendSpec(name="plain", factory=b.factory,
                                                               capabilities=backend_caps)])
    mod.rollout_backend.__name__ = "rollout_backend"
    mod.weight_sync = hookimpl(lambda: [WeightSyncSpec(name="plain", factory=s.factory, capabilities=sync_caps,
                                                       requires_backend=s.requires_backend)])
    mod.weight_sync.__name__ = "weight_sync"
    return mod


@pytest.fixture
def with_ray(rlcore_plugin_manager, register_plugin):
    import rlcore_ray.plugin

    register_plugin(rlcore_ray.plugin, "ray", distribution="rlcore-ray", version="0.1.0")
    return rlcore_plugin_manager


def test_a_third_party_provider_without_the_capability_is_refused_naming_it(with_ray, register_plugin,
                                                                               rlcore_config):
    local_caps = {Cap.RECEIVE_BUCKETS, Cap.WEIGHT_CHECKSUMS, Cap.LOGPROBS}
    register_plugin(_providers("acme", engine_caps=set(), backend_caps=local_caps, sync_caps={Cap.VERIFIED}),
                    "acme", distribution="acme-stack", version="1.0")
    plain = ["plugins=[ray]", "cluster.backend=ray", "engine.name=plain", "rollout.backend=plain", "sync.name=plain"]
    with pytest.raises(errors.ConfigError) as err:
        resolve(rlcore_config(*plain, "cluster.trainer.dp=2"), with_ray)
    assert err.value.key == "cluster.trainer.dp"
    assert "need an engine that declares 'data_parallel'; engine 'plain' (acme-stack 1.0)" in str(err.value)
    with pytest.raises(errors.ConfigError) as err:
        resolve(rlcore_config(*plain), with_ray)
    assert err.value.key == "rollout.backend"
    assert "declares 'replica'; rollout.backend 'plain' (acme-stack 1.0)" in str(err.value)


def test_data_and_model_parallel_ranks_together_need_both_capabilities(with_ray, register_plugin, rlcore_config):
    """An engine declaring both kinds runs dp beside tp (model-parallel replicas splitting the samples)."""
    backend_caps = {Cap.RECEIVE_BUCKETS, Cap.WEIGHT_CHECKSUMS, Cap.LOGPROBS, Cap.REPLICA}
    register_plugin(_providers("acme", engine_caps={Cap.DATA_PARALLEL, Cap.TENSOR_PARALLEL},
                               backend_caps=backend_caps, sync_caps={Cap.VERIFIED, Cap.FEEDS_REPLICAS}),
                    "acme", distribution="acme-stack", version="1.0")
    plain = ["plugins=[ray]", "cluster.backend=ray", "engine.name=plain", "rollout.backend=plain", "sync.name=plain"]
    assert resolve(rlcore_config(*plain, "cluster.trainer.tp=2"), with_ray).launcher.name == "ray"
    assert resolve(rlcore_config(*plain, "cluster.trainer.dp=2"), with_ray).launcher.name == "ray"
    both = resolve(rlcore_config(*plain, "cluster.trainer.dp=2", "cluster.trainer.tp=2"), with_ray)
    assert both.launcher.name == "ray"


def test_a_sync_must_feed_replicas_and_a_lending_one_needs_the_engines_own_parameters(with_ray, register_plugin,
                                                                                        rlcore_config):
    backend_caps = {Cap.RECEIVE_BUCKETS, Cap.WEIGHT_CHECKSUMS, Cap.LOGPROBS, Cap.REPLICA, Cap.STAGED_LOAD}
    register_plugin(_providers("acme", engine_caps={Cap.DATA_PARALLEL}, backend_caps=backend_caps,
                               sync_caps={Cap.VERIFIED}), "acme", distribution="acme-stack", version="1.0")
    plain = ["plugins=[ray]", "cluster.backend=ray", "engine.name=plain", "rollout.backend=plain"]
    assert resolve(rlcore_config(*plain, "cluster.trainer.dp=2"), with_ray).launcher.name == "ray"
    with pytest.raises(errors.ConfigError) as err:
        resolve(rlcore_config(*plain, "sync.name=plain"), with_ray)
    assert err.value.key == "sync.name"
    assert "declares 'feeds_replicas'; sync.name 'plain' (acme-stack 1.0)" in str(err.value)
    lend = [*plain, "sync.name=mapped", "cluster.placement=colocated"]
    with pytest.raises(errors.ConfigError) as err:
        resolve(rlcore_config(*lend), with_ray)
    assert err.value.key == "sync.name" and "'exports_own_parameters'; engine 'plain' (acme-stack 1.0)" in str(err.value)
    assert resolve(rlcore_config(*lend, "engine.name=hf"), with_ray).weight_sync.name == "mapped"


def test_check_prints_the_ray_line(capsys, monkeypatch):
    from rlcore.testing.runs import main

    monkeypatch.delenv("RLCORE_PLUGINS", raising=False)
    assert main(["check", str(EXAMPLE), *RAY, "cluster.trainer.dp=2", "cluster.rollout.replicas=2",
                 "ray.local_nodes=2"]) == 0
    out = capsys.readouterr().out
    assert "launcher         ray            from rlcore-ray 0.1.0  ray (started here, 2 node(s)): trainer ranks " \
           "dp=2 tp=1 ep=1 pp=1, 2 rollout replica(s), disaggregated, PACK" in out


def test_checking_a_ray_stack_imports_no_ray():
    """The launcher's factory, check and describe run at every `rlcore check`: they stay cheap."""
    from rlcore.testing.imports import modules_loaded_by

    statements = ("from rlcore.stack import load_stack\n"
                  f"s = load_stack({str(EXAMPLE)!r}, {[*RAY, 'cluster.trainer.dp=2', 'cluster.rollout.replicas=2']!r})\n"
                  "print(s.launcher.factory(s.config).describe(s))")
    assert modules_loaded_by(statements, ["ray", "rlcore_ray.launch", "rlcore_ray.fleet"]) == []


def test_ray_missing_names_the_install_line(monkeypatch):
    from rlcore_ray import launch

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(errors.ConfigError, match=r"pip install rlcore-ray"):
        launch.import_ray()


def test_bundles():
    from omegaconf import OmegaConf
    from rlcore.config import RunConfig
    from rlcore_ray.launch import plan_bundles

    c = OmegaConf.structured(RunConfig).cluster
    c.trainer.dp, c.rollout.replicas = 2, 2
    c.rollout.resources.num_gpus = c.trainer.resources.num_gpus = 0.5
    assert plan_bundles(c) == ([{"CPU": 1.0, "GPU": 0.5}] * 2 + [{"CPU": 1.0, "GPU": 0.5}] * 2, [0, 1], [2, 3])
    c.placement = "colocated"
    assert plan_bundles(c) == ([{"CPU": 2.0, "GPU": 1.0}] * 2, [0, 1], [0, 1])


def test_core_pulls_and_imports_no_ray():
    """``pip install rlcore`` installs no Ray (its ``ray`` extra is this distribution), and no core
    module imports it: every module of the rlcore package is imported in a fresh interpreter."""
    project = tomllib.loads((ROOT / "core" / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.split(">")[0].split("=")[0].strip() == "ray"]
    assert project["optional-dependencies"]["ray"] == ["rlcore-ray>=0.1,<0.2"]
    code = ("import importlib, pkgutil, sys, rlcore\n"
            "names = [m.name for m in pkgutil.walk_packages(rlcore.__path__, 'rlcore.')]\n"
            "for n in names: importlib.import_module(n)\n"
            "print(len(names), sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    count, imported = out.stdout.split(" ", 1)
    assert int(count) > 50 and imported.strip() == "[]", out.stdout
