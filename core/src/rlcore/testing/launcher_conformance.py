"""Conformance suite for the ``launcher`` hook: a plugin's tests subclass it once per launcher.

.. code-block:: python

    from rlcore.testing.launcher_conformance import LauncherConformance

    class TestMyLauncher(LauncherConformance):
        # config overrides that select the launcher on the embedded tiny example
        overrides = ["plugins=[my_plugin]", "cluster.backend=my-launcher", "cluster.trainer.dp=2"]

Every check runs the launcher on core's default config (the tiny GRPO run on a local model, two steps):
the spec is typed and its factory cheap to call, ``describe`` is one line, ``check`` accepts the
stack it was selected for, ``train`` runs to completion and leaves the run directory core
promises (metrics per step, the trained model, the config, the run marker), refuses to write
over that run, and continues it with ``resume=True``. Set ``config_path`` to train another
config, ``steps`` for another length.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlcore.errors import RunOutputError
from rlcore.types import LauncherSpec

__all__ = ["LauncherConformance"]


class LauncherConformance:
    overrides: list[str] = []
    config_path: str | None = None
    steps: int = 2

    def _stack(self, out: Path, steps: int | None = None) -> Any:
        from rlcore.stack import load_stack

        n = int(steps or self.steps)
        return load_stack(self.config_path,
                          [*self.overrides, f"training.steps={n}", f"output.dir={out}", "output.checkpoint_every=1",
                           "data.prompts_per_step=4", "rollout.n=4", "output.plot=false"])

    @pytest.fixture
    def run_dir(self, tmp_path: Path) -> Path:
        return tmp_path / "run"

    @pytest.fixture
    def stack(self, run_dir: Path) -> Any:
        return self._stack(run_dir)

    def test_spec_is_typed_and_its_factory_builds_a_launcher(self, stack):
        spec = stack.launcher
        assert isinstance(spec, LauncherSpec), f"cluster.backend selected {type(spec).__name__}, not a LauncherSpec"
        assert spec.distribution, "the plugin manager fills in the distribution of a registered launcher"
        launcher = spec.factory(stack.config)
        for method in ("check", "describe", "train"):
            assert callable(getattr(launcher, method, None)), f"launcher {spec.name!r} has no {method}()"

    def test_describe_is_one_line(self, stack):
        line = stack.launcher.factory(stack.config).describe(stack)
        assert isinstance(line, str) and line.strip() and "\n" not in line.strip()

    def test_check_accepts_the_stack_it_was_selected_for(self, stack):
        stack.launcher.factory(stack.config).check(stack)  # resolution ran it already; it is repeatable

    def test_trains_writes_the_run_refuses_to_overwrite_it_and_resumes_it(self, stack, run_dir):
        launcher = stack.launcher.factory(stack.config)
        summary = launcher.train(stack)
        assert summary.get("completed") is True, summary
        assert summary.get("steps") == self.steps, summary
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        assert [r["step"] for r in rows] == list(range(self.steps)), "one metrics row per step, from the writer only"
        assert (run_dir / "model" / "config.json").is_file(), "the trained model is written (RUN/model)"
        assert (run_dir / "config.yaml").is_file() and (run_dir / "run.json").is_file()

        again = self._stack(run_dir)
        with pytest.raises(RunOutputError):
            again.launcher.factory(again.config).train(again)  # neither --overwrite nor --resume

        longer = self._stack(run_dir, steps=self.steps + 1)
        resumed = longer.launcher.factory(longer.config).train(longer, resume=True)
        assert resumed.get("completed") is True and resumed.get("steps") == self.steps + 1, resumed
