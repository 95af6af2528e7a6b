"""Tools that cannot hang (issue 29): a tool call that raises, hangs, returns garbage or too much
ends its turn with an observation saying so, never the run; the tools a run calls are the ``tool``
providers ``environment.tools`` names (core's ``calc``; the sandboxed ``python`` tool is
rlcore-sandbox's: plugins/sandbox/tests)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from rlcore.environments.standard import parse_call
from rlcore.environments.tools import CALC, Tool, ToolRegistry, calculate, call_tool
from rlcore.errors import UnknownProviderError
from rlcore.stack import load_config, resolve
from rlcore.testing.environment_conformance import model_turn, tool_environment
from rlcore.types import ToolSpec


def _hang(arg: str) -> str:
    time.sleep(30)
    return "never"


WORDS = ["calc", "hang", "boom", "result", "error", "7", "*", "8", "56", "python", "print(7*8)"]
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
    return tool_environment(registry, WORDS, **{"tools": ["calc"], "tool_timeout_seconds": 0.2, **settings})


def test_the_tools_environment_turns_every_failure_into_an_observation():
    tok, env = _env()
    state = env.reset(None, SimpleNamespace(meta={"expression": "7 * 8"}))
    ok = env.step(state, model_turn(tok, "calc"))  # no argument: the task's expression
    assert not ok.done and tok.decode(ok.observation_ids) == "result 56" and ok.reward == 0.25
    assert [(c.tool, c.ok) for c in ok.tool_calls] == [("calc", True)]
    hung = env.step(state, model_turn(tok, "hang"))
    assert not hung.done and hung.reward == 0 and hung.tool_calls[0].error == "tool 'hang' timed out after 0.2s"
    assert tok.decode(hung.observation_ids).startswith("error")
    raised = env.step(state, model_turn(tok, "boom 7"))
    assert not raised.done and not raised.tool_calls[0].ok and "ZeroDivisionError" in raised.tool_calls[0].error
    answer = env.step(state, model_turn(tok, "56"))
    assert answer.done and answer.reason == "answered" and not answer.tool_calls
    over = env.step(state, model_turn(tok, "calc", tool_calls_left=0))  # not run: the loop ends the conversation
    assert not over.done and not over.tool_calls[0].ok and not over.observation_ids


def test_hermes_calls_and_a_chat_template_renders_the_observation_as_a_tool_message():
    registry = ToolRegistry([CALC])
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


def test_hook_tool(rlcore_plugin_manager):
    """Core's ``calc`` is a ``tool`` provider like any plugin's; ``environment.tools`` selects the
    run's tools in order, for an environment whose spec ``uses_tools``, and the one named twice or
    misspelt is refused naming the key."""
    pm = rlcore_plugin_manager
    spec = pm.tools()["calc"]
    assert isinstance(spec, ToolSpec) and spec.distribution.startswith("rlcore ") and spec.factory(None) is CALC
    assert pm.environments()["tools"].uses_tools and not pm.environments()["single_turn"].uses_tools
    cfg, _ = load_config(None, ["environment.name=tools"], plugins=pm)
    assert [t.name for t in resolve(cfg, pm).tools] == ["calc"]
    cfg, _ = load_config(None, ["environment.name=single_turn", "environment.tools=[nope]"], plugins=pm)
    assert resolve(cfg, pm).tools == [], "an environment without tools selects none"
    for tools, says in (("[calk]", "Did you mean 'calc'"), ("[calc,calc]", "listed more than once")):
        cfg, _ = load_config(None, ["environment.name=tools", f"environment.tools={tools}"], plugins=pm)
        with pytest.raises(Exception, match=says) as err:
            resolve(cfg, pm)
        assert err.value.key == "environment.tools"


@pytest.mark.parametrize("installed,says", [
    (True, "installed but not active: add sandbox to the config's plugins: list"),
    (False, "not installed. Install it with: pip install rlcore-sandbox, and add sandbox to the config's plugins: list"),
])
def test_the_python_tool_without_its_plugin_names_the_plugin_and_its_install_line(installed, says):
    from rlcore.manager import PluginManager

    pm = PluginManager()
    if not installed:
        pm._installed = {n: eps for n, eps in pm.installed().items() if n != "sandbox"}
    pm.activate([])
    cfg, _ = load_config(None, ["environment.name=tools", "environment.tools=[calc,python]"], plugins=pm)
    with pytest.raises(UnknownProviderError) as err:
        resolve(cfg, pm)
    assert err.value.key == "environment.tools" and "tool 'python' comes with the plugin 'sandbox'" in str(err.value)
    assert says in str(err.value), str(err.value)
