"""The ``launcher`` provider hook: ``cluster.backend`` selects where the ranks run; stack resolution
runs the selected launcher's check, ``rlcore check`` prints its line and ``rlcore train`` calls its
``train``. The built-in ``local`` launcher refuses what needs several processes, naming the key and
the plugin that provides them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rlcore import errors
from rlcore.stack import load_stack, resolve
from rlcore.types import Launcher, LauncherSpec

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml"
FAST = ["training.steps=1", "rollout.n=2", "data.prompts_per_step=2", "output.progress=false",
        "output.tensorboard=false", "output.plot=false"]

#: a third-party launcher as a distribution would ship it: runs the trainer in this process and
#: leaves a record of what core called, so the test sees the calls a real launcher gets
INLINE = '''
import json
from pathlib import Path

from rlcore import PLUGIN_API, hookimpl
from rlcore.errors import ConfigError
from rlcore.types import LauncherSpec


class InlineLauncher:
    def __init__(self, config):
        self.config = config

    def check(self, stack):
        if stack.config.cluster.trainer.dp > 2:
            raise ConfigError("cluster.trainer.dp: the inline launcher runs at most 2", key="cluster.trainer.dp")

    def describe(self, stack):
        return f"inline: dp={stack.config.cluster.trainer.dp} in this process"

    def train(self, stack, *, resume=False, overwrite=False, allow_config_change=False, console=None):
        from rlcore.trainer import Trainer

        summary = Trainer(stack, resume=resume, overwrite=overwrite).run()
        Path(summary["output"], "launched_by.json").write_text(json.dumps({"launcher": "inline", "resume": resume}))
        return summary


@hookimpl
def launcher():
    yield LauncherSpec(name="inline", factory=InlineLauncher, remote_ranks=lambda config: False,
                       description="a test's launcher")
'''


def test_hook_launcher(rlcore_plugin_manager, register_plugin, rlcore_config):
    import types

    from rlcore import hookimpl

    seen = []

    class Recording:
        def check(self, stack):
            seen.append(("check", stack.launcher.name, stack.engine.name))
            if stack.config.cluster.trainer.dp > 4:
                raise errors.ConfigError("cluster.trainer.dp: at most 4 here", key="cluster.trainer.dp")

        def describe(self, stack):
            return "recording"

        def train(self, stack, **flags):
            return {"completed": True}

    mod = types.ModuleType("acme_launch")
    mod.PLUGIN_API = 1
    mod.launcher = hookimpl(lambda: [LauncherSpec(name="acme", factory=lambda config: Recording(),
                                                  remote_ranks=lambda config: True)])
    mod.launcher.__name__ = "launcher"
    register_plugin(mod, "acme_launch", distribution="acme-launch", version="1.0")
    specs = rlcore_plugin_manager.launchers()
    assert set(specs) == {"local", "acme"}
    assert specs["acme"].distribution == "acme-launch 1.0" and specs["acme"].plugin == "acme_launch"
    assert specs["local"].distribution.startswith("rlcore ") and not specs["local"].ranks_are_remote(None)
    assert specs["acme"].ranks_are_remote(None)
    assert isinstance(specs["local"].factory(None), Launcher)

    stack = resolve(rlcore_config("cluster.backend=acme", "cluster.trainer.dp=3"), rlcore_plugin_manager)
    assert stack.launcher.name == "acme" and seen == [("check", "acme", "hf")]
    assert stack.describe()["launcher"]["describe"] == "recording"
    with pytest.raises(errors.ConfigError) as err:  # the launcher's refusal comes out of resolution
        resolve(rlcore_config("cluster.backend=acme", "cluster.trainer.dp=5"), rlcore_plugin_manager)
    assert err.value.key == "cluster.trainer.dp"
    with pytest.raises(errors.UnknownProviderError, match="cluster.backend: 'slurm' is not a known launcher") as err:
        resolve(rlcore_config("cluster.backend=slurm"), rlcore_plugin_manager)
    assert err.value.key == "cluster.backend"


def test_the_default_launcher_is_local():
    stack = load_stack(str(EXAMPLE))
    assert stack.launcher.name == "local" and stack.launcher.plugin == "launch_local"
    assert "this process" in stack.describe()["launcher"]["describe"]


@pytest.mark.parametrize("override,key", [
    ("cluster.trainer.dp=2", "cluster.trainer.dp"),
    ("cluster.trainer.tp=2", "cluster.trainer.tp"),
    ("cluster.trainer.ep=2", "cluster.trainer.ep"),
    ("cluster.trainer.pp=2", "cluster.trainer.pp"),
    ("cluster.rollout.replicas=2", "cluster.rollout.replicas"),
])
def test_local_refuses_several_processes_naming_the_key_and_the_ray_plugin(override, key):
    with pytest.raises(errors.ConfigError) as err:
        load_stack(str(EXAMPLE), [override])
    assert err.value.key == key and key in str(err.value)
    assert "pip install rlcore-ray" in str(err.value) and "cluster.backend: ray" in str(err.value)


def test_check_prints_the_launchers_line_and_train_calls_it(fake_distribution, tmp_path, capsys, monkeypatch):
    from rlcore.cli import main

    monkeypatch.delenv("RLCORE_PLUGINS", raising=False)
    fake_distribution("acme-inline", "0.2", {"inline": "acme_inline"}, {"acme_inline": INLINE})
    run = ["plugins=[inline]", "cluster.backend=inline", *FAST]
    assert main(["check", str(EXAMPLE), *run]) == 0
    out = capsys.readouterr().out
    assert "launcher" in out and "inline" in out and "acme-inline 0.2" in out and "inline: dp=1 in this process" in out

    assert main(["check", str(EXAMPLE), *run, "cluster.trainer.dp=3"]) == 2
    assert "cluster.trainer.dp: the inline launcher runs at most 2" in capsys.readouterr().err

    assert main(["train", str(EXAMPLE), *run, "--output", str(tmp_path / "r")]) == 0
    assert json.loads((tmp_path / "r" / "launched_by.json").read_text()) == {"launcher": "inline", "resume": False}
