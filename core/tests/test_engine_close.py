"""An engine's optional ``close()`` (process-wide state it initialised, e.g. megatron's groups) is
called once when the run ends, success or error, and also when the run fails to build after the
engine exists (before, a failed build left it to interpreter shutdown)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from rlcore.errors import PluginHookError
from rlcore.stack import load_stack
from rlcore.trainer import Trainer

TINY = str(Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml")
QUICK = ["training.steps=1", "rollout.n=2", "data.prompts_per_step=2", "output.checkpoint_every=0",
         "output.plot=false", "output.tensorboard=false", "output.progress=false"]


def _stack_with_closing_engine(tmp_path, closed: list[str]):
    stack = load_stack(TINY, [f"output.dir={tmp_path / 'run'}", *QUICK])
    build_engine = stack.engine.factory

    def engine_that_records_close(ctx):
        engine = build_engine(ctx)
        engine.close = lambda: closed.append("closed")
        return engine

    stack.engine = replace(stack.engine, factory=engine_that_records_close)
    return stack


def test_a_finished_run_closes_its_engine_once(tmp_path):
    closed: list[str] = []
    trainer = Trainer(_stack_with_closing_engine(tmp_path, closed))
    assert closed == []
    trainer.run()
    assert closed == ["closed"]


def test_a_build_that_fails_after_the_engine_exists_closes_it(tmp_path):
    closed: list[str] = []
    stack = _stack_with_closing_engine(tmp_path, closed)

    def failing_backend(ctx):
        raise RuntimeError("the rollout backend could not be built")

    stack.rollout_backend = replace(stack.rollout_backend, factory=failing_backend)
    with pytest.raises(PluginHookError, match="the factory of rollout_backend 'local' raised RuntimeError: the rollout "
                                              "backend could not be built"):
        Trainer(stack)
    assert closed == ["closed"]
    assert not (tmp_path / "run").exists()  # and the directory it took is given back, as before
