"""``rlcore check`` catches what ``rlcore train`` would hit (rlcore.preflight), in one line naming
the key, exit code 2; ``rlcore train`` refuses the same before it creates the output directory."""

from __future__ import annotations

import pytest
import torch
from rlcore.cli import main

TINY = "examples/tiny.yaml"
SMALL = ["rollout.n=2", "data.prompts_per_step=2", "output.plot=false", "output.tensorboard=false",
         "output.progress=false", "training.steps=1"]


def _check_error(capsys, *overrides: str) -> str:
    """``rlcore check`` refuses: exit code 2 and one line on stderr, no traceback."""
    rc = main(["check", TINY, *overrides])
    out, err = capsys.readouterr()
    assert rc == 2, f"check accepted {overrides}: {out[-400:]}"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlcore: error: "), err
    assert "config OK" not in out
    return lines[0]


CASES = [
    # (overrides, the key the one line must name, more it must say)
    (["engine.model.path=/no/such/model"], "engine.model.path", "no such directory"),
    (["engine.model=/no/such/model"], "engine.model.path", "/no/such/model: no such directory"),
    (["data.task=no_such_module:task"], "data.task", "cannot import module 'no_such_module'"),
    (["data.reward=rlcore.tasks:no_such_reward"], "data.reward", "no function 'no_such_reward'"),
    (["engine.model.tiny.num_kv_heads=3"], "engine.model.tiny.num_kv_heads", "num_heads=2 must be a multiple"),
    (["engine.model.tiny.head_dim=63"], "engine.model.tiny.head_dim", "even"),
    (["engine.model.tiny.arch=gpt9"], "engine.model.tiny.arch", "qwen2, qwen2_moe, qwen3_moe"),
    (["engine.model.tiny.arch=qwen3_moe", "engine.model.tiny.topk=9"], "engine.model.tiny.topk", "num_experts=8"),
    (["engine.model.tiny.vocab_size=5"], "engine.model.tiny.vocab_size", "tokenizer has 14 tokens"),
    (["engine.model.dtype=float8"], "engine.model.dtype", "bfloat16"),
    (["rollout.n=1000000000000"], "rollout.n", "more than this machine's"),
    (["data.prompts_per_step=1000000000000"], "data.prompts_per_step", "more than this machine's"),
    (["engine.model.tiny.hidden_size=1000000000"], "engine.model.tiny.hidden_size", "weights alone"),
    (["engine.model.tiny.num_layers=1000000000"], "engine.model.tiny.num_layers", "weights alone"),
    (["rollout.temperature=1e-30"], "rollout.temperature", "below 1e-06"),
    (["rollout.temperature=0"], "rollout.temperature", "must be > 0"),
    (["data.prompt_len=600"], "data.task", "more than the model's 512 positions"),
    (["rollout.max_new_tokens=600"], "rollout.max_new_tokens", "more than the model's 512 positions"),
    (["engine.device=cpu:x"], "engine.device", "must be a number"),
]


@pytest.mark.parametrize("overrides,key,says", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_check_refuses_in_one_line_naming_the_key(capsys, overrides, key, says):
    line = _check_error(capsys, *overrides)
    assert key in line and says in line, line


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has CUDA and a GPU")
def test_check_refuses_cuda_on_a_torch_without_it(capsys):
    line = _check_error(capsys, "engine.device=cuda")
    if torch.version.cuda is None:
        assert line == (f"rlcore: error: engine.device=cuda but this torch ({torch.__version__}) has no CUDA; use "
                        f"engine.device=cpu")
    else:
        assert "engine.device=cuda" in line and "sees no GPU" in line


def test_a_task_module_that_raises_on_import_is_named(capsys, tmp_path, monkeypatch):
    (tmp_path / "brokentask.py").write_text("raise RuntimeError('half-written module')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    line = _check_error(capsys, "data.task=brokentask:task")
    assert "data.task" in line and "RuntimeError: half-written module" in line


def test_a_reward_that_cannot_take_a_sample_is_named(capsys, tmp_path, monkeypatch):
    (tmp_path / "twoargs.py").write_text("def reward(sample, other):\n    return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    line = _check_error(capsys, "data.reward=twoargs:reward")
    assert "data.reward" in line and "one RewardInput" in line


def test_a_directory_without_config_json_is_named(capsys, tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    line = _check_error(capsys, f"engine.model.path={tmp_path}")
    assert "engine.model.path" in line and "no config.json" in line


def test_check_passes_the_tiny_example_and_says_what_it_measured(capsys):
    assert main(["check", TINY]) == 0
    out = capsys.readouterr().out
    assert "config OK" in out
    assert "model tiny qwen2" in out and "longest prompt 4 tokens + rollout.max_new_tokens 4 <= 512 positions" in out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A Hugging Face directory of a tiny model for the successor task (512 positions)."""
    from rlcore.config import TinyModelConfig
    from rlcore.engines.tiny import save_tiny
    from rlcore.tasks import successor

    return save_tiny(tmp_path_factory.mktemp("model") / "m",
                     TinyModelConfig(hidden_size=32, head_dim=16, intermediate_size=32), successor().vocab)


def test_engine_model_as_a_string_is_the_model_directory(capsys, model_dir):
    model = model_dir
    assert main(["check", TINY, f"engine.model={model}", "--json"]) == 0
    assert main(["check", TINY, f"engine.model={model}"]) == 0
    out = capsys.readouterr().out
    assert f"model {model} (qwen2)" in out and "config OK" in out


def test_train_refuses_before_it_creates_the_output_directory(capsys, tmp_path):
    out = tmp_path / "run"
    for bad in (["data.prompt_len=600"], ["rollout.temperature=1e-30"], ["engine.model.tiny.num_kv_heads=3"]):
        assert main(["train", TINY, "--output", str(out), *SMALL, *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("rlcore: error: "), err
        assert not out.exists(), f"{bad}: the refused start created {out}"


def test_the_trainer_runs_preflight_first(tmp_path):
    from rlcore.errors import ConfigError
    from rlcore.stack import load_stack
    from rlcore.trainer import Trainer

    with pytest.raises(ConfigError) as e:
        Trainer(load_stack(TINY, [f"output.dir={tmp_path / 'run'}", *SMALL, "data.prompt_len=600"]))
    assert e.value.key == "data.task" and "512 positions" in str(e.value)
    assert not (tmp_path / "run").exists()


def test_sizes_a_real_machine_runs_pass(capsys):
    """Absurd-only bounds: a large step and a larger model than the tiny one are not refused (a
    0.7B model in bfloat16: 8.7 GB to train, weights, gradients, AdamW's moments and the local
    rollout's two copies counted)."""
    assert main(["check", TINY, "rollout.n=64", "data.prompts_per_step=512", "rollout.max_new_tokens=256",
                 "engine.model.dtype=bfloat16",
                 "engine.model.tiny.hidden_size=2048", "engine.model.tiny.num_layers=12",
                 "engine.model.tiny.intermediate_size=8192", "engine.model.tiny.num_heads=16",
                 "engine.model.tiny.num_kv_heads=4", "engine.model.tiny.head_dim=128", "rollout.temperature=0.6"]) == 0
    assert "config OK" in capsys.readouterr().out


def test_a_70b_shape_is_estimated_not_capped():
    """The estimate behind the memory check, for Llama-2-70B's shapes, is its real size (69B of
    the published 69.0B counted: norms left out), so only memory decides, not a cap on a field."""
    from omegaconf import OmegaConf
    from rlcore.preflight import tiny_parameters

    llama70b = OmegaConf.create(dict(arch="qwen2", hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                                     head_dim=128, intermediate_size=28672, mtp_layers=0, tie_word_embeddings=False))
    assert 68.9e9 < tiny_parameters(llama70b, vocab=32000) < 69.1e9


def test_the_tiny_models_context_is_the_one_it_is_built_with():
    from rlcore.config import TinyModelConfig
    from rlcore.engines.tiny import tiny_config
    from rlcore.preflight import TINY_MAX_POSITIONS

    assert tiny_config(TinyModelConfig(), 14, 1, 0).max_position_embeddings == TINY_MAX_POSITIONS


def test_a_model_directory_is_read_for_its_context_and_tokenizer(capsys, model_dir, tmp_path):
    """Its config.json's max_position_embeddings bounds the prompts; a directory whose tokenizer
    cannot be loaded is named (the engine would raise when it loads it)."""
    line = _check_error(capsys, f"engine.model.path={model_dir}", "data.prompt_len=600")
    assert "data.task" in line and f"more than the model's 512 positions ({model_dir} (qwen2)" in line
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):  # weights, but no tokenizer files
        (bare / name).write_bytes((model_dir / name).read_bytes())
    line = _check_error(capsys, f"engine.model.path={bare}")  # transformers builds an empty tokenizer
    assert line.startswith(f"rlcore: error: engine.model.path: the tokenizer of {bare} (qwen2) (1 tokens) turns "
                           f"prompt 0 of step 0 ") and "into no tokens" in line
