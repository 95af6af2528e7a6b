"""The ``megatron`` plugin (registration, ``megatron:`` section, install hint) and the HF-config
translation: no megatron-core needed (these run in the main venv too, where it is absent)."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import shlex
import sys
from pathlib import Path

import pytest
from rlcore.errors import ConfigError, PluginError
from rlcore.testing.imports import modules_loaded_by
from rlcore_megatron import plugin
from rlcore_megatron.hf_config import ModelSpec, model_spec_from_hf

ROOT = Path(__file__).resolve().parents[3]


def _hf_config(arch: str, **overrides):
    from rlcore.engines.tiny import tiny_config as hf_tiny_config
    from rlcore.testing.models import tiny_config

    cfg = hf_tiny_config(tiny_config(arch), vocab_size=18, eos_id=1, pad_id=0)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def test_importing_the_plugin_imports_no_engine():
    # a megatron submodule would put "megatron" itself in sys.modules too
    watched = ["megatron", "rlcore_megatron.engine"]
    assert modules_loaded_by("import rlcore_megatron.plugin", watched) == []


def test_core_has_no_megatron_engine():
    assert importlib.util.find_spec("rlcore.engines.megatron") is None
    assert importlib.util.find_spec("rlcore.builtin.megatron") is None
    core_eps = [ep.name for ep in md.distribution("rlcore").entry_points if ep.group == "rlcore"]
    assert "megatron" not in core_eps and "hf" in core_eps


def test_plugin_is_found_through_its_entry_point():
    from rlcore.manager import PluginManager

    pm = PluginManager()
    pm.activate(["megatron"])
    spec = pm.select("engine", "megatron", key="engine.name")
    assert spec.distribution.startswith("rlcore-megatron ")
    assert spec.capabilities == {"moe", "mtp", "router_hook", "record_routes", "tensor_parallel", "expert_parallel"}


def test_settings_section_validates(register_plugin, rlcore_config):
    register_plugin(plugin, "megatron")
    cfg = rlcore_config("engine.name=megatron", "megatron.tensor_parallel_size=2")
    assert cfg.megatron.tensor_parallel_size == 2 and cfg.megatron.token_dispatcher == "allgather"
    with pytest.raises(ConfigError, match="megatron.tensor_paralel_size"):
        rlcore_config("megatron.tensor_paralel_size=2")


def test_rlcore_check_resolves_the_example_stack(capsys):
    """`rlcore check` on the example config: the engine comes from this distribution and the
    ``megatron:`` section is validated (no megatron-core needed: check builds no engine)."""
    from rlcore.cli import main

    example = str(ROOT / "examples" / "megatron_tiny.yaml")
    assert main(["check", example, "--json"]) == 0
    desc = json.loads(capsys.readouterr().out)
    assert desc["engine"]["name"] == "megatron" and desc["engine"]["distribution"].startswith("rlcore-megatron ")
    assert main(["check", example, "megatron.tensor_parallel_size=two"]) == 2
    assert "megatron.tensor_parallel_size" in capsys.readouterr().err
    assert main(["check", example, "megatron.tensor_paralel_size=2"]) == 2
    assert "megatron.tensor_paralel_size" in capsys.readouterr().err


def test_missing_megatron_core_names_an_install_line_that_exists(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron", None)  # as if megatron-core were not installed
    spec = next(iter(plugin.engine()))
    with pytest.raises(PluginError, match=r"Install it with: pip install 'rlcore-megatron\[megatron-core\]'"):
        spec.factory(None)
    # the line names this distribution and one of its declared extras, which pulls megatron-core
    requirement = shlex.split(plugin.INSTALL_HINT)[-1]
    dist_name, extra = requirement.rstrip("]").split("[")
    meta = md.metadata(dist_name)
    assert extra in meta.get_all("Provides-Extra")
    assert any(r.startswith("megatron-core") and f'extra == "{extra}"' in r for r in meta.get_all("Requires-Dist"))


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


def _plain_head_plugin():
    """forward_fn ``plainhead``: declares entropy and per-token temperature, not vocab_parallel."""
    import types

    from rlcore import hookimpl
    from rlcore.types import Cap, ForwardFnSpec

    mod = types.ModuleType("plainhead")
    mod.PLUGIN_API = 1

    def forward_fn():
        yield ForwardFnSpec(name="plainhead", factory=lambda ctx: None,
                            capabilities={Cap.ENTROPY, Cap.PER_TOKEN_TEMPERATURE})

    mod.forward_fn = hookimpl(forward_fn)
    return mod


def test_head_without_vocab_parallel_is_refused_under_tensor_parallelism(rlcore_plugin_manager, register_plugin,
                                                                         rlcore_config):
    """Before: the stack resolved and each rank's head computed a softmax over its own shard."""
    from rlcore.errors import MissingCapabilityError
    from rlcore.stack import resolve

    register_plugin(plugin, "megatron")
    register_plugin(_plain_head_plugin(), "plainhead")
    pm = rlcore_plugin_manager
    resolve(rlcore_config("engine.name=megatron", "forward.name=plainhead"), pm)  # TP=1: fine
    resolve(rlcore_config("engine.name=megatron", "megatron.tensor_parallel_size=2"), pm)  # reference head: fine
    resolve(rlcore_config("forward.name=plainhead", "megatron.tensor_parallel_size=2"), pm)  # hf engine: unused
    with pytest.raises(MissingCapabilityError) as e:
        resolve(rlcore_config("engine.name=megatron", "forward.name=plainhead", "megatron.tensor_parallel_size=2"), pm)
    msg = str(e.value)
    assert "plugin 'megatron'" in msg and "forward_fn 'plainhead'" in msg
    assert "'vocab_parallel'" in msg and "megatron.tensor_parallel_size=2" in msg
