"""Plugin registration, config section and stack rules. No SGLang needed: runs in the main venv and
in the sglang venv."""

from __future__ import annotations

import pytest
import rlcore_sglang.plugin as sglang_plugin
from rlcore import config as cfgmod
from rlcore.errors import ConfigError, IncompatiblePluginsError, MissingCapabilityError
from rlcore.stack import resolve
from rlcore.testing.imports import modules_loaded_by
from rlcore.types import Cap
from rlcore_sglang.settings import check_settings


def test_plugin_import_loads_neither_sglang_nor_torch():
    assert modules_loaded_by("import rlcore_sglang.plugin", ["sglang", "torch"]) == []


def test_registers_backend_three_syncs_and_section(register_plugin, rlcore_plugin_manager):
    register_plugin(sglang_plugin, "sglang")
    backend = rlcore_plugin_manager.select("rollout_backend", "sglang", key="rollout.backend")
    assert backend.capabilities == sglang_plugin.BACKEND_CAPABILITIES
    # never claims the in-process receiver protocols of core's inproc/disk syncs
    assert not backend.capabilities & {Cap.RECEIVE_BUCKETS, Cap.RECEIVE_DISK, Cap.WEIGHT_CHECKSUMS}
    syncs = {name: rlcore_plugin_manager.select("weight_sync", name, key="sync.name")
             for name in ("sglang-tensor", "sglang-nccl", "sglang-disk")}
    for spec in syncs.values():
        assert spec.backends == frozenset({"sglang"})
        assert {Cap.BUCKETED, Cap.VERIFIED} <= spec.capabilities
        assert Cap.ATOMIC not in spec.capabilities  # SGLang loads in place
    assert Cap.CUDA_IPC in syncs["sglang-tensor"].capabilities
    assert Cap.NCCL in syncs["sglang-nccl"].capabilities
    assert "sglang" in {ps.section for ps in rlcore_plugin_manager.plugin_settings()}


def test_config_defaults_and_value_errors(register_plugin, rlcore_config):
    register_plugin(sglang_plugin, "sglang")
    cfg = rlcore_config("rollout.backend=sglang", "sync.name=sglang-tensor", "sglang.launch_args=[--tp-size,2]")
    assert cfg.sglang.mode == "server" and list(cfg.sglang.launch_args) == ["--tp-size", "2"]
    check_settings(cfg.sglang)
    with pytest.raises(ConfigError, match="sglang.nonsense"):
        rlcore_config("sglang.nonsense=1")
    cases = {
        "sglang.mode=grpc": "sglang.mode.*server, engine",
        "sglang.pause_mode=sleep": "sglang.pause_mode",
        "sglang.selector=both": "sglang.selector",
        "sglang.keep_together=expert": "sglang.keep_together",
        "sglang.url=localhost:30000": "must start with http",
        "sglang.speculative_num_steps=3": "speculative_algorithm is empty",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            check_settings(rlcore_config(override).sglang)
    with pytest.raises(ConfigError, match="mode is 'engine'"):
        check_settings(rlcore_config("sglang.mode=engine", "sglang.url=http://h:1").sglang)


@pytest.mark.parametrize("sync", ["sglang-tensor", "sglang-nccl", "sglang-disk"])
def test_syncs_only_feed_the_sglang_backend(register_plugin, rlcore_plugin_manager, sync):
    register_plugin(sglang_plugin, "sglang")
    cfg = cfgmod.validate(cfgmod.read_raw(None, ["rollout.backend=local", f"sync.name={sync}"]),
                          rlcore_plugin_manager.plugin_settings())
    with pytest.raises(IncompatiblePluginsError, match="feeds only rollout backends sglang"):
        resolve(cfg, rlcore_plugin_manager)
    cfg = cfgmod.validate(cfgmod.read_raw(None, ["rollout.backend=sglang", f"sync.name={sync}",
                                                 "rollout.return_routed_experts=true"]),
                          rlcore_plugin_manager.plugin_settings())
    stack = resolve(cfg, rlcore_plugin_manager)
    assert stack.rollout_backend.name == "sglang" and stack.weight_sync.name == sync


def test_core_builtin_syncs_cannot_feed_sglang(register_plugin, rlcore_plugin_manager):
    """inproc/disk need in-process receivers; an SGLang server is not one, and resolve says so."""
    register_plugin(sglang_plugin, "sglang")
    for sync in ("inproc", "disk"):
        cfg = cfgmod.validate(cfgmod.read_raw(None, ["rollout.backend=sglang", f"sync.name={sync}"]),
                              rlcore_plugin_manager.plugin_settings())
        with pytest.raises(MissingCapabilityError, match="receive_buckets|receive_disk"):
            resolve(cfg, rlcore_plugin_manager)


def test_factories_refuse_a_run_without_the_section():
    from rlcore.types import BuildContext
    from rlcore_sglang.backend import build_backend
    from rlcore_sglang.sync import build_tensor_sync

    ctx = BuildContext(config=None, settings=None)
    with pytest.raises(ConfigError, match="plugins: \\[sglang\\]"):
        build_backend(ctx)
    with pytest.raises(ConfigError, match="plugins: \\[sglang\\]"):
        build_tensor_sync(ctx)


def test_launched_server_listens_on_loopback_by_default(tmp_path):
    from rlcore_sglang.backend import SGLangBackend
    from rlcore_sglang.settings import SGLangSettings

    args = SGLangBackend(SGLangSettings(), output_dir=str(tmp_path)).launch_args("/models/p", 0)
    assert args[args.index("--host") + 1] == "127.0.0.1" and args.count("--host") == 1
    exposed = SGLangBackend(SGLangSettings(host="0.0.0.0"), output_dir=str(tmp_path)).launch_args("/models/p", 0)
    assert exposed[exposed.index("--host") + 1] == "0.0.0.0"


def test_host_and_port_are_checked_at_config_time(register_plugin, rlcore_config):
    register_plugin(sglang_plugin, "sglang")
    assert rlcore_config("sglang.host=0.0.0.0").sglang.host == "0.0.0.0"
    for bad in ("http://0.0.0.0", "127.0.0.1:30000", "''"):
        with pytest.raises(ConfigError, match="sglang.host"):
            rlcore_config(f"sglang.host={bad}")
    with pytest.raises(ConfigError, match="sglang.port"):
        rlcore_config("sglang.port=0")
    with pytest.raises(ConfigError, match="which rlcore sets itself"):
        rlcore_config("sglang.launch_args=[--host,0.0.0.0]")


def test_routed_experts_with_speculative_decoding_are_refused_at_config_time(register_plugin, rlcore_config):
    """SGLang cannot return the routes of speculative decoding's tokens: rollout.return_routed_experts
    (what any feature needing the engine's routes sets, R3 among them) is refused with it, the reason named."""
    register_plugin(sglang_plugin, "sglang")
    base = ("rollout.backend=sglang", "sync.name=sglang-disk", "rollout.return_routed_experts=true")
    with pytest.raises(ConfigError, match="speculative_eagle_topk=4 > 1 SGLang returns the routes of the wrong KV") \
            as err:
        rlcore_config(*base, "sglang.speculative_algorithm=EAGLE", "sglang.speculative_eagle_topk=4")
    assert err.value.key == "sglang.speculative_eagle_topk" and "rollout.return_routed_experts: false" in str(err.value)
    with pytest.raises(ConfigError, match="all-zero routes"):
        rlcore_config(*base, "sglang.launch_args=[--speculative-algorithm=NGRAM]")
    # either alone is accepted
    assert rlcore_config(*base).rollout.return_routed_experts
    rlcore_config("rollout.backend=sglang", "sync.name=sglang-disk", "sglang.speculative_algorithm=EAGLE",
                  "sglang.speculative_eagle_topk=4")


@pytest.mark.parametrize(("overrides", "key"), [
    (["sync.name=sglang-nccl"], "sync.name"),
    (["sync.name=sglang-tensor", "sglang.selector=target"], "sglang.selector"),
])
def test_policy_mtp_draft_refused_where_pushes_would_not_reach_it(register_plugin, rlcore_config, overrides, key):
    """SGLang's update_weights_from_distributed loads only the target runner: with the policy's MTP
    layers as the draft (NEXTN, no separate draft model) the nccl sync would leave the draft stale."""
    register_plugin(sglang_plugin, "sglang")
    with pytest.raises(ConfigError) as err:
        rlcore_config("rollout.backend=sglang", "sglang.speculative_algorithm=NEXTN", *overrides)
    assert err.value.key == key and "draft" in str(err.value)
    if key == "sync.name":
        assert "sglang#27718" in str(err.value) and "sglang-tensor" in str(err.value)
    # the paths that reach the draft runner, and a separate draft model (not trained: nothing to sync)
    rlcore_config("rollout.backend=sglang", "sglang.speculative_algorithm=NEXTN", "sync.name=sglang-tensor")
    rlcore_config("rollout.backend=sglang", "sglang.speculative_algorithm=NEXTN", "sync.name=sglang-disk")
    rlcore_config("rollout.backend=sglang", "sglang.speculative_algorithm=EAGLE3", "sync.name=sglang-nccl",
                  "sglang.speculative_draft_model_path=/drafts/eagle3")


def test_nccl_sync_refuses_a_server_that_drafts_from_the_policy():
    """A server given by sglang.url shows its speculative algorithm only at start: the nccl sync
    refuses it then, before sending anything; the tensor sync takes it and reaches the draft."""
    from rlcore.errors import WeightSyncError
    from rlcore_sglang.backend import SGLangBackend
    from rlcore_sglang.protocol import ServerFeatures
    from rlcore_sglang.settings import SGLangSettings
    from rlcore_sglang.sync import SGLangNCCLSync, SGLangTensorSync

    settings = SGLangSettings(url="http://127.0.0.1:1")
    backend = SGLangBackend(settings)
    backend.features = ServerFeatures.from_server_info({"version": "0.5.23", "speculative_algorithm": "NEXTN"})
    backend.transport = object()  # started: the check runs before any request
    with pytest.raises(WeightSyncError, match="sglang#27718"):
        SGLangNCCLSync(settings, 1 << 20).push(iter([]), backend, 1)
    assert SGLangTensorSync(settings, 1 << 20).updates_draft
    assert not SGLangTensorSync(SGLangSettings(selector="target"), 1 << 20).updates_draft


def test_release_for_training_is_checked_at_config_time(register_plugin, rlcore_config):
    register_plugin(sglang_plugin, "sglang")
    check_settings(rlcore_config("sglang.release_for_training=[kv_cache,weights]").sglang)
    with pytest.raises(ConfigError, match="sglang.release_for_training.*'gpu'"):
        check_settings(rlcore_config("sglang.release_for_training=[gpu]").sglang)
    with pytest.raises(ConfigError, match="enable_memory_saver"):
        check_settings(rlcore_config("sglang.release_for_training=[kv_cache]", "sglang.enable_memory_saver=false").sglang)


def test_nccl_on_the_servers_own_gpu_is_refused_before_anything_is_sent():
    """On one GPU (trainer and launched server both on cuda:0) NCCL fails only at the first
    broadcast, after the self-test has reset SGLang's tensors ("Duplicate GPU detected", seen with
    SGLang 0.5.17 on an H200): the nccl sync names the problem and the way out first."""
    from rlcore_sglang.protocol import ServerFeatures
    from rlcore_sglang.sync import shared_gpu_problem

    one_gpu = ServerFeatures.from_server_info({"version": "0.5.17", "tp_size": 1, "base_gpu_id": 0})
    assert "sglang-tensor" in shared_gpu_problem(0, one_gpu, "nccl")
    assert shared_gpu_problem(0, one_gpu, "gloo") is None  # gloo takes two ranks on one device
    elsewhere = ServerFeatures.from_server_info({"version": "0.5.17", "tp_size": 2, "base_gpu_id": 1})
    assert elsewhere.gpu_indices == [1, 2] and shared_gpu_problem(0, elsewhere, "nccl") is None
    assert "cuda:2" in shared_gpu_problem(2, elsewhere, "nccl")
