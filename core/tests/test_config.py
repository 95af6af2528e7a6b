"""Config: structured schema, plugin sections, overrides; errors name the key."""

import pytest

from rlcore import config as cfgmod
from rlcore.errors import ConfigError
from rlcore.stack import load_config


def _yaml(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults_and_dotlist_overrides(tmp_path):
    cfg, pm = load_config(_yaml(tmp_path, "rollout: {n: 4}\n"), ["rollout.n=8", "training.lr=0.5"])
    assert cfg.rollout.n == 8 and cfg.training.lr == 0.5 and cfg.engine.name == "hf"
    assert "reference" in pm.active


def test_unknown_nested_key_names_key_and_siblings(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(_yaml(tmp_path, "rollout: {nn: 4}\n"))
    assert "unknown config key 'rollout.nn'" in str(e.value) and "rollout has: backend, n," in str(e.value)
    assert e.value.key == "rollout.nn"


def test_unknown_top_level_key(tmp_path):
    with pytest.raises(ConfigError, match="unknown config key 'rolout'. Top-level keys: plugins, engine"):
        load_config(_yaml(tmp_path, "rolout: {n: 4}\n"))


def test_wrong_type_names_key(tmp_path):
    with pytest.raises(ConfigError, match="bad value for config key 'rollout.n'"):
        load_config(None, ["rollout.n=lots"])
    with pytest.raises(ConfigError, match="bad value for config key 'training.steps': 0; must be >= 1"):
        load_config(None, ["training.steps=0"])


def test_choice_fields_list_choices():
    with pytest.raises(ConfigError, match="'algorithm.loss_agg': 'mean'; choose one of: token-mean, seq-mean-token-mean"):
        load_config(None, ["algorithm.loss_agg=mean"])


def test_plugin_section_validated_by_plugin_schema(tmp_path):
    cfg, _ = load_config(_yaml(tmp_path, "plugins: [example]\nexample: {length_penalty: 0.5}\n"))
    assert cfg.example.length_penalty == 0.5
    with pytest.raises(ConfigError, match="unknown config key 'example.penalty'"):
        load_config(_yaml(tmp_path, "plugins: [example]\nexample: {penalty: 0.5}\n"))


def test_section_of_inactive_plugin_says_to_activate_it(tmp_path):
    with pytest.raises(ConfigError, match="config section 'example' belongs to plugin 'example', which is not active: add 'example' to plugins:"):
        load_config(_yaml(tmp_path, "plugins: []\nexample: {length_penalty: 0.5}\n"))


def test_plugins_must_be_a_list(tmp_path):
    with pytest.raises(ConfigError, match="plugins: must be a list"):
        load_config(_yaml(tmp_path, "plugins: example\n"))


def test_missing_file_and_bad_reward_path(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="'data.reward': 'noreward' must be 'module:function'"):
        load_config(None, ["data.reward=noreward"])


def test_env_plugins_override_config(tmp_path, monkeypatch):
    monkeypatch.setenv("RLCORE_PLUGINS", "example")
    cfg, pm = load_config(_yaml(tmp_path, "plugins: []\n"))
    assert list(cfg.plugins) == ["example"] and "example" in pm.active


def test_yaml_round_trip_of_resolved_config():
    cfg, _ = load_config(None)
    text = cfgmod.to_yaml(cfg)
    assert "rollout:" in text and "backend: local" in text


def test_engine_model_given_as_a_string_is_its_path(tmp_path):
    """``engine.model=/dir`` (or ``engine: {model: /dir}``) is shorthand for engine.model.path; it
    was "Merge error: str is not a subclass of ModelConfig"."""
    cfg, _ = load_config(None, ["engine.model=/models/qwen"])
    assert cfg.engine.model.path == "/models/qwen" and cfg.engine.model.dtype == "float32"
    cfg, _ = load_config(_yaml(tmp_path, "engine: {model: /models/qwen}\n"))
    assert cfg.engine.model.path == "/models/qwen"


@pytest.mark.parametrize("overrides,key", [
    (["engine.model.tiny.num_kv_heads=3"], "engine.model.tiny.num_kv_heads"),
    (["engine.model.tiny.head_dim=63"], "engine.model.tiny.head_dim"),
    (["engine.model.tiny.arch=gpt9"], "engine.model.tiny.arch"),
    (["engine.model.tiny.arch=qwen3_moe", "engine.model.tiny.topk=9"], "engine.model.tiny.topk"),
    (["engine.model.dtype=float8"], "engine.model.dtype"),
])
def test_a_tiny_model_no_engine_can_build_is_refused_by_the_config(overrides, key):
    """Shapes checked from the document alone (rlcore.model_settings), so every load_config refuses
    them, not only rlcore check: before, the engine raised when it built the model (RuntimeError at
    the first forward for the heads, transformers' validation error for head_dim, AttributeError
    for the dtype)."""
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert e.value.key == key and key in str(e.value)
    if key != "engine.model.dtype":  # a model directory is built from its own config.json: tiny is unused
        load_config(None, ["engine.model.path=/any/dir", *overrides])


def test_every_problem_of_a_config_is_named_at_once_with_the_closest_key(tmp_path):
    """Issue 38: one run of ``rlcore check`` names every problem of the file, not the first only;
    an unknown key gets the known key it most likely meant."""
    from rlcore import errors

    text = ("trainig: {steps: 3}\n"              # unknown section
            "training: {lrr: 0.1, steps: 0}\n"   # unknown key, out of range
            "rollout: {n: lots, top_p: 2.0}\n"    # wrong type, out of range
            "data: {taskk: x}\n")                 # unknown key
    with pytest.raises(getattr(errors, "ConfigErrors", ConfigError)) as e:
        load_config(_yaml(tmp_path, text))
    msg = str(e.value)
    keys = [p.key for p in e.value.problems]
    assert keys == ["trainig", "training.lrr", "rollout.n", "data.taskk", "training.steps", "rollout.top_p"], msg
    assert "did you mean 'training'?" in msg and "did you mean 'lr'?" in msg and "did you mean 'task'?" in msg
    assert msg.splitlines()[0] == "6 problems in the config:" and len(msg.splitlines()) == 7


def test_a_single_problem_is_still_one_line_naming_its_key(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(_yaml(tmp_path, "training: {lrr: 0.1}\n"))
    assert type(e.value) is ConfigError and e.value.key == "training.lrr"
    assert "\n" not in str(e.value) and "did you mean 'lr'?" in str(e.value)
