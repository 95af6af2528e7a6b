"""Tools that cannot hang or escape (issue 29): a tool call that raises, hangs, returns garbage or
too much ends its turn with an observation saying so, never the run; the ``python`` tool's child
process is killed at its CPU-time and wall-clock limits, cannot fork without bound, cannot write
outside its scratch directory and has no network (where this kernel gives the fences it needs;
:func:`rlcore.environments.sandbox.isolation` says which hold)."""

from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace

import pytest
from rlcore.environments.sandbox import LAYERS, python_tool, run_code
from rlcore.environments.standard import ToolEnvironment, builtin_registry, parse_call
from rlcore.environments.tools import CALC, Tool, ToolRegistry, calculate, call_tool
from rlcore.errors import ConfigError
from rlcore.types import Turn

LIMITS = dict(cpu_seconds=1, memory_mb=128, wall_seconds=4.0, output_bytes=2048, scratch_mb=8)


def _hang(arg: str) -> str:
    time.sleep(30)
    return "never"


REGISTRY = ToolRegistry([CALC, Tool("boom", lambda a: 1 / 0), Tool("hang", _hang), Tool("number", lambda a: 42),
                         Tool("binary", lambda a: "ok\x00\x01"), Tool("flood", lambda a: "x" * 10**6)])


@pytest.mark.parametrize("tool,error", [
    ("boom", "tool 'boom' failed: ZeroDivisionError"),
    ("hang", "tool 'hang' timed out after 0.2s"),
    ("number", "tool 'number' returned int, not text"),
    ("binary", "tool 'binary' returned binary data"),
    ("nope", "unknown tool 'nope'"),
])
def test_a_failing_tool_is_a_result_never_an_exception(tool, error):
    t0 = time.perf_counter()
    r = call_tool(REGISTRY, tool, "", timeout=0.2, max_chars=100)
    assert not r.ok and r.error.startswith(error), r
    assert time.perf_counter() - t0 < 2, "a hanging tool is abandoned at its timeout"


def test_a_tools_output_is_cut_to_its_limit():
    r = call_tool(REGISTRY, "flood", "", timeout=2, max_chars=100)
    assert r.ok and r.truncated and r.output == "x" * 100


def test_calc():
    assert calculate("7 * 8") == "56" and calculate("4 9 + 1") == "50" and calculate("-(3 - 10) // 2") == "3"
    for bad in ("__import__('os')", "2 ** 10", "10 ** 10 * 10 ** 10 * 10 ** 10", "1 // 0", "x", ""):
        with pytest.raises(ValueError):
            calculate(bad)


def _env(registry=REGISTRY, **settings):
    from rlcore.engines.tiny import make_tokenizer

    tok = make_tokenizer(["calc", "hang", "boom", "result", "error", "7", "*", "8", "56", "python", "print(7*8)"])
    s = dict(tools=["calc"], tool_timeout_seconds=0.2, tool_output_chars=64, observation_tokens=16,
             tool_call_reward=0.25, tool_format="words", observation_prefix="result", code=SimpleNamespace(enable=False))
    s.update(settings)
    return tok, ToolEnvironment(tok, SimpleNamespace(**s), registry)


def _turn(tok, text, left=3):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return Turn(ids=ids, finish_reason="stop", index=0, context_ids=ids, tool_calls_left=left)


def test_the_tools_environment_turns_every_failure_into_an_observation():
    tok, env = _env()
    state = env.reset(None, SimpleNamespace(meta={"expression": "7 * 8"}))
    ok = env.step(state, _turn(tok, "calc"))  # no argument: the task's expression
    assert not ok.done and tok.decode(ok.observation_ids) == "result 56" and ok.reward == 0.25
    assert [(c.tool, c.ok) for c in ok.tool_calls] == [("calc", True)]
    hung = env.step(state, _turn(tok, "hang"))
    assert not hung.done and hung.reward == 0 and hung.tool_calls[0].error == "tool 'hang' timed out after 0.2s"
    assert tok.decode(hung.observation_ids).startswith("error")
    raised = env.step(state, _turn(tok, "boom 7"))
    assert not raised.done and not raised.tool_calls[0].ok and "ZeroDivisionError" in raised.tool_calls[0].error
    answer = env.step(state, _turn(tok, "56"))
    assert answer.done and answer.reason == "answered" and not answer.tool_calls
    over = env.step(state, _turn(tok, "calc", left=0))  # not run: the loop ends the conversation
    assert not over.done and not over.tool_calls[0].ok and not over.observation_ids


def test_hermes_calls_and_a_chat_template_renders_the_observation_as_a_tool_message():
    registry = builtin_registry(["calc"])
    assert parse_call('ok <tool_call>{"name": "calc", "arguments": {"expression": "6*7"}}</tool_call>', "hermes",
                      registry) == ("calc", "6*7")
    assert parse_call("<tool_call>{not json}</tool_call>", "hermes", registry)[0] == "<malformed>"
    assert parse_call("just an answer", "hermes", registry) is None
    tok, env = _env(registry, tool_format="hermes")
    tok.add_tokens(["<tool>", "</tool>", "<user>"])
    tok.chat_template = ("{% for m in messages %}<{{ m.role }}> {{ m.content }} </{{ m.role }}> {% endfor %}"
                         "{% if add_generation_prompt %}<assistant> {% endif %}")
    ids = env.observation_ids("result 56")
    assert tok.convert_ids_to_tokens(ids)[:4] == ["<tool>", "result", "56", "</tool>"]


def test_python_is_off_unless_configured():
    with pytest.raises(ConfigError) as err:
        builtin_registry(["python"], SimpleNamespace(enable=False))
    assert err.value.key == "environment.tools"
    assert "python" in builtin_registry(["python"], SimpleNamespace(enable=True, **LIMITS))


def test_the_tools_environment_runs_python_when_configured():
    code = SimpleNamespace(enable=True, **LIMITS)
    tok, env = _env(builtin_registry(["calc", "python"], code), code=code, tool_timeout_seconds=10)
    step = env.step(env.reset(None, None), _turn(tok, "python print(7*8)"))
    assert step.tool_calls[0].ok and tok.decode(step.observation_ids) == "result 56"


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
    from rlcore.environments import sandbox

    monkeypatch.setattr(sandbox, "bwrap_path", lambda: None)
    with pytest.raises(ConfigError) as err:
        python_tool(SimpleNamespace(**LIMITS))
    assert err.value.key == "environment.code.enable" and "apt-get install bubblewrap" in str(err.value)
