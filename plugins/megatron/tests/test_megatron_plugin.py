"""The ``megatron`` built-in plugin and the HF-config translation: no megatron-core needed (these
run in the main venv too)."""

from __future__ import annotations

import sys

import pytest
from rlcore.engines.megatron.hf_config import ModelSpec, model_spec_from_hf
from rlcore.errors import ConfigError, PluginError
from rlcore.testing.imports import modules_loaded_by


def _hf_config(arch: str, **overrides):
    from rlcore.engines.tiny import tiny_config as hf_tiny_config
    from rlcore.testing.models import tiny_config

    cfg = hf_tiny_config(tiny_config(arch), vocab_size=18, eos_id=1, pad_id=0)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def test_importing_the_plugin_imports_no_engine():
    # a megatron submodule would put "megatron" itself in sys.modules too
    watched = ["megatron", "rlcore.engines.megatron.engine"]
    assert modules_loaded_by("import rlcore.builtin.megatron", watched) == []


def test_engine_is_registered_with_settings(rlcore_plugin_manager, rlcore_config):
    spec = rlcore_plugin_manager.engines()["megatron"]
    assert {"moe", "mtp", "router_hook", "record_routes", "tensor_parallel", "expert_parallel"} <= spec.capabilities
    cfg = rlcore_config("engine.name=megatron", "megatron.tensor_parallel_size=2")
    assert cfg.megatron.tensor_parallel_size == 2 and cfg.megatron.token_dispatcher == "allgather"
    with pytest.raises(ConfigError, match="megatron.tensor_paralel_size"):
        rlcore_config("megatron.tensor_paralel_size=2")


def test_missing_megatron_core_names_the_install_command(rlcore_plugin_manager, monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron", None)  # as if megatron-core were not installed
    spec = rlcore_plugin_manager.engines()["megatron"]
    with pytest.raises(PluginError, match=r"pip install 'rlcore\[megatron\]'"):
        spec.factory(None)


def test_dense_and_moe_configs_translate():
    dense = model_spec_from_hf(_hf_config("qwen2"))
    assert isinstance(dense, ModelSpec) and not dense.is_moe
    assert (dense.num_heads, dense.num_kv_heads, dense.head_dim, dense.qkv_bias, dense.qk_norm) == (2, 1, 64, True, False)
    moe = model_spec_from_hf(_hf_config("qwen3_moe", mlp_only_layers=[0], num_nextn_predict_layers=1))
    assert moe.is_moe and moe.moe_layers == (False, True) and moe.moe_layer_indices == (1,)
    assert moe.qk_norm and not moe.qkv_bias and not moe.router_pre_softmax and moe.mtp_layers == 1 and moe.mtp_is_moe
    q2 = model_spec_from_hf(_hf_config("qwen2_moe", norm_topk_prob=False))
    assert q2.router_pre_softmax and q2.shared_expert_size == 256 and q2.shared_expert_gate


@pytest.mark.parametrize("field,value,match", [
    ("model_type", "gpt2", "model_type 'gpt2'"),
    ("hidden_act", "gelu", "hidden_act"),
    ("use_sliding_window", True, "use_sliding_window"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}, "rope_type='yarn'"),
])
def test_unsupported_hf_fields_are_errors_naming_them(field, value, match):
    with pytest.raises(ConfigError, match=match):
        model_spec_from_hf(_hf_config("qwen2", **{field: value}))
