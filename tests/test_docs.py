"""Docs discipline (datasette-style): every hook spec is documented in docs/hooks.md with its
exact signature, and has a test named test_hook_<name>."""

import inspect
import re
from pathlib import Path

import pytest

from rlcore.hookspecs import CHAIN_HOOKS, DECLARATION_HOOKS, PROVIDER_HOOKS, RLCoreSpecs

ROOT = Path(__file__).resolve().parents[1]
HOOKS = [name for name, _ in inspect.getmembers(RLCoreSpecs, inspect.isfunction)]


def test_every_spec_is_classified():
    assert sorted(HOOKS) == sorted(PROVIDER_HOOKS + CHAIN_HOOKS + DECLARATION_HOOKS)


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_documented_with_its_signature(hook):
    docs = (ROOT / "docs" / "hooks.md").read_text()
    params = [p for p in inspect.signature(getattr(RLCoreSpecs, hook)).parameters if p != "self"]
    assert f"### `{hook}`" in docs, f"docs/hooks.md has no section for hook {hook!r}"
    assert f"{hook}({', '.join(params)})" in docs, f"docs/hooks.md does not show the signature of {hook!r}"


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_spec_docstring_is_complete(hook):
    doc = inspect.getdoc(getattr(RLCoreSpecs, hook)) or ""
    for part in ("**Kind:**", "**Called:**", "**Example:**", ":return:"):
        assert part in doc, f"the docstring of hook {hook!r} lacks {part}"


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_has_a_test(hook):
    pattern = re.compile(rf"def test_hook_{hook}\b")
    files = [p for d in ("core/tests", "tests") for p in (ROOT / d).rglob("test_*.py")]
    assert any(pattern.search(p.read_text()) for p in files), f"no test named test_hook_{hook}"


def test_readme_opens_with_the_two_commands():
    first = (ROOT / "README.md").read_text().split("```")[1].strip().splitlines()
    assert first[0] == "bash"
    assert first[1].startswith("bin/rlcore train examples/tiny.yaml")
    assert first[2].startswith("bin/test")


# ---- code shown in the docs is code that runs ------------------------------------------------

FILE_SNIPPET = re.compile(r"<!-- file: (?P<path>\S+) -->\n```python\n(?P<code>.*?)```", re.S)


def test_docs_code_blocks_marked_with_a_file_show_that_file_verbatim():
    shown = []
    for doc in sorted((ROOT / "docs").glob("*.md")):
        for m in FILE_SNIPPET.finditer(doc.read_text()):
            path = ROOT / m["path"]
            assert path.is_file(), f"docs/{doc.name} shows {m['path']}, which does not exist"
            assert m["code"] == path.read_text(), (
                f"docs/{doc.name}: the code block after <!-- file: {m['path']} --> differs from that file; "
                f"copy the file into the block"
            )
            shown.append(m["path"])
    # the chain-hook unit test of writing-plugins.md is a real test that runs with the suite
    assert "examples/third_party_plugin/tests/test_postprocess_unit.py" in shown


def test_every_documented_public_module_exists():
    import importlib

    text = (ROOT / "docs" / "writing-plugins.md").read_text()
    table = text.split("You need only rlcore's public contracts:", 1)[1].split("\n\n", 2)[1]
    modules = re.findall(r"^\| `([a-z_.]+)` \|", table, re.M)
    assert "rlcore.errors" in modules and "rlcore.types" in modules
    for name in modules:
        importlib.import_module(name)


@pytest.mark.slow
def test_core_metrics_table_lists_exactly_what_a_run_writes(tmp_path, monkeypatch):
    """docs/writing-plugins.md names every metric core writes per step, and only those."""
    import json

    from rlcore.cli import main

    monkeypatch.delenv("RLCORE_PLUGINS", raising=False)
    out = tmp_path / "run"
    # one step with the example plugin active, so plugin metrics and loss terms are there to tell apart
    assert main(["train", str(ROOT / "examples" / "tiny.yaml"), "--output", str(out), "training.steps=1",
                 "rollout.n=4", "data.prompts_per_step=4", "output.plot=false", "output.tensorboard=false",
                 "output.checkpoint_every=0", "plugins=[example]", "example.length_penalty=0.1"]) == 0
    written = set(json.loads((out / "metrics.jsonl").read_text().splitlines()[0]))
    from_plugin = {k for k in written if "example/" in k}
    assert from_plugin >= {"example/response_tokens", "old/example/response_tokens", "loss/example/length_penalty"}
    text = (ROOT / "docs" / "writing-plugins.md").read_text()
    table = text.split("<!-- core-metrics -->", 1)[1].split("<!-- /core-metrics -->", 1)[0]
    documented = {name for row in table.splitlines()[2:] for name in re.findall(r"`([a-z0-9_/]+)`", row.split("|")[1])}
    assert written - from_plugin - documented == set(), "core writes metrics docs/writing-plugins.md does not list"
    assert documented - (written - from_plugin) == set(), "docs/writing-plugins.md lists metrics core does not write"
