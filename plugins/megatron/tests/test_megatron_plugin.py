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
    assert spec.capabilities == {"moe", "mtp", "router_hook", "record_routes", "data_parallel", "tensor_parallel",
                                 "expert_parallel", "pipeline_parallel", "value_model", "engine_model", "moe_mtp"}


def test_settings_section_validates(register_plugin, rlcore_config):
    register_plugin(plugin, "megatron")
    cfg = rlcore_config("engine.name=megatron", "megatron.tensor_parallel_size=2", "engine.model.tiny.num_kv_heads=2")
    assert cfg.megatron.tensor_parallel_size == 2 and cfg.megatron.token_dispatcher == "allgather"
    with pytest.raises(ConfigError, match="megatron.tensor_paralel_size"):
        rlcore_config("megatron.tensor_paralel_size=2")


def test_rlcore_check_resolves_the_example_stack(capsys):
    """`rlcore check` on the example config: the engine comes from this distribution and the
    ``megatron:`` section is validated (no megatron-core needed: check builds no engine)."""
    from rlcore.testing.runs import main

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
    tp2 = ("megatron.tensor_parallel_size=2", "engine.model.tiny.num_kv_heads=2")
    resolve(rlcore_config("engine.name=megatron", *tp2), pm)  # reference head: fine
    resolve(rlcore_config("forward.name=plainhead", *tp2), pm)  # hf engine: the section is unused
    with pytest.raises(MissingCapabilityError) as e:
        resolve(rlcore_config("engine.name=megatron", "forward.name=plainhead", *tp2), pm)
    msg = str(e.value)
    assert "plugin 'megatron'" in msg and "forward_fn 'plainhead'" in msg
    assert "'vocab_parallel'" in msg and "megatron.tensor_parallel_size=2" in msg


# ---------------------------------------------------- what megatron-core cannot express ------


@pytest.mark.parametrize("arch,overrides,match", [
    # megatron-core: "Please use --moe-router-pre-softmax when topk is 1" (a bare ValueError)
    ("qwen3_moe", {"num_experts_per_tok": 1, "norm_topk_prob": True}, "num_experts_per_tok=1 with norm_topk_prob=true"),
    ("qwen3_moe", {"num_experts_per_tok": 9}, r"num_experts_per_tok=9 must be in \[1, num_experts=8\]"),
    ("qwen2", {"num_attention_heads": 3, "num_key_value_heads": 2}, "not a multiple of num_key_value_heads=2"),
])
def test_hf_configs_megatron_cannot_express_are_errors_naming_the_field(arch, overrides, match):
    with pytest.raises(ConfigError, match=match) as e:
        model_spec_from_hf(_hf_config(arch, **overrides))
    assert e.value.key == "engine.model"
    # top-1 without renormalisation is megatron's pre-softmax router: the same model, accepted
    spec = model_spec_from_hf(_hf_config("qwen3_moe", num_experts_per_tok=1, norm_topk_prob=False))
    assert spec.topk == 1 and spec.router_pre_softmax


# ------------------------------------------------------- megatron: section at config time ------


@pytest.mark.parametrize("overrides,key,match", [
    (["megatron.tensor_parallel_size=0"], "megatron.tensor_parallel_size", ">= 1"),  # was ZeroDivisionError
    # pipeline stages: what they do not run is refused naming the key
    (["engine.name=megatron", "megatron.pipeline_parallel_size=2", "megatron.virtual_pipeline_stages=2"],
     "megatron.pipeline_parallel_size", r"4 chunks need at least as many decoder layers; the model has 2"),
    (["engine.name=megatron", "megatron.virtual_pipeline_stages=2"], "megatron.virtual_pipeline_stages",
     "needs megatron.pipeline_parallel_size"),
    (["engine.name=megatron", "engine.model.tiny.arch=qwen3_moe", "megatron.pipeline_parallel_size=2"],
     "megatron.pipeline_parallel_size", "not supported with an MoE model"),
    (["engine.name=megatron", "engine.model.tiny.tie_word_embeddings=true", "megatron.pipeline_parallel_size=2"],
     "megatron.pipeline_parallel_size", "not supported with tied embeddings"),
    (["megatron.attention=flash"], "megatron.attention", "auto, te or local"),
    (["megatron.token_dispatcher=flex"], "megatron.token_dispatcher", "allgather or alltoall"),
    (["megatron.sequence_parallel=true"], "megatron.sequence_parallel", "tensor_parallel_size > 1"),
    (["megatron.vocab_size_divisible_by=0"], "megatron.vocab_size_divisible_by", ">= 1"),
    (["megatron.moe_aux_loss_coeff=-0.1"], "megatron.moe_aux_loss_coeff", ">= 0"),
    # need the engine: device and model
    (["engine.name=megatron", "megatron.token_dispatcher=alltoall"], "megatron.token_dispatcher", "needs CUDA"),
    (["engine.name=megatron", "megatron.attention=te"], "megatron.attention", "CUDA"),
    (["engine.name=megatron", "megatron.tensor_parallel_size=2"], "megatron.tensor_parallel_size",
     r"must divide the number of attention heads \(2\) and of key/value heads \(1\)"),
    (["engine.name=megatron", "megatron.expert_parallel_size=2"], "megatron.expert_parallel_size",
     "needs an MoE model; 'qwen2' has no experts"),
    (["engine.name=megatron", "engine.model.tiny.arch=qwen3_moe", "engine.model.tiny.num_experts=6",
      "megatron.expert_parallel_size=4"], "megatron.expert_parallel_size", r"divide the number of experts \(6\)"),
    # under Ray, cluster.trainer.tp/ep decide the sizes: a conflict names both keys, a bad size the cluster key
    (["engine.name=megatron", "engine.model.tiny.num_kv_heads=2", "cluster.backend=ray",
      "megatron.tensor_parallel_size=2"], "cluster.trainer.tp",
     "megatron.tensor_parallel_size=2 conflicts with cluster.trainer.tp=1"),
    (["engine.name=megatron", "engine.model.tiny.arch=qwen3_moe", "cluster.backend=ray", "cluster.trainer.ep=2",
      "megatron.expert_parallel_size=4"], "cluster.trainer.ep",
     "megatron.expert_parallel_size=4 conflicts with cluster.trainer.ep=2"),
    (["engine.name=megatron", "cluster.backend=ray", "cluster.trainer.tp=2"], "megatron.tensor_parallel_size",
     r"key/value heads \(1\).*cluster.trainer.tp"),
    (["engine.name=megatron", "engine.model.tiny.arch=qwen3_moe", "engine.model.tiny.topk=1"], "engine.model",
     "norm_topk_prob=true cannot be built in megatron-core.*engine.model.tiny: arch=qwen3_moe, topk=1"),
])
def test_rlcore_check_refuses_what_the_megatron_engine_would(register_plugin, rlcore_config, overrides, key, match):
    """Before: each passed `rlcore check` and failed when the engine was built (several with
    megatron-core's own bare ValueError or a ZeroDivisionError)."""
    from rlcore_ray import plugin as ray_plugin

    register_plugin(plugin, "megatron")
    register_plugin(ray_plugin, "ray")  # cluster.backend=ray: the launcher that places the ranks
    with pytest.raises(ConfigError, match=match) as e:
        rlcore_config(*overrides)
    assert e.value.key == key


def test_mtp_layers_in_a_layout_the_rollout_cannot_load_are_refused_by_its_capability(register_plugin, rlcore_config):
    """Was: the local rollout refused the exported directory at the first weight push. Now the
    rollout backend must declare ``any_mtp_layout`` (vLLM, SGLang); core's local one builds MTP
    layers only in MiMo's layout over Qwen2."""
    from rlcore.errors import MissingCapabilityError
    from rlcore.stack import resolve

    pm = register_plugin(plugin, "megatron").pm
    moe_mtp = ["engine.name=megatron", "engine.model.tiny.arch=qwen3_moe", "engine.model.tiny.mtp_layers=1"]
    with pytest.raises(MissingCapabilityError, match="any_mtp_layout.*only in MiMo|layout other than MiMo's over "
                       "Qwen2; set megatron.export_mtp: false") as e:
        resolve(rlcore_config(*moe_mtp), pm)
    assert "'local'" in str(e.value)
    assert resolve(rlcore_config(*moe_mtp, "megatron.export_mtp=false"), pm).engine.name == "megatron"
    qwen2_mtp = ["engine.name=megatron", "engine.model.tiny.mtp_layers=1"]  # MiMo's layout: local builds it
    assert resolve(rlcore_config(*qwen2_mtp), pm).rollout_backend.name == "local"


def test_the_ray_launcher_runs_megatron_data_parallel_beside_tensor_parallel(register_plugin, rlcore_config):
    """rlcore-ray decides by the engine's capabilities: megatron declares data and pipeline
    parallelism (before: refused naming cluster.trainer.dp / pp), data parallelism alone or beside
    tensor or pipeline parallelism; beside expert
    parallelism it is refused naming cluster.trainer.dp (every EP rank of a model runs every sample)."""
    from rlcore.stack import resolve
    from rlcore_ray import plugin as ray_plugin

    register_plugin(plugin, "megatron")
    pm = register_plugin(ray_plugin, "ray").pm
    ray = ["plugins=[megatron,ray]", "engine.name=megatron", "cluster.backend=ray"]
    assert resolve(rlcore_config(*ray, "cluster.trainer.dp=2"), pm).launcher.name == "ray"
    assert resolve(rlcore_config(*ray, "cluster.trainer.dp=2", "cluster.trainer.tp=2",
                                 "engine.model.tiny.num_kv_heads=2"), pm).launcher.name == "ray"
    # pipeline stages too (before: refused naming cluster.trainer.pp), beside data parallelism
    assert resolve(rlcore_config(*ray, "cluster.trainer.pp=2", "cluster.trainer.dp=2"), pm).launcher.name == "ray"
    with pytest.raises(ConfigError, match="cluster.trainer.dp=2 beside expert parallelism") as e:
        rlcore_config(*ray, "engine.model.tiny.arch=qwen3_moe", "cluster.trainer.dp=2", "cluster.trainer.ep=2")
    assert e.value.key == "cluster.trainer.dp"


def test_megatron_model_checks_read_the_model_directory(register_plugin, rlcore_config, tmp_path):
    register_plugin(plugin, "megatron")
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_moe", "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
         "num_hidden_layers": 2, "intermediate_size": 64, "vocab_size": 32, "num_experts": 4,
         "num_experts_per_tok": 1, "norm_topk_prob": True, "moe_intermediate_size": 32, "rope_theta": 1e6}))
    with pytest.raises(ConfigError, match="norm_topk_prob=true"):
        rlcore_config("engine.name=megatron", f"engine.model.path={tmp_path}")
    with pytest.raises(ConfigError, match="has no config.json") as e:
        rlcore_config("engine.name=megatron", f"engine.model.path={tmp_path / 'missing'}")
    assert e.value.key == "engine.model.path"
    rlcore_config("engine.name=hf", f"engine.model.path={tmp_path / 'missing'}")  # another engine: not ours
    for i, bad in enumerate(["[1, 2]", '{"model_type": "qwen2"}', "{"]):
        (tmp_path / f"bad{i}").mkdir()
        (tmp_path / f"bad{i}" / "config.json").write_text(bad)
        with pytest.raises(ConfigError, match=f"bad{i}/config.json") as e:
            rlcore_config("engine.name=megatron", f"engine.model.path={tmp_path / f'bad{i}'}")
        assert e.value.key == "engine.model.path"


def test_cluster_trainer_sizes_decide_megatrons_under_ray(register_plugin, rlcore_config):
    """By the launcher's declared capability (``places_ranks``), not its name."""
    from rlcore_megatron.settings import launcher_places_ranks, resolve_parallel, section_settings
    from rlcore_ray import plugin as ray_plugin

    register_plugin(plugin, "megatron")
    register_plugin(ray_plugin, "ray")
    for extra in ([], ["megatron.tensor_parallel_size=2"]):  # left at 1, or the same value
        cfg = rlcore_config("engine.name=megatron", "engine.model.tiny.num_kv_heads=2", "cluster.backend=ray",
                            "cluster.trainer.tp=2", *extra)
        s = resolve_parallel(section_settings(cfg.megatron), cfg)
        assert (s.tensor_parallel_size, s.expert_parallel_size) == (2, 1)
        assert plugin._tp(cfg) == 2  # the vocab-parallel head requirement sees it
    cfg = rlcore_config("engine.name=megatron", "engine.model.tiny.arch=qwen3_moe", "cluster.backend=ray",
                        "cluster.trainer.ep=2")
    assert resolve_parallel(section_settings(cfg.megatron), cfg).expert_parallel_size == 2
    # one process: the megatron keys as they are (a bare engine under torchrun reads them)
    cfg = rlcore_config("engine.name=megatron", "engine.model.tiny.num_kv_heads=2", "megatron.tensor_parallel_size=2")
    assert resolve_parallel(section_settings(cfg.megatron), cfg).tensor_parallel_size == 2
    assert not launcher_places_ranks(cfg) and list(cfg.cluster.launcher_capabilities) == []
    ray = rlcore_config("engine.name=megatron", "cluster.backend=ray")
    assert launcher_places_ranks(ray) and "places_ranks" in ray.cluster.launcher_capabilities
    # derived on every load: a value written in the file (a saved run's config.yaml) is replaced
    assert list(rlcore_config("cluster.launcher_capabilities=[places_ranks]").cluster.launcher_capabilities) == []


def test_megatron_section_passes_when_the_engine_can_build_it(register_plugin, rlcore_config):
    register_plugin(plugin, "megatron")
    rlcore_config("engine.name=megatron")
    rlcore_config("engine.name=megatron", "megatron.pipeline_parallel_size=2")  # before: refused
    rlcore_config("engine.name=megatron", "engine.model.tiny.num_layers=4", "megatron.pipeline_parallel_size=2",
                  "megatron.virtual_pipeline_stages=2")
    rlcore_config("engine.name=megatron", "algorithm.name=ppo", "megatron.pipeline_parallel_size=2")  # before: refused
    rlcore_config("engine.name=megatron", "engine.model.tiny.arch=qwen3_moe", "megatron.expert_parallel_size=2")
    rlcore_config("engine.name=megatron", "engine.device=auto", "megatron.token_dispatcher=alltoall")
    rlcore_config("engine.name=megatron", "engine.model.tiny.mtp_layers=1")  # Qwen2: MiMo's layout
    rlcore_config("engine.name=megatron", "engine.model.tiny.arch=qwen3_moe", "engine.model.tiny.mtp_layers=1",
                  "megatron.export_mtp=false")


# ------------------------------------------------------------ compat: no silent drops ------


def test_compat_drops_only_arguments_that_cannot_change_the_model():
    from rlcore_megatron import compat

    def old_builder(config, vocab_size, rotary_percent=1.0):  # a version without rotary_base
        return dict(config=config, vocab_size=vocab_size, rotary_percent=rotary_percent)

    # pg_collection: the same groups come from parallel_state on versions without it
    assert compat.call_with_supported(old_builder, "cfg", vocab_size=8, pg_collection=object()) == \
        dict(config="cfg", vocab_size=8, rotary_percent=1.0)
    assert compat.call_with_supported(old_builder, "cfg", vocab_size=8, rotary_pos_cos=None)["vocab_size"] == 8
    with pytest.raises(ConfigError, match=r"old_builder does not accept rotary_base.*another model") as e:
        compat.call_with_supported(old_builder, "cfg", vocab_size=8, rotary_base=1e6, pg_collection=None)
    assert e.value.key == "engine.model"
    with pytest.raises(ConfigError, match="does not accept rotary_pos_cos"):
        compat.call_with_supported(old_builder, "cfg", vocab_size=8, rotary_pos_cos=1.0)

    def new_builder(config, **kwargs):  # **kwargs: everything is passed through
        return kwargs

    assert compat.call_with_supported(new_builder, "cfg", rotary_base=1e6) == {"rotary_base": 1e6}
