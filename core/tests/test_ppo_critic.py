"""PPO with a critic on the embedded default: it learns, its value metrics are reported, the
critic is checkpointed and resumed exactly (within one process), its settings are validated
naming the key, and an engine that cannot build a value model is refused at check time."""

import json
import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from rlcore import PLUGIN_API, hookimpl
from rlcore.cli import main
from rlcore.errors import ConfigError, MissingCapabilityError
from rlcore.run_output import read_metrics
from rlcore.stack import load_config, load_stack, resolve
from rlcore.types import Cap, EngineSpec

TINY = str(Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml")
CRITIC_KEYS = ("critic/vf_loss", "critic/vf_clipfrac", "critic/explained_variance", "critic/values_mean",
               "critic/returns_mean", "critic/grad_norm")


def _train(out: Path, *overrides: str, resume: bool = False) -> int:
    return main(["train", TINY, "--output", str(out), *(["--resume"] if resume else []), "algorithm.name=ppo",
                 "output.plot=false", "output.progress=false", *overrides])


def _mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs)


@pytest.mark.slow
def test_ppo_learns_on_the_embedded_default(tmp_path):
    """~10 s: the successor task from chance level; the longer curve is docs/algorithms/ppo_tiny.png."""
    assert _train(tmp_path / "run", "training.steps=45", "output.checkpoint_every=0") == 0
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 45
    for key in CRITIC_KEYS:
        assert all(key in r for r in rows), key
    start, end = _mean(r["reward_mean"] for r in rows[:5]), _mean(r["reward_mean"] for r in rows[-8:])
    print(f"ppo reward {start:.3f} (first 5 steps) -> {end:.3f} (last 8)")
    assert start < 0.2 and end > start + 0.15
    # the critic is trained: its loss falls from the first steps' (values start near 0)
    assert rows[-1]["critic/grad_norm"] > 0


def _critic_state(out: Path, step: int):
    return torch.load(out / "checkpoints" / f"step-{step:08d}.pt", weights_only=False)


@pytest.mark.slow
def test_killed_run_resumes_to_the_uninterrupted_run_with_the_critic(tmp_path):
    """SIGKILLed when step 4's samples come back (RLCORE_FAULT, rlcore.faults), resumed from step
    3's checkpoint: the resumed steps' metrics and the final critic (weights and AdamW state)
    equal the uninterrupted run's, torch.equal. Both are computed in this process; only the
    checkpoint comes from the killed process (CPU, same machine: a step is a pure function of
    the checkpointed state, as tests/test_fault_injection.py relies on for GRPO)."""
    common = ["training.steps=6", "output.checkpoint_every=2", "data.prompts_per_step=4", "rollout.n=4",
              "algorithm.updates_per_step=2", "output.tensorboard=false"]
    assert _train(tmp_path / "full", *common) == 0
    cut = tmp_path / "cut"
    proc = subprocess.run([sys.executable, "-m", "rlcore.cli", "train", TINY, "--output", str(cut), "algorithm.name=ppo",
                           "output.plot=false", "output.progress=false", *common],
                          env=dict(os.environ, RLCORE_FAULT="rollout:5"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert [r["step"] for r in read_metrics(cut)] == [0, 1, 2, 3]
    assert _train(cut, *common, resume=True) == 0
    full, resumed = read_metrics(tmp_path / "full"), read_metrics(cut)
    assert [r["step"] for r in resumed] == list(range(6))
    for a, b in zip(full[4:], resumed[4:], strict=True):
        for key in ("reward_mean", "loss", "grad_norm", *CRITIC_KEYS):
            assert a[key] == b[key], f"step {a['step']} {key}: {a[key]} != {b[key]}"
    a, b = _critic_state(tmp_path / "full", 5)["critic"], _critic_state(cut, 5)["critic"]
    assert a["optimizer"]["state"], "the critic's AdamW state is in the checkpoint"
    for part in ("trunk", "head"):
        assert a[part].keys() == b[part].keys()
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), f"critic {part}.{k}"
    for i, st in a["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, b["optimizer"]["state"][i][k]), f"critic optimizer state {i}.{k}"


def test_checkpoint_without_a_critic_does_not_resume_a_ppo_run(tmp_path, capsys):
    assert main(["train", TINY, "--output", str(tmp_path), "training.steps=1", "output.checkpoint_every=1",
                 "output.plot=false", "output.progress=false", "data.prompts_per_step=2", "rollout.n=2"]) == 0
    code = _train(tmp_path, "training.steps=2", "output.checkpoint_every=1", "data.prompts_per_step=2", "rollout.n=2",
                  "--allow-config-change", resume=True)
    assert code != 0
    assert "does not fit this run: KeyError: 'critic'" in capsys.readouterr().err


@pytest.mark.parametrize(("override", "key"), [
    ("algorithm.critic.cliprange_value=-0.1", "algorithm.critic.cliprange_value"),
    ("algorithm.critic.lr=-1", "algorithm.critic.lr"),
    ("algorithm.critic.grad_clip=-2", "algorithm.critic.grad_clip"),
    ("algorithm.lam=1.5", "algorithm.lam"),
    ("algorithm.gamma=-0.1", "algorithm.gamma"),
    ("algorithm.critic.no_such=1", "algorithm.critic.no_such"),
    ("algorithm.critic.lr=fast", "algorithm.critic.lr"),
    ("algorithm.critic.warmup_steps=-1", "algorithm.critic.warmup_steps"),
    ("algorithm.critic.warmup_steps=1.5", "algorithm.critic.warmup_steps"),
])
def test_ppo_settings_errors_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as err:
        load_stack(TINY, ["algorithm.name=ppo", override])
    assert err.value.key == key


def test_critic_settings_belong_to_ppo_only():
    with pytest.raises(ConfigError, match=r"algorithm\.critic") as err:
        load_stack(TINY, ["algorithm.critic.lr=0.1"])  # grpo trains no critic: not silently ignored
    assert err.value.key == "algorithm.critic"
    cfg = load_stack(TINY, ["algorithm.name=ppo"]).config
    assert (cfg.algorithm.gamma, cfg.algorithm.lam, cfg.algorithm.critic.cliprange_value) == (1.0, 1.0, 0.5)


def test_an_engine_without_a_value_model_is_refused_naming_it(rlcore_plugin_manager):
    mod = types.ModuleType("novalue")
    mod.PLUGIN_API = PLUGIN_API

    @hookimpl
    def engine():
        yield EngineSpec(name="novalue", factory=lambda ctx: None, capabilities={Cap.MOE})

    mod.engine = engine
    rlcore_plugin_manager.register(mod, "novalue")
    cfg, pm = load_config(TINY, ["algorithm.name=ppo", "engine.name=novalue"], plugins=rlcore_plugin_manager)
    with pytest.raises(MissingCapabilityError, match="capability 'value_model'.*engine 'novalue'"):
        resolve(cfg, pm)
    cfg, pm = load_config(TINY, ["engine.name=novalue"], plugins=rlcore_plugin_manager)
    resolve(cfg, pm)  # grpo needs no critic


def test_check_json_lists_the_ppo_stack(capsys):
    assert main(["check", TINY, "algorithm.name=ppo", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "ppo" in json.dumps(out)


def _engine_and_critic(out: Path, step: int):
    state = _critic_state(out, step)
    return state["engine"], state["critic"]


def _tensors(state, prefix=""):
    """Every tensor of a nested state dict by its dotted path."""
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list | tuple) else ()
    return {k: v for key, sub in items for k, v in _tensors(sub, f"{prefix}.{key}" if prefix else str(key)).items()}


def test_critic_warmup_freezes_the_policy_and_resumes_exactly_across_its_end(tmp_path):
    """algorithm.critic.warmup_steps=2: after steps 0 and 1 the policy's weights equal the
    initial model's while the critic's have moved; step 2 updates both. A run stopped after
    step 1 and resumed (training.steps is not part of the fingerprint) continues across the
    warmup's end to the uninterrupted run's metrics and weights, torch.equal (same process)."""
    common = ["output.checkpoint_every=1", "output.keep_checkpoints=10", "data.prompts_per_step=2", "rollout.n=4",
              "output.tensorboard=false", "algorithm.critic.warmup_steps=2"]
    full = tmp_path / "full"
    assert _train(full, "training.steps=4", *common) == 0
    rows = read_metrics(full)
    assert [r["critic/policy_frozen"] for r in rows] == [1.0, 1.0, 0.0, 0.0]
    assert [r["weight_version"] for r in rows] == [1, 2, 3, 4]  # still pushed (and logged) while frozen
    assert all(r["critic/grad_norm"] > 0 for r in rows)
    assert "loss" not in rows[0] and "loss" in rows[2]
    # the policy's AdamW never stepped during warmup (no state: the weights are the initial ones)
    engines = [_engine_and_critic(full, s)[0] for s in range(4)]
    assert [bool(e["optimizer"]["state"]) for e in engines] == [False, False, True, True]
    policy = [_tensors(e["model"]) for e in engines]
    assert all(torch.equal(policy[0][k], policy[1][k]) for k in policy[0]), "policy moved during warmup"
    assert any(not torch.equal(policy[1][k], policy[2][k]) for k in policy[0]), "the policy learns after warmup"
    critic0, critic1 = (_tensors(_engine_and_critic(full, s)[1]["trunk"]) for s in (0, 1))
    assert any(not torch.equal(critic0[k], critic1[k]) for k in critic0), "the critic learns during warmup"

    cut = tmp_path / "cut"
    assert _train(cut, "training.steps=2", *common) == 0
    assert _train(cut, "training.steps=4", *common, resume=True) == 0
    resumed = read_metrics(cut)
    for a, b in zip(rows[2:], resumed[2:], strict=True):
        for key in ("reward_mean", "loss", "grad_norm", "critic/policy_frozen", *CRITIC_KEYS):
            assert a[key] == b[key], f"step {a['step']} {key}: {a[key]} != {b[key]}"
    a, b = _tensors(_critic_state(full, 3)), _tensors(_critic_state(cut, 3))
    for k in a:
        if k.startswith(("engine", "critic")):
            assert torch.equal(a[k], b[k]), k
