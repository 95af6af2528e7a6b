"""The ``environment`` hook and core's conversation loop (issue 29): selection by
``environment.name``, token-in-token-out over several turns with a tokenizer whose decode/encode
is not a round trip, the loss mask over observations, the limits per conversation, per-turn
rewards, and the default ``single_turn`` environment giving the metrics the rollout always gave."""

from __future__ import annotations

import json
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from rlcore import errors, hookimpl
from rlcore.environments.conversation import (
    TURN_STRIDE,
    Limits,
    conversation_metrics,
    place_turn_rewards,
    run_conversations,
    turn_token_rewards,
)
from rlcore.environments.standard import SingleTurnEnvironment
from rlcore.sample_batch import pack_samples
from rlcore.sampling_rounds import loss_lengths
from rlcore.stack import load_stack, resolve
from rlcore.types import Environment, EnvironmentSpec, EnvStep, Prompt, SamplingSettings, ToolCall, implements

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny.yaml"
#: words whose decode joins them to the word before (WordPiece's ``##``): ``5 ##7`` decodes to
#: ``57``, which encodes to ``<unk>``: decode/encode is not a round trip
GLUED = [f"##{d}" for d in range(10)]


class Recording:
    """The rollout backend, recording every call (params, prompts) and, per whole sequence, the
    ids each turn of that conversation generated (an earlier turn found as the longest recorded
    prefix) with their behaviour log-probs."""

    def __init__(self, backend):
        self.backend, self.calls, self.turns = backend, [], {}

    def generate(self, prompts, params):
        got = self.backend.generate(prompts, params)
        self.calls.append((params, [list(p.ids) for p in prompts]))
        for s in got:
            prompt = tuple(s.prompt_ids)
            before = max((k for k in self.turns if prompt[: len(k)] == k), key=len, default=None)
            self.turns[(*prompt, *s.response_ids.tolist())] = [*self.turns.get(before, []),
                                                                (s.response_ids.tolist(), s.logprobs.clone())]
        return got


class Chatty:
    """Goes on for ever: every turn gets an observation of glued words (never re-encoded), a tool
    call, and a per-turn reward of 0.5."""

    def __init__(self, tokenizer):
        self.obs = tokenizer.convert_tokens_to_ids(["##3", "=", "##9"])

    def reset(self, prompt, task_prompt):
        return {"turns": 0}

    def step(self, state, turn):
        state["turns"] += 1
        return EnvStep(done=False, observation_ids=self.obs, reward=0.5, tool_calls=[ToolCall("calc", turn.index % 2 == 0)])

    def final_reward(self, state):
        return 1.0


@pytest.fixture(scope="module")
def glued_model(tmp_path_factory):
    """A tiny model whose tokenizer has the glued words, and a started local rollout over it."""
    from omegaconf import OmegaConf
    from rlcore.config import TinyModelConfig
    from rlcore.engines.tiny import save_tiny
    from rlcore.rollout_local import LocalRollout

    path = tmp_path_factory.mktemp("glued") / "model"
    tiny = OmegaConf.structured(TinyModelConfig)
    save_tiny(path, tiny, [str(d) for d in range(10)] + ["="] + GLUED)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    backend = LocalRollout(seed=1)
    backend.start(str(path))
    yield tok, backend
    backend.shutdown()


def _prompts(tok, n=3):
    texts = ["1 2 =", "7 ##7 =", "3 ="]
    return [Prompt(ids=tok(t, add_special_tokens=False)["input_ids"], index=i) for i, t in enumerate(texts[:n])]


def test_trained_ids_are_the_generated_ids_over_several_turns(glued_model):
    tok, backend = glued_model
    rec = Recording(backend)
    prompts = _prompts(tok)
    params = SamplingSettings(n=2, temperature=1.5, max_new_tokens=5, seed=11)
    samples = run_conversations(Chatty(tok), rec, prompts, [None] * 3, params, Limits(3, 0, 99))
    assert rec.calls[0][0].n == 2 and rec.calls[0][1] == [p.ids for p in prompts]
    for params_k, _ in rec.calls[1:]:  # later turns: the turn's own seed
        assert (params_k.seed - 11) // TURN_STRIDE in (1, 2) and (params_k.seed - 11) % TURN_STRIDE == 0
    later = [ids for _, asked in rec.calls[1:] for ids in asked]
    obs = tok.convert_tokens_to_ids(["##3", "=", "##9"])
    drifted = 0
    batch = pack_samples(samples, [0.0] * len(samples), SimpleNamespace(info=SimpleNamespace(route_layout=None,
                                                                                              pad_token_id=0)), 0)
    seqs = batch.unpack(batch.input_ids)
    masks = batch.unpack(batch.loss_mask)
    old = batch.unpack(batch.fields["old_logprobs"])
    for i, s in enumerate(samples):
        prompt = prompts[i // 2].ids
        expected = prompt + s.response_ids.tolist()
        turns = rec.turns[tuple(expected)]
        ids = [t for t, _ in turns]
        assert len(ids) == 3
        # every turn's prompt was the conversation so far, as ids: no decode/encode in between
        assert prompt + ids[0] + obs in later and prompt + ids[0] + obs + ids[1] + obs in later
        assert expected == prompt + ids[0] + obs + ids[1] + obs + ids[2]
        assert seqs[i].tolist() == expected
        # the loss covers exactly the generated tokens (label-aligned: position t predicts t + 1)
        trained = [expected[t + 1] for t in range(len(expected) - 1) if masks[i][t]]
        assert trained == ids[0] + ids[1] + ids[2]
        assert torch.equal(old[i][masks[i]], torch.cat([lp for _, lp in turns]).float())
        assert s.extras["turns"] == 3 and s.extras["end_reason"] == "max_turns"
        text = tok.decode(expected[len(prompt):])
        drifted += tok(text, add_special_tokens=False)["input_ids"] != expected[len(prompt):]
    assert drifted == len(samples), "the glued observation makes every decode/encode drift: the ids above did not"
    assert loss_lengths(samples, SimpleNamespace(dapo=SimpleNamespace(overlong=SimpleNamespace(filter=False)))) == [
        int(m.sum()) for m in masks]


def test_conversations_with_equal_ids_are_sampled_as_one_prompt_with_n(glued_model):
    """Greedy turn 0 gives both samples of a prompt the same ids: turn 1 asks for them as one prompt
    with n = 2 (an engine that seeds every request alike would draw the same token for each)."""
    tok, backend = glued_model
    rec = Recording(backend)
    params = SamplingSettings(n=2, temperature=0.0, max_new_tokens=2, seed=1)
    samples = run_conversations(Chatty(tok), rec, _prompts(tok), [None] * 3, params, Limits(2, 0, 99))
    assert [(p.n, len(asked)) for p, asked in rec.calls] == [(2, 3), (2, 3)]
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1, 2, 2]
    for a, b in zip(samples[::2], samples[1::2], strict=True):
        assert torch.equal(a.response_ids, b.response_ids)  # greedy: the same, from one prompt


def test_limits_end_a_conversation_with_the_reason(glued_model):
    tok, backend = glued_model
    params = SamplingSettings(n=1, temperature=1.0, max_new_tokens=4, seed=3)

    def run(limits):
        return run_conversations(Chatty(tok), backend, _prompts(tok, 2), [None] * 2, params, limits)

    assert {s.extras["end_reason"] for s in run(Limits(2, 0, 99))} == {"max_turns"}
    one = run(Limits(9, 0, 1))  # turn 0 calls a tool (1 of 1), turn 1 a second: over the limit
    assert {s.extras["end_reason"] for s in one} == {"max_tool_calls"} and {s.extras["turns"] for s in one} == {2}
    capped = run(Limits(9, 12, 99))
    for s in capped:
        assert s.extras["end_reason"] == "max_total_tokens"
        assert len(s.prompt_ids) + len(s.response_ids) <= 12
        assert bool(s.response_mask[-1]), "a conversation ends on the model's tokens, not an observation"


def test_one_turn_is_the_engines_own_sample_and_single_turn_numbers_hold(glued_model):
    tok, backend = glued_model
    params = SamplingSettings(n=4, temperature=1.0, max_new_tokens=4, seed=5)
    plain = backend.generate(_prompts(tok), params)
    via = run_conversations(SingleTurnEnvironment(), backend, _prompts(tok), [None] * 3, params, Limits(4, 0, 4))
    for a, b in zip(plain, via, strict=True):
        assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
        assert b.response_mask is None and b.extras["turns"] == 1 and b.extras["end_reason"] == "answered"


def test_per_turn_rewards_land_on_their_turns_last_token(glued_model):
    tok, backend = glued_model
    params = SamplingSettings(n=1, temperature=1.0, max_new_tokens=3, seed=9)
    samples = run_conversations(Chatty(tok), backend, _prompts(tok, 2), [None] * 2, params, Limits(3, 0, 99))
    rewards = [1.0 + sum(v for _, v in s.extras["turn_rewards"]) for s in samples]  # final 1 + 0.5 per turn
    per_token = turn_token_rewards(samples, rewards)
    for s, r, tr in zip(samples, rewards, per_token, strict=True):
        assert tr.shape[0] == int(s.response_mask.sum())
        assert torch.isclose(tr.sum(), torch.tensor(r))
        ends = torch.cumsum(s.response_mask.long(), 0) - 1
        for at, value in s.extras["turn_rewards"][:-1]:
            assert tr[int(ends[at])] == value  # each turn's reward on its last trained token
    # what the trainer's estimators get: shaped_rewards' outcome on the last token, moved to the turns
    from rlcore.algorithms.advantages import shaped_rewards

    counts = [int(s.response_mask.sum()) for s in samples]
    shaped, _ = shaped_rewards(rewards, counts, [torch.full((n,), -0.01) for n in counts], True)
    place_turn_rewards(shaped, samples, rewards)
    for tr, want in zip(shaped, per_token, strict=True):
        assert torch.allclose(tr, want - 0.01)  # the per-token KL penalty stays where it was
    m = conversation_metrics(samples)
    assert m["env/turns_mean"] == 3 and m["env/end/max_turns"] == 1.0
    assert m["env/tool_calls/calc"] == 6 and m["env/tool_failures/calc"] == 2  # turn 1 of each fails
    assert m["env/tokens_observed"] == 2 * 2 * 3


def test_hook_environment(rlcore_plugin_manager, register_plugin, rlcore_config):
    mod = types.ModuleType("acme_env")
    mod.PLUGIN_API = 1
    mod.environment = hookimpl(lambda: [EnvironmentSpec(name="acme", factory=lambda ctx: Chatty(ctx.engine.tokenizer))])
    mod.environment.__name__ = "environment"
    register_plugin(mod, "acme_env", distribution="acme-env", version="1.0")
    specs = rlcore_plugin_manager.environments()
    assert set(specs) == {"single_turn", "tools", "acme"}
    assert specs["acme"].distribution == "acme-env 1.0" and specs["single_turn"].distribution.startswith("rlcore ")
    assert implements(specs["single_turn"].factory(None), Environment)
    assert resolve(rlcore_config(), rlcore_plugin_manager).environment.name == "single_turn"
    stack = resolve(rlcore_config("environment.name=acme"), rlcore_plugin_manager)
    assert stack.environment.name == "acme" and stack.describe()["environment"]["distribution"] == "acme-env 1.0"
    with pytest.raises(errors.UnknownProviderError, match="environment.name: 'chess' is not a known environment") as err:
        resolve(rlcore_config("environment.name=chess"), rlcore_plugin_manager)
    assert err.value.key == "environment.name"


@pytest.mark.parametrize("override,key", [
    ("environment.max_turns=0", "environment.max_turns"),
    ("environment.max_total_tokens=-1", "environment.max_total_tokens"),
    ("environment.tool_timeout_seconds=0", "environment.tool_timeout_seconds"),
    ("environment.tool_format=xml", "environment.tool_format"),
    ("environment.tools=[python]", "environment.tools"),  # rlcore-sandbox's, not active: named with its plugin
    ("environment.observation_tokens=0", "environment.observation_tokens"),
    ("environment.tools=[calc,shell]", "environment.tools"),
])
def test_bad_environment_settings_name_the_key(override, key):
    with pytest.raises(errors.ConfigError) as err:
        load_stack(str(TINY), ["environment.name=tools", *override.split("\0")])
    assert err.value.key == key


def test_a_single_turn_algorithm_is_refused_with_a_multi_turn_environment(rlcore_plugin_manager, register_plugin):
    """AlgorithmSpec.single_turn (ReMax's, in rlcore-algorithms: plugins/algorithms/tests)."""
    import dataclasses
    import types

    from rlcore import hookimpl

    grpo = rlcore_plugin_manager.algorithms()["grpo"]
    mod = types.ModuleType("oneturn")
    mod.PLUGIN_API = 1
    mod.algorithm = hookimpl(lambda: [dataclasses.replace(grpo, name="one-turn", single_turn=True)])
    register_plugin(mod, "oneturn")
    from rlcore.stack import load_config

    with pytest.raises(errors.ConfigError, match="single-turn only") as err:
        load_config(str(TINY), ["environment.name=tools", "algorithm.name=one-turn"], plugins=rlcore_plugin_manager)
    assert err.value.key == "environment.name"
    load_config(str(TINY), ["algorithm.name=one-turn"], plugins=rlcore_plugin_manager)  # single_turn: accepted


def _metrics(out):
    timing = ("seconds", "tokens_per_second", "wall", "bytes", "memory", "mb")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not any(t in k for t in timing)} for r in rows]


def test_single_turn_gives_the_metrics_the_rollout_gave_without_an_environment(tmp_path):
    """The default run with its built ``single_turn`` environment, and the same run with no
    environment at all (the one-prompt-one-completion path sample_step always had): identical
    metrics, step for step, in one process."""
    from rlcore.trainer import Trainer

    runs = []
    for name, keep in (("env", True), ("none", False)):
        out = tmp_path / name
        trainer = Trainer(load_stack(str(TINY), ["training.steps=3", f"output.dir={out}", "output.checkpoint_every=0",
                                                 "output.plot=false", "data.prompts_per_step=4"]))
        assert isinstance(trainer.built.environment.inner, SingleTurnEnvironment)  # as built, its plugin named
        if not keep:
            trainer.built.environment = None
        trainer.run()
        runs.append(_metrics(out))
    assert runs[0] == runs[1]
    assert not any(k.startswith("env/") for k in runs[0][0]), "single_turn adds no metric"
