"""Conformance suite for the ``environment`` hook: a plugin's tests subclass it once per environment.

.. code-block:: python

    from rlcore.testing.environment_conformance import EnvironmentConformance

    class TestGuess(EnvironmentConformance):
        # config overrides that select the environment on the embedded tiny example
        overrides = ["plugins=[my_plugin]", "environment.name=guess"]

Every check builds the environment as a run does (the spec's factory with the run's
:class:`~rlcore.types.BuildContext`: the config, the plugin's section, the tiny training engine
and its tokenizer, the task): the spec is typed and its factory builds an
:class:`~rlcore.types.Environment`; ``step`` answers anything a model may write (random ids, the
stop token, an empty turn, ids of the prompt) with an :class:`~rlcore.types.EnvStep` whose
observation ids are ints in the tokenizer's vocabulary and whose reward is finite, never an
exception; conversations run by core's loop keep the engine's ids byte for byte with the
observations masked out of the loss and end within ``environment.max_turns``; and a short
training run (``steps`` steps) completes with the environment's metrics. Set ``config_path`` to
use another config, ``fuzz_turns`` for more random turns.

For a ``tool`` provider's own tests, :func:`tool_environment` builds core's ``tools`` environment
over a registry of tools and a tokenizer of the words the test writes, and :func:`model_turn` is
the turn a model wrote as that text.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from rlcore.types import BuildContext, EnvironmentSpec, EnvStep, Prompt, SamplingSettings, Turn, implements
from rlcore.types.environment import Environment

__all__ = ["EnvironmentConformance", "model_turn", "tool_environment"]

#: the ``environment:`` settings :func:`tool_environment` starts from (words format, short limits)
TOOL_ENVIRONMENT_SETTINGS = dict(tool_timeout_seconds=10.0, tool_output_chars=64, observation_tokens=16,
                                 tool_call_reward=0.25, tool_format="words", observation_prefix="result")


def tool_environment(registry: Any, words: list[str], **settings: Any) -> tuple[Any, Any]:
    """``(tokenizer, environment)``: core's ``tools`` environment over ``registry`` (a
    :class:`~rlcore.environments.tools.ToolRegistry`) with a tokenizer of ``words`` (the words the
    test's turns and the expected observations use); ``settings`` override
    :data:`TOOL_ENVIRONMENT_SETTINGS` and ``tools`` (default: every tool of the registry)."""
    from types import SimpleNamespace

    from rlcore.engines.tiny import make_tokenizer
    from rlcore.environments.standard import ToolEnvironment

    tok = make_tokenizer(list(words))
    s = dict(TOOL_ENVIRONMENT_SETTINGS, tools=list(registry.names()))
    s.update(settings)
    return tok, ToolEnvironment(tok, SimpleNamespace(**s), registry)


def model_turn(tokenizer: Any, text: str, tool_calls_left: int = 3, index: int = 0) -> Turn:
    """The model's turn that wrote ``text`` (its ids as the tokenizer makes them, stopped), the
    whole conversation so far being that turn."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return Turn(ids=ids, finish_reason="stop", index=index, context_ids=ids, tool_calls_left=tool_calls_left)


class EnvironmentConformance:
    overrides: list[str] = []
    config_path: str | None = None
    steps: int = 2
    fuzz_turns: int = 64

    @classmethod
    def _stack(cls, out: Path) -> Any:
        from rlcore.stack import load_stack

        return load_stack(cls.config_path, [*cls.overrides, f"training.steps={cls.steps}", f"output.dir={out}",
                                            "data.prompts_per_step=4", "rollout.n=2", "output.plot=false",
                                            "output.checkpoint_every=0"])

    @pytest.fixture(scope="class")
    @classmethod
    def built(cls, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
        """The stack, the tiny engine, the task and the environment, as a run builds them."""
        from rlcore.tasks import load_callable

        out = tmp_path_factory.mktemp("environment-conformance") / "run"
        stack = cls._stack(out)
        cfg = stack.config
        task = load_callable(cfg.data.task, "data.task")(cfg.data)
        sections = {ps.plugin: ps.section for ps in stack.plugins.plugin_settings()}

        def ctx(spec: Any, engine: Any = None, **extras: Any) -> BuildContext:
            section = sections.get(spec.plugin)
            return BuildContext(config=cfg, settings=cfg[section] if section else None, output_dir=str(out),
                                engine=engine, extras={"task": task, **extras})

        engine = stack.engine.factory(ctx(stack.engine))
        tools = [t.factory(ctx(t, engine)) for t in stack.tools]  # environment.tools, as a run builds them
        return {"stack": stack, "engine": engine, "task": task, "out": out,
                "environment": stack.environment.factory(ctx(stack.environment, engine, tools=tools)), "ctx": ctx}

    def _prompts(self, built: dict[str, Any], count: int, seed: int = 0) -> tuple[list[Prompt], list[Any]]:
        tok = built["engine"].tokenizer
        task_prompts = built["task"].make_prompts(random.Random(seed), count)
        return [Prompt(ids=tok(tp.text, add_special_tokens=False)["input_ids"], index=i, meta=tp.meta)
                for i, tp in enumerate(task_prompts)], task_prompts

    def test_spec_is_typed_and_its_factory_builds_an_environment(self, built):
        spec = built["stack"].environment
        assert isinstance(spec, EnvironmentSpec), f"environment.name selected {type(spec).__name__}"
        assert spec.distribution, "the plugin manager fills in the distribution of a registered environment"
        assert implements(built["environment"], Environment), "reset, step and final_reward are all needed"

    def test_step_answers_anything_the_model_writes(self, built):
        env, tok = built["environment"], built["engine"].tokenizer
        vocab = len(tok)
        rng = random.Random(1)
        prompts, task_prompts = self._prompts(built, 8)
        for k in range(self.fuzz_turns):
            p = prompts[k % len(prompts)]
            state = env.reset(p, task_prompts[p.index])
            kind = k % 4
            ids = ([] if kind == 0 else [tok.eos_token_id] if kind == 1 else list(p.ids) if kind == 2
                   else [rng.randrange(vocab) for _ in range(rng.randint(1, 12))])
            for index in range(3):  # a few turns of the same conversation
                turn = Turn(ids=ids, finish_reason="length", index=index, context_ids=[*p.ids, *ids],
                            tool_calls_left=2 - index)
                step = env.step(state, turn)
                assert isinstance(step, EnvStep), f"step returned {type(step).__name__} for turn ids {ids}"
                assert math.isfinite(float(step.reward)), f"reward {step.reward} for turn ids {ids}"
                obs = list(step.observation_ids)
                assert all(isinstance(x, int) and 0 <= x < vocab for x in obs), (
                    f"observation ids {obs[:20]} are not token ids of the tokenizer (vocabulary {vocab})")
                if step.done:
                    break
            final = env.final_reward(state)
            assert final is None or math.isfinite(float(final)), final

    def test_conversations_keep_the_engines_ids_and_end_within_the_limits(self, built):
        from rlcore.environments.conversation import Limits, run_conversations

        stack, engine = built["stack"], built["engine"]
        cfg = stack.config
        backend = stack.rollout_backend.factory(built["ctx"](stack.rollout_backend, engine))
        engine.save_hf(built["out"].parent / "policy_hf")
        backend.start(str(built["out"].parent / "policy_hf"))
        recording = _Recording(backend)
        prompts, task_prompts = self._prompts(built, 4, seed=2)
        params = SamplingSettings(n=2, temperature=1.0, max_new_tokens=int(cfg.rollout.max_new_tokens), seed=3,
                                  stop_token_ids=(engine.tokenizer.eos_token_id,))
        limits = Limits.from_config(cfg.environment)
        samples = run_conversations(built["environment"], recording, prompts, task_prompts, params, limits)
        backend.shutdown()
        assert len(samples) == 2 * len(prompts)
        for s in samples:
            mask = s.response_mask if s.response_mask is not None else torch.ones(len(s.response_ids), dtype=torch.bool)
            assert mask.shape == s.response_ids.shape == s.logprobs.shape
            assert 1 <= s.extras["turns"] <= int(cfg.environment.max_turns)
            assert s.extras["end_reason"], "every conversation ends with a reason"
            trained = s.response_ids[mask].tolist()
            generated = recording.turns[tuple([*s.prompt_ids, *s.response_ids.tolist()])]
            assert trained == [t for turn in generated for t in turn], (
                "the trained tokens must be exactly the tokens the engine generated, turn after turn")

    def test_a_short_run_trains_with_it(self, built, tmp_path):
        from rlcore.stack import load_stack
        from rlcore.trainer import Trainer

        out = tmp_path / "run"
        stack = load_stack(self.config_path, [*self.overrides, f"training.steps={self.steps}", f"output.dir={out}",
                                              "data.prompts_per_step=4", "rollout.n=4", "output.plot=false"])
        summary = Trainer(stack).run()
        assert summary.get("completed") is True, summary
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        assert len(rows) == self.steps and all(math.isfinite(r["loss"]) for r in rows)
        if stack.environment.multi_turn:
            assert all("env/turns_mean" in r for r in rows), "a multi-turn run reports its conversations"


class _Recording:
    """The backend, recording what it generated: ``turns[whole sequence]`` is the list of ids each
    turn of that conversation generated (an earlier turn found as the longest recorded prefix)."""

    def __init__(self, backend: Any):
        self.backend = backend
        self.turns: dict[tuple[int, ...], list[list[int]]] = {}

    def generate(self, prompts: Any, params: Any) -> list[Any]:
        got = self.backend.generate(prompts, params)
        for s in got:
            prompt = tuple(s.prompt_ids)
            before = max((k for k in self.turns if prompt[: len(k)] == k), key=len, default=None)
            self.turns[(*prompt, *s.response_ids.tolist())] = [*self.turns.get(before, []), s.response_ids.tolist()]
        return got
