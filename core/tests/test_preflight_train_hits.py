"""Issue 38 item 4: ``rlcore check`` catches what ``rlcore train`` would hit, in one line naming
the key; a plugin's hook (or what it provided) that raises is one line naming the plugin and
the hook; a failed start leaves no run directory; and (item 7) words an environment writes that
the tiny model's tokenizer does not know are warned about once."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from omegaconf import OmegaConf
from rlcore.cli import main
from rlcore.config import TinyModelConfig
from rlcore.engines.tiny import make_tiny_model, make_tokenizer
from rlcore.environment_settings import EnvironmentConfig
from rlcore.environments.standard import ToolEnvironment
from rlcore.environments.tools import CALC, ToolRegistry
from rlcore.preflight import tiny_parameters
from rlcore.tasks import successor, tool_product
from rlcore.types import EnvStep, Turn

TINY = "examples/tiny.yaml"
TOOLS = "examples/tiny_tools.yaml"
QUIET = ["output.plot=false", "output.tensorboard=false", "output.progress=false"]
SMALL = ["rollout.n=2", "data.prompts_per_step=2", "training.steps=1", *QUIET]


def _write(tmp_path, name: str, source: str, monkeypatch) -> None:
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))


# ------------------------------------------------------------------------ optimizer -----

OPTIMIZER_CASES = [
    (["training.lr=1e30"], "training.lr=1e+30", "AdamW's first step moves every weight by lr"),
    (["training.lr=1.0"], "training.lr=1", "use below 1"),
    (["training.lr=0.01", "training.weight_decay=100"], "training.weight_decay=100", "1 - lr x weight_decay = 0"),
    (["algorithm.kl_coef=1e39"], "algorithm.kl_coef=1e+39", "beyond float32's range"),
    (["algorithm.name=ppo", "algorithm.critic.lr=5"], "algorithm.critic.lr=5", "AdamW's first step"),
]


def test_an_absurd_learning_rate_never_reaches_the_sampler_and_leaves_no_run_directory(capsys, tmp_path):
    out = tmp_path / "runs" / "lr"
    assert main(["train", TINY, "training.lr=1e30", *SMALL, "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "training.lr" in err[0], err
    assert not out.exists()


# ---------------------------------------------------------------------- model files -----

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny model saved as transformers saves it (safetensors, tokenizer, config.json)."""
    path = tmp_path_factory.mktemp("model")
    tok = make_tokenizer(successor().vocab)
    make_tiny_model(OmegaConf.structured(TinyModelConfig), tok, "float32").save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_a_whole_model_directory_passes_and_its_parameters_are_counted(capsys, model_dir):
    assert main(["check", TINY, f"engine.model.path={model_dir}"]) == 0
    out = capsys.readouterr().out
    assert "parameters" in out and "training holds at least" in out and "config OK" in out


def test_a_truncated_safetensors_file_is_refused_naming_it(check_refusal, model_dir, tmp_path):
    d = _copy(model_dir, tmp_path / "cut")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    line = check_refusal(TINY, f"engine.model.path={d}")
    assert "engine.model.path" in line and "model.safetensors" in line and "truncated" in line, line


def test_a_safetensors_file_with_a_broken_header_is_refused(check_refusal, model_dir, tmp_path):
    d = _copy(model_dir, tmp_path / "head")
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:12] = b"\xff\xfe{{"
    f.write_bytes(bytes(data))
    line = check_refusal(TINY, f"engine.model.path={d}")
    assert "model.safetensors" in line and "damaged" in line, line


def test_a_missing_shard_of_an_index_is_refused(check_refusal, model_dir, tmp_path):
    d = _copy(model_dir, tmp_path / "shards")
    (d / "model.safetensors.index.json").write_text('{"weight_map": {"x": "model-00002-of-00002.safetensors"}}')
    line = check_refusal(TINY, f"engine.model.path={d}")
    assert "model-00002-of-00002.safetensors" in line and "not there" in line, line


def test_a_directory_without_weights_is_refused(check_refusal, model_dir, tmp_path):
    d = _copy(model_dir, tmp_path / "none")
    (d / "model.safetensors").unlink()
    line = check_refusal(TINY, f"engine.model.path={d}")
    assert "no weights there" in line, line


def test_a_pickle_that_is_more_than_tensors_is_refused_without_running_it(check_refusal, model_dir, tmp_path):
    d = _copy(model_dir, tmp_path / "evil")
    (d / "model.safetensors").unlink()
    marker = tmp_path / "it-ran"

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    torch.save({"lm_head.weight": Payload()}, d / "pytorch_model.bin")
    line = check_refusal(TINY, f"engine.model.path={d}")
    assert "pytorch_model.bin is a pickle of more than tensors" in line and "safetensors" in line, line
    assert not marker.exists(), "the pickle's payload ran"


def test_a_pickle_of_plain_tensors_passes(capsys, model_dir, tmp_path):
    from safetensors.torch import load_file

    d = _copy(model_dir, tmp_path / "bin")
    torch.save(load_file(d / "model.safetensors"), d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()
    assert main(["check", TINY, f"engine.model.path={d}"]) == 0, capsys.readouterr().err


# ---------------------------------------------------------------------------- memory ----

def _machine_bytes() -> int:
    from rlcore.preflight import _swap_bytes

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") + _swap_bytes()


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU memory counts too; the layer count is for RAM + swap")
def test_a_model_whose_training_state_exceeds_memory_is_refused_though_its_weights_fit(check_refusal):
    t = OmegaConf.structured(TinyModelConfig)
    per_layer = (tiny_parameters(OmegaConf.merge(t, {"num_layers": 2}), 14)
                 - tiny_parameters(OmegaConf.merge(t, {"num_layers": 1}), 14)) * 4
    layers = _machine_bytes() // 2 // per_layer  # weights: half the machine; weights + grads + AdamW: twice it
    line = check_refusal(TINY, f"engine.model.tiny.num_layers={layers}")
    assert "engine.model.tiny.num_layers" in line and "to train" in line, line
    assert "gradients" in line and "exp_avg" in line, line


# ----------------------------------------------------------------------------- tools ----

TOOL_CASES = [
    (["environment.tools=[calc,shell]"], "environment.tools", "'shell' is not a known tool"),
    (["environment.tools=[calk]"], "environment.tools", "Did you mean 'calc'"),
    (["environment.tools=[calc,calc]"], "environment.tools", "more than once"),
    (["environment.tool_timeout_seconds=1e300"], "environment.tool_timeout_seconds", "does not limit"),
    (["environment.tools=[calc,python]"], "environment.tools", "comes with the plugin 'sandbox'"),
    (["environment.tools=[python,python]"], "environment.tools", "more than once"),
    (["environment.tool_output_chars=1000000000000000"], "environment.tool_output_chars", "more than this machine's"),
]


REFUSED = [(TINY, *case) for case in OPTIMIZER_CASES] + [(TOOLS, *case) for case in TOOL_CASES]


@pytest.mark.parametrize("config,overrides,key,says", REFUSED, ids=[" ".join(c[1]) for c in REFUSED])
def test_learning_rates_coefficients_tools_and_tool_limits_that_cannot_train_are_refused_naming_the_key(
        check_refusal, config, overrides, key, says):
    line = check_refusal(config, *overrides)
    assert key in line and says in line, line


def test_a_huge_tool_timeout_leaves_no_run_directory(capsys, tmp_path):
    out = tmp_path / "runs" / "t"
    assert main(["train", TOOLS, "environment.tool_timeout_seconds=1e300", *SMALL, "-o", str(out)]) == 2
    assert not out.exists()


# ----------------------------------------------------------------------------- tasks ----

TASKS = '''
from rlcore.tasks import Task, TaskPrompt

def empty(data):
    return Task("empty", ["a", "b"], lambda rng, n: [])

def surrogate_vocab(data):
    return Task("surrogate", ["a", "\\ud800"], lambda rng, n: [TaskPrompt("a")] * n)

def spaced_vocab(data):
    return Task("spaced", ["a b"], lambda rng, n: [TaskPrompt("a")] * n)

def surrogate_prompt(data):
    return Task("badprompt", ["a"], lambda rng, n: [TaskPrompt("a \\udc80")] * n)
'''


@pytest.mark.parametrize("task,says", [
    ("empty", "returned no prompts"),
    ("surrogate_vocab", "word 1 of task 'surrogate''s vocab"),
    ("spaced_vocab", "holds whitespace"),
    ("surrogate_prompt", "not encodable text"),
])
def test_tasks_train_would_fail_on_are_refused_naming_the_task(check_refusal, tmp_path, monkeypatch, task, says):
    _write(tmp_path, "issue38tasks", TASKS, monkeypatch)
    line = check_refusal(TINY, f"data.task=issue38tasks:{task}")
    assert "data.task" in line and says in line, line


def test_a_task_without_prompts_leaves_no_run_directory(capsys, tmp_path, monkeypatch):
    _write(tmp_path, "issue38tasks", TASKS, monkeypatch)
    out = tmp_path / "runs" / "empty"
    assert main(["train", TINY, "data.task=issue38tasks:empty", *SMALL, "-o", str(out)]) == 2
    assert not out.exists()


def test_a_run_that_fails_in_its_first_step_leaves_no_run_directory(capsys, tmp_path, monkeypatch):
    """What preflight cannot foresee (a reward that raises when it is first called): the run
    directory goes too, so the retry needs no --overwrite."""
    _write(tmp_path, "issue38reward", "def reward(x):\n    raise KeyError('answer')\n", monkeypatch)
    out = tmp_path / "runs" / "reward"
    assert main(["train", TINY, "data.reward=issue38reward:reward", *SMALL, "-o", str(out)]) == 2
    assert "KeyError" in capsys.readouterr().err
    assert not out.exists() or not any(out.iterdir())
    assert main(["train", TINY, *SMALL, "-o", str(out)]) == 0, "the retry runs without --overwrite"


# ------------------------------------------------------------------------ plugin hooks ----

RAISING = '''
from rlcore import PLUGIN_API, hookimpl
from rlcore.types import EnvironmentSpec, EnvStep

BROKEN = set()  # what the test breaks


class Env:
    def reset(self, prompt, task_prompt):
        if "reset" in BROKEN:
            raise KeyError("no such prompt state")
        return {}

    def step(self, state, turn):
        if "step" in BROKEN:
            raise ValueError("cannot parse the turn")
        return EnvStep(done=True, reason="answered")

    def final_reward(self, state):
        if "final_reward" in BROKEN:
            raise ZeroDivisionError("division by zero")
        return None


@hookimpl
def environment():
    yield EnvironmentSpec(name="raising", factory=lambda ctx: Env())


@hookimpl
def step_end(ctx):
    if "step_end" in BROKEN:
        raise RuntimeError("metrics backend down")
    return None
'''


@pytest.fixture
def raising_plugin(fake_distribution):
    fake_distribution("rlcore-raising", "0.1", {"raising": "issue38raising"}, {"issue38raising": RAISING})
    import importlib

    module = importlib.import_module("issue38raising")
    yield module
    module.BROKEN.clear()


@pytest.mark.parametrize("hook", ["reset", "step", "final_reward", "step_end"])
def test_any_hook_of_a_plugin_that_raises_is_one_line_naming_the_plugin_and_the_hook(capsys, tmp_path,
                                                                                     raising_plugin, hook):
    raising_plugin.BROKEN.add(hook)
    out = tmp_path / "runs" / hook
    rc = main(["train", TINY, "plugins=[raising]", "environment.name=raising", *SMALL, "-o", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("rlcore: error: plugin 'raising' (rlcore-raising 0.1): "), err[0]
    assert hook in err[0], err[0]
    assert not out.exists() or not any(out.iterdir()), "the failed first step left a run directory"


def test_the_plugin_manager_names_the_plugin_for_every_hook_call(rlcore_plugin_manager):
    from rlcore.errors import PluginHookError

    class Broken:
        PLUGIN_API = 1

        def __init__(self):
            from rlcore import hookimpl

            def step_end(ctx):
                raise RuntimeError("boom")

            def router_hook(call):
                raise IndexError("expert 9")

            def forward_fn():
                yield from ()
                raise OSError("registry unreachable")

            self.step_end = hookimpl(step_end)
            self.router_hook = hookimpl(router_hook)
            self.forward_fn = hookimpl(forward_fn)

    pm = rlcore_plugin_manager
    with pytest.raises(PluginHookError) as e:
        pm.register(Broken(), "brokenhooks")  # its provider hook is read as it joins
    assert e.value.plugin == "brokenhooks" and e.value.hook == "forward_fn" and "registry unreachable" in str(e.value)
    pm.unregister("brokenhooks")


def test_step_end_and_router_hook_errors_name_the_plugin(rlcore_plugin_manager):
    from rlcore import hookimpl
    from rlcore.errors import PluginHookError

    class Broken:
        PLUGIN_API = 1

        @staticmethod
        @hookimpl
        def step_end(ctx):
            raise RuntimeError("boom")

        @staticmethod
        @hookimpl
        def router_hook(call):
            raise IndexError("expert 9")

    pm = rlcore_plugin_manager
    pm.register(Broken(), "brokenchain")
    with pytest.raises(PluginHookError, match=r"plugin 'brokenchain' \(<local> 0\): step_end raised RuntimeError: boom"):
        pm.step_end(object())
    with pytest.raises(PluginHookError, match=r"router_hook raised IndexError: expert 9"):
        pm.router_hook(object())


# --------------------------------------------------------------------- unknown words -----

def _tools_env(tokenizer):
    settings = OmegaConf.structured(EnvironmentConfig(name="tools"))
    return ToolEnvironment(tokenizer, settings, ToolRegistry([CALC]))


def test_words_an_environment_writes_outside_the_tiny_vocabulary_are_warned_about_once():
    from rlcore.environments.standard import UnknownWordsWarning

    tok = make_tokenizer(tool_product().vocab)
    env = _tools_env(tok)
    state = env.reset(None, None)
    turn = Turn(ids=tok("calc 9 9 * 9 9", add_special_tokens=False)["input_ids"], finish_reason="stop", index=0,
                context_ids=[], tool_calls_left=4)
    with pytest.warns(UnknownWordsWarning, match=r"environment 'tools' wrote words .*'9801'"):
        step = env.step(state, turn)
    assert tok.unk_token_id in step.observation_ids
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the next such observation is not warned about again
        env.step(state, turn)


def test_known_words_give_no_warning():
    tok = make_tokenizer(tool_product().vocab)
    env = _tools_env(tok)
    turn = Turn(ids=tok("calc 7 * 8", add_special_tokens=False)["input_ids"], finish_reason="stop", index=0,
                context_ids=[], tool_calls_left=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step = env.step(env.reset(None, None), turn)
    assert tok.unk_token_id not in step.observation_ids


def test_a_plugin_environment_that_inserts_unk_is_warned_about_naming_it():
    from rlcore.environments.conversation import NamedEnvironment
    from rlcore.environments.standard import UnknownWordsWarning

    tok = make_tokenizer(["a"])

    class Echo:
        def reset(self, prompt, task_prompt):
            return None

        def step(self, state, turn):
            return EnvStep(done=False, observation_ids=tok("a zebra", add_special_tokens=False)["input_ids"])

        def final_reward(self, state):
            return None

    env = NamedEnvironment(Echo(), "echo", "rlcore-echo 1.0", "echo", tok)
    turn = Turn(ids=[3], finish_reason="stop", index=0, context_ids=[3], tool_calls_left=0)
    with pytest.warns(UnknownWordsWarning, match=r"environment 'echo' \(plugin 'echo'\)"):
        env.step(None, turn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        env.step(None, turn)
