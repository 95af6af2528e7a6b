"""Issue 12, item 4: what the config and the declared capabilities promise is what a run does.

Each test fails on the main of before: a head without ``entropy`` under ``entropy_coef > 0``
trained without the term, a vocab-sharded head weight reached a head that cannot combine
shards, ``mtp_hidden`` asked of the ``hf`` engine was ignored, and ``rollout.seed`` was
overwritten every step by a seed derived from ``training.seed``."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from rlcore import errors, hookimpl
from rlcore.algorithms import TokenObjective
from rlcore.stack import check_engine_head, load_stack, resolve
from rlcore.types import Cap, ForwardFnSpec, ForwardRequest, HeadWeight, VocabShard

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "tiny.yaml")
SMALL = ["rollout.n=2", "data.prompts_per_step=2", "output.plot=false", "output.tensorboard=false",
         "output.progress=false", "training.steps=1"]


def _head_plugin(caps):
    """A plugin registering forward_fn ``plainhead`` (the reference head's maths) that declares
    only ``caps``, the way a third-party head declares what it supports."""
    mod = types.ModuleType("plainhead")
    mod.PLUGIN_API = 1

    def forward_fn():
        from rlcore.heads import ReferenceHead

        yield ForwardFnSpec(name="plainhead", factory=lambda ctx: ReferenceHead(), capabilities=caps)

    mod.forward_fn = hookimpl(forward_fn)
    return mod


# ------------------------------------------------------------------------- entropy --------


def test_entropy_bonus_with_a_head_that_has_no_entropy_is_refused(rlcore_plugin_manager, register_plugin,
                                                                  rlcore_config):
    register_plugin(_head_plugin({Cap.PER_TOKEN_TEMPERATURE, Cap.VOCAB_PARALLEL}), "plainhead")
    resolve(rlcore_config("forward.name=plainhead"), rlcore_plugin_manager)  # no bonus: fine
    with pytest.raises(errors.MissingCapabilityError) as e:
        resolve(rlcore_config("forward.name=plainhead", "algorithm.entropy_coef=0.01"), rlcore_plugin_manager)
    msg = str(e.value)
    assert "algorithm.entropy_coef=0.01" in msg and "'plainhead'" in msg and "'entropy'" in msg


def test_entropy_bonus_never_drops_a_missing_entropy_at_run_time():
    """A head that declares ``entropy`` but returns ``None``: the loss refuses it (it was dropped)."""
    from rlcore.algorithms import PPOClip, TokenInputs

    T = 4
    lp = torch.full((T,), -1.0, requires_grad=True)
    x = TokenInputs(old_logprobs=torch.full((T,), -1.0), rollout_logprobs=torch.full((T,), -1.0),
                    advantages=torch.ones(T), mask=torch.ones(T, dtype=torch.bool), weights=torch.ones(T),
                    correction=None, ref_logprobs=None, seq_index=torch.zeros(T, dtype=torch.long),
                    seq_tokens=torch.tensor([float(T)]))
    obj = TokenObjective(PPOClip(), entropy_coef=0.01)
    ent = torch.full((T,), 2.0)
    assert torch.allclose(obj.value(lp, ent, x) - TokenObjective(PPOClip()).value(lp, ent, x),
                          torch.full((T,), -0.02))
    for run in (lambda: obj.value(lp, None, x), lambda: obj.closed_form(lp, None, x)):
        with pytest.raises(errors.MissingCapabilityError, match=r"algorithm.entropy_coef=0.01 .* returned none"):
            run()
    TokenObjective(PPOClip()).value(lp, None, x)  # no bonus: no entropy needed


# ------------------------------------------------------------------ vocab parallel --------


def test_a_vocab_sharded_head_weight_needs_a_vocab_parallel_head(rlcore_plugin_manager, register_plugin,
                                                                 rlcore_config, monkeypatch):
    """Any engine (not only one that declares its sharding up front): once built, a head weight
    sharded over a group of more than one rank is refused to a head without ``vocab_parallel``."""
    import rlcore.distributed

    register_plugin(_head_plugin({Cap.ENTROPY, Cap.PER_TOKEN_TEMPERATURE}), "plainhead")
    group = object()
    monkeypatch.setattr(rlcore.distributed, "group_size", lambda g: 2 if g is group else 1)
    engine = types.SimpleNamespace(head=lambda: HeadWeight(torch.zeros(64, 8), VocabShard(64, 128, 100, group)))
    unsharded = types.SimpleNamespace(head=lambda: HeadWeight(torch.zeros(100, 8), VocabShard.full(100)))

    plain = resolve(rlcore_config("forward.name=plainhead"), rlcore_plugin_manager)
    check_engine_head(plain, unsharded)
    with pytest.raises(errors.MissingCapabilityError) as e:
        check_engine_head(plain, engine)
    msg = str(e.value)
    assert "over 2 tensor-parallel ranks" in msg and "ids [64, 128) of 100" in msg
    assert "forward_fn 'plainhead'" in msg and "'vocab_parallel'" in msg
    check_engine_head(resolve(rlcore_config(), rlcore_plugin_manager), engine)  # reference: vocab parallel


# ------------------------------------------------------------------------ mtp_hidden --------


def _mtp_asker():
    mod = types.ModuleType("mtpasker")
    mod.PLUGIN_API = 1

    def forward_request(ctx):
        return ForwardRequest(mtp_hidden=True) if ctx.phase == "train" else None

    mod.forward_request = hookimpl(forward_request)
    return mod


def test_mtp_hidden_asked_of_the_hf_engine_names_the_engine_and_the_plugin(rlcore_plugin_manager, register_plugin,
                                                                         rlcore_config, tmp_path):
    from rlcore.testing.runs import Trainer

    register_plugin(_mtp_asker(), "mtpasker")
    cfg = rlcore_config(f"output.dir={tmp_path / 'run'}", *SMALL)
    trainer = Trainer(resolve(cfg, rlcore_plugin_manager))
    with pytest.raises(errors.MissingCapabilityError) as e:
        trainer.run()
    msg = str(e.value)
    assert "plugin(s) 'mtpasker'" in msg and "engine 'hf'" in msg and "MTP hidden states" in msg
    assert "train pass" in msg


def test_hf_engine_refuses_mtp_hidden_itself():
    from rlcore.batch import PackedBatch
    from rlcore.engines.tiny import make_tiny_model, make_tokenizer
    from rlcore.testing.models import HFEngine, TinyModelConfig

    tok = make_tokenizer(["a", "b"])
    engine = HFEngine(make_tiny_model(TinyModelConfig(hidden_size=32, head_dim=16, intermediate_size=32), tok), tok)
    batch = PackedBatch.pack([[3, 4, 3]], [1])
    assert engine.forward(batch).hidden.shape == (3, 32)
    with pytest.raises(errors.MissingCapabilityError, match="engine 'hf': the model .* has no MTP layers"):
        engine.forward(batch, mtp_hidden=True)


# ------------------------------------------------------------------------ rollout.seed -------


def _first_step_rollout(tmp_path, name, *overrides):
    """(seed asked for, prompt ids, response ids) of step 0's rollout."""
    from rlcore.testing.runs import Trainer

    trainer = Trainer(load_stack(TINY, [f"output.dir={tmp_path / name}", *SMALL, *overrides]))
    seen = []
    real = trainer.backend.generate

    def generate(prompts, params):
        samples = real(prompts, params)
        seen.append((params.seed, [p.ids for p in prompts], [s.response_ids.tolist() for s in samples]))
        return samples

    trainer.backend.generate = generate
    trainer.run()
    return seen[0]


def test_rollout_seed_seeds_the_samples_and_only_them(tmp_path):
    from rlcore.rollout_seeds import SEED_STRIDE

    default = _first_step_rollout(tmp_path, "default", "rollout.max_new_tokens=8")
    same = _first_step_rollout(tmp_path, "same", "rollout.max_new_tokens=8", "rollout.seed=0")  # = training.seed
    other = _first_step_rollout(tmp_path, "other", "rollout.max_new_tokens=8", "rollout.seed=7")
    assert default == same, "unset, rollout.seed is training.seed"
    assert other[0] == 7 * SEED_STRIDE + 0, "step 0 samples with rollout.seed's stream"
    assert other[1] == default[1], "prompts follow training.seed"
    assert other[2] != default[2], "the samples follow rollout.seed"


# ------------------------------------------------------------------------ docs/tasks.md ------


def _doc_python_blocks(name):
    import re

    return re.findall(r"```python\n(.*?)```", (ROOT / "docs" / name).read_text(), re.S)


def test_docs_tasks_example_trains(tmp_path, monkeypatch):
    """The task and reward of docs/tasks.md, written to mytask.py, train for two steps."""
    import json

    from rlcore.testing.runs import main

    (tmp_path / "mytask.py").write_text(_doc_python_blocks("tasks.md")[0])
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    assert main(["train", TINY, "--output", str(out), *SMALL, "training.steps=2", "data.task=mytask:colours",
                 "data.reward=mytask:colours_reward"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rows)


BAD_TASKS = """
from rlcore.tasks import Task, TaskPrompt
def short(data):
    return Task("short", ["a"], lambda rng, n: [TaskPrompt("a")] * (n - 1))
def strings(data):
    return Task("strings", ["a"], lambda rng, n: ["a"] * n)
"""


@pytest.mark.parametrize("task,match", [("short", r"returned a list of 1 from make_prompts\(rng, 2\) at step 0"),
                                        ("strings", r"returned 'a' as prompt 0 at step 0")])
def test_a_task_returning_the_wrong_prompts_is_named(tmp_path, monkeypatch, task, match):
    from rlcore.errors import ConfigError
    from rlcore.testing.runs import Trainer

    (tmp_path / "badtasks.py").write_text(BAD_TASKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=match) as e:  # preflight makes the first steps' prompts: before a step
        Trainer(load_stack(TINY, [f"output.dir={tmp_path / 'run'}", *SMALL, f"data.task=badtasks:{task}"])).run()
    assert e.value.key == "data.task" and f"task {task!r}" in str(e.value)
