"""The ``python`` tool (issue 29, moved out of core in issue 40): registered through core's ``tool``
hook, selected by ``environment.tools`` with ``plugins: [sandbox]``, its limits in ``sandbox:``; its
child process is killed at its CPU-time and wall-clock limits, cannot fork, cannot write outside its
scratch directory and has no network (every layer of :data:`rlcore_sandbox.sandbox.LAYERS` verified
from inside, each call). test_sandbox_hostile.py tries what a hostile program would."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from rlcore.environments.tools import CALC, ToolRegistry
from rlcore.errors import ConfigError
from rlcore.manager import PluginManager
from rlcore.stack import load_config, resolve
from rlcore.testing.environment_conformance import EnvironmentConformance, model_turn, tool_environment
from rlcore.types import BuildContext, ToolSpec
from rlcore_sandbox.sandbox import LAYERS, python_tool, run_code

ROOT = Path(__file__).resolve().parents[3]
LIMITS = dict(cpu_seconds=1, memory_mb=128, wall_seconds=4.0, output_bytes=2048, scratch_mb=8)
PYTHON = ["plugins=[sandbox]", "environment.name=tools", "environment.tools=[calc,python]"]


def _config(*overrides):
    pm = PluginManager()
    pm.activate(["sandbox"])
    cfg, _ = load_config(None, [*PYTHON, *overrides], plugins=pm)
    return cfg, pm


def test_the_python_tool_comes_with_the_plugin_and_takes_its_limits_from_its_section():
    cfg, pm = _config("sandbox.cpu_seconds=1", "sandbox.wall_seconds=4")
    tools = resolve(cfg, pm).tools
    assert [(t.name, t.plugin) for t in tools] == [("calc", "environments"), ("python", "sandbox")]
    assert isinstance(tools[1], ToolSpec) and tools[1].distribution.startswith("rlcore-sandbox ")
    tool = tools[1].factory(BuildContext(config=cfg, settings=cfg.sandbox))
    assert tool.name == "python" and tool.fn("print(6 * 7)") == "42\n"
    assert "CPU-time limit of 1s" in tool.fn("while True:\n    pass")


@pytest.mark.parametrize("overrides,key,says", [
    (["sandbox.memory_mb=0"], "sandbox.memory_mb", "it must be > 0"),
    (["sandbox.cpu_seconds=100000000000"], "sandbox.cpu_seconds", "does not limit"),
    (["sandbox.wall_seconds=1e12", "environment.tool_timeout_seconds=1e12"], "sandbox.wall_seconds", "does not limit"),
    (["sandbox.memory_mb=1000000000000"], "sandbox.memory_mb", "more than this machine's"),
    (["environment.tool_timeout_seconds=1"], "environment.tool_timeout_seconds", "below sandbox.wall_seconds=5"),
])
def test_limits_that_cannot_hold_are_refused_naming_the_key(overrides, key, says):
    with pytest.raises(ConfigError) as err:
        _config(*overrides)
    assert err.value.key == key and says in str(err.value), str(err.value)


def test_the_tools_environment_runs_python_when_configured():
    tok, env = tool_environment(ToolRegistry([CALC, python_tool(SimpleNamespace(**LIMITS))]),
                                ["calc", "result", "error", "7", "*", "8", "56", "python", "print(7*8)"])
    step = env.step(env.reset(None, None), model_turn(tok, "python print(7*8)"))
    assert step.tool_calls[0].ok and tok.decode(step.observation_ids) == "result 56"


class TestToolsWithPython(EnvironmentConformance):
    """A run's build hands the plugin's tool to core's ``tools`` environment."""

    config_path = str(ROOT / "examples" / "tiny_tools.yaml")
    overrides = ["plugins=[sandbox]", "environment.tools=[calc,python]", "sandbox.wall_seconds=2"]

    def test_the_environment_holds_the_plugins_tool(self, built):
        assert built["environment"].registry.names() == ["calc", "python"]

def test_code_runs_in_its_scratch_directory():
    r = run_code("import os; open('note.txt', 'w').write('hi'); print(os.getcwd(), open('note.txt').read())", **LIMITS)
    assert r.exit == 0 and r.output.split() == ["/tmp", "hi"], r
    assert r.isolation == ",".join(LAYERS), "every layer is verified from inside, each call"


def test_an_infinite_loop_is_killed_at_its_cpu_limit():
    r = run_code("while True:\n    pass", **LIMITS)
    assert r.exit < 0 and not r.timed_out and r.seconds < LIMITS["wall_seconds"]
    assert "CPU-time limit" in python_tool(SimpleNamespace(**LIMITS)).fn("while True:\n    pass")


def test_a_sleeping_program_is_killed_at_the_wall_clock():
    r = run_code("import time; time.sleep(60)", **{**LIMITS, "wall_seconds": 1.0})
    assert r.timed_out and r.exit < 0 and r.seconds < 5


def test_a_fork_is_refused_and_threads_work():
    code = ("import os, threading\ntry:\n    os.fork()\nexcept OSError as e:\n    print('fork', e.errno)\n"
            "t = threading.Thread(target=print, args=('thread',))\nt.start(); t.join()")
    r = run_code(code, **LIMITS)
    assert r.output.split("\n")[:2] == ["fork 11", "thread"], r


def test_a_huge_output_stops_at_its_limit():
    r = run_code("import sys\nwhile True:\n    sys.stdout.write('y' * 65536)", **LIMITS)
    assert len(r.output) <= LIMITS["output_bytes"] and r.output.startswith("yyyy") and r.exit != 0


def test_the_scratch_directory_is_bounded_and_gone_after_the_call():
    r = run_code("open('big', 'wb').write(b'x' * (64 << 20))", **{**LIMITS, "scratch_mb": 4})
    assert r.exit != 0 and ("No space left" in r.output or "File too large" in r.output), r
    r = run_code("import os; print(os.listdir('.'))", **LIMITS)
    assert r.output.strip() == "[]", "each call starts from an empty scratch directory"


def test_nothing_of_the_machine_is_visible_but_the_read_only_interpreter(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    r = run_code(f"import os, sys\nprint(os.path.exists({str(secret)!r}), os.path.exists('/etc/passwd'), "
                 f"os.listdir(os.path.dirname(sys.prefix)), flush=True)\nopen('/usr/rlcore-probe', 'w')", **LIMITS)
    venv_parent_holds = [os.path.basename(sys.prefix)]
    assert r.output.split("\n")[0] == f"False False {venv_parent_holds}", r
    assert "Read-only file system" in r.output or "Permission denied" in r.output, r


def test_no_network():
    r = run_code("import socket\ns = socket.socket()\ns.settimeout(1)\ns.connect(('127.0.0.1', 9))", **LIMITS)
    assert r.exit != 0 and "PermissionError" in r.output, r
    assert "netns" in r.isolation, "and under the socket refusal, no interface but the namespace's own lo"


def test_the_tool_is_not_built_without_its_sandbox(monkeypatch):
    from rlcore_sandbox import sandbox

    monkeypatch.setattr(sandbox, "bwrap_path", lambda: None)
    with pytest.raises(ConfigError) as err:
        python_tool(SimpleNamespace(**LIMITS))
    assert err.value.key == "environment.tools" and "apt-get install bubblewrap" in str(err.value)
