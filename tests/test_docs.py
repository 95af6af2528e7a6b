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
