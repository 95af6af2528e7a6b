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
    """Each spec says its kind by its decorator (``@provider(Descriptor)``, ``@chain``,
    ``@declaration``); the hook lists are read from them."""
    unclassified = sorted(set(HOOKS) - set(PROVIDER_HOOKS + CHAIN_HOOKS + DECLARATION_HOOKS))
    assert not unclassified, f"hook specs without @provider/@chain/@declaration: {unclassified}"


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_documented_under_its_kind(hook):
    """docs/hooks.md documents each hook under the heading of its kind and names the kind in the
    lifecycle table, as the spec's decorator says."""
    kind = getattr(RLCoreSpecs, hook).rlcore_kind
    docs = (ROOT / "docs" / "hooks.md").read_text()
    heading = {"provider": "## Providers", "chain": "## Chains", "declaration": "## Declarations"}[kind]
    part = docs.split(f"\n{heading}\n", 1)[-1].split("\n## ", 1)[0]
    assert f"### `{hook}`" in part, f"docs/hooks.md documents {hook!r} outside '{heading}' (it is a {kind} hook)"
    rows = [r for r in docs.split("## Lifecycle", 1)[1].split("\n## ", 1)[0].splitlines()
            if r.startswith("|") and f"`{hook}`" in r.split("|")[1]]
    assert rows and rows[0].split("|")[2].strip().startswith(kind), (
        f"docs/hooks.md's lifecycle table does not give {hook!r} its kind {kind!r}")


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


EXCERPT = re.compile(r"<!-- excerpt: (?P<path>\S+) -->\n```python\n(?P<code>.*?)```", re.S)


def test_docs_code_blocks_marked_as_an_excerpt_are_in_that_file_verbatim():
    found = 0
    for doc in sorted((ROOT / "docs").glob("*.md")):
        for m in EXCERPT.finditer(doc.read_text()):
            path = ROOT / m["path"]
            assert path.is_file(), f"docs/{doc.name} shows an excerpt of {m['path']}, which does not exist"
            assert m["code"] in path.read_text(), (
                f"docs/{doc.name}: the excerpt after <!-- excerpt: {m['path']} --> is not in that file verbatim")
            found += 1
    assert found


def _section(text: str, heading: str) -> str:
    return text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]


def test_writing_plugins_shows_a_working_environment_plugin(capsys, monkeypatch):
    """The environment section shows the example's `guess` environment, its registration and its
    conformance test, all verbatim (the test runs with the example plugin's tests), and its
    command selects a stack `rlcore check` accepts."""
    import shlex

    from rlcore.testing.runs import main

    part = _section((ROOT / "docs" / "writing-plugins.md").read_text(), "### An environment: multi-turn conversations")
    shown = {m["path"] for m in FILE_SNIPPET.finditer(part)} | {m["path"] for m in EXCERPT.finditer(part)}
    assert shown == {"examples/third_party_plugin/src/rlcore_example/guess.py",
                     "examples/third_party_plugin/src/rlcore_example/plugin.py",
                     "examples/third_party_plugin/tests/test_guess_environment.py"}
    for method in ("reset(prompt, task_prompt)", "step(state, turn)", "final_reward(state)"):
        assert f"`{method}`" in part
    command = part.split("<!-- environment-command -->\n```bash\n", 1)[1].split("\n", 1)[0]
    argv = shlex.split(command)
    assert argv[:2] == ["rlcore", "train"]
    args = argv[2:argv.index("--output")]
    monkeypatch.delenv("RLCORE_PLUGINS", raising=False)
    monkeypatch.chdir(ROOT)
    assert main(["check", *args, "--json"]) == 0
    import json

    assert json.loads(capsys.readouterr().out)["environment"]["name"] == "guess"


def test_the_pyproject_of_writing_plugins_builds_as_the_example_plugin_does():
    """The pyproject.toml shown in section 2 has the example plugin's [build-system] (pip needs
    one to build it the modern way) and its package layout."""
    import tomllib

    text = (ROOT / "docs" / "writing-plugins.md").read_text()
    block = _section(text, "## 2. The distribution").split("```toml\n", 1)[1].split("```", 1)[0]
    shown = tomllib.loads(block)
    example = tomllib.loads((ROOT / "examples" / "third_party_plugin" / "pyproject.toml").read_text())
    assert shown.get("build-system") == example["build-system"]
    assert shown.get("tool", {}).get("setuptools") == example["tool"]["setuptools"]
    assert shown["project"]["dependencies"] == example["project"]["dependencies"]


def test_every_documented_public_module_exists():
    import importlib

    text = (ROOT / "docs" / "writing-plugins.md").read_text()
    table = text.split("You need only rlcore's public contracts:", 1)[1].split("\n\n", 2)[1]
    rows = re.findall(r"^\| `([a-z_.]+)` \| (.*) \|$", table, re.M)
    modules = [name for name, _ in rows]
    assert {"rlcore.errors", "rlcore.types", "rlcore.algorithms"} <= set(modules)
    for name, what in rows:
        module = importlib.import_module(name)
        # every name the row says to take from the module is there (`Name(args)` and `Name.attr` count
        # as Name; a hook's name, as in "a `platform` provider", is not a name of the module)
        for shown in re.findall(r"`([A-Za-z_]\w*)(?:\(.*?\)[^`\s]*|\.[\w.]+)?`", what):
            assert shown in HOOKS or hasattr(module, shown), f"docs/writing-plugins.md: {name} has no {shown!r}"


def test_every_provider_descriptor_is_in_rlcore_types():
    """hooks.md: "A provider hook returns descriptors (`rlcore.types.*Spec`)"."""
    import rlcore.types
    from rlcore.hookspecs import DESCRIPTORS

    for hook, spec_type in DESCRIPTORS.items():
        assert getattr(rlcore.types, spec_type.__name__, None) is spec_type, (
            f"{spec_type.__name__} (hook {hook!r}) is not importable from rlcore.types")


def test_algorithm_inputs_are_documented_field_by_field():
    """Every field of what an estimator and a loss receive is in docs/hooks.md, under `algorithm`."""
    import dataclasses

    from rlcore.types import AdvantageInput, TokenInputs

    docs = (ROOT / "docs" / "hooks.md").read_text()
    section = docs.split("### `algorithm`", 1)[1].split("\n### ", 1)[0]
    for cls in (AdvantageInput, TokenInputs):
        assert f"`{cls.__name__}`" in section
        for f in dataclasses.fields(cls):
            assert f"`{f.name}`" in section, f"docs/hooks.md (algorithm) does not describe {cls.__name__}.{f.name}"
    assert "masked" in section and "value" in section and "grad" in section


def test_every_chain_hook_has_a_documented_typed_manager_call():
    """Chain hooks are called through the typed manager (`pm.step_end(ctx)`), never `pm.hook.*`."""
    from rlcore.hookspecs import CHAIN_HOOKS
    from rlcore.manager import PluginManager

    docs = (ROOT / "docs" / "hooks.md").read_text() + (ROOT / "docs" / "writing-plugins.md").read_text()
    for hook in CHAIN_HOOKS:
        params = [p for p in inspect.signature(getattr(RLCoreSpecs, hook)).parameters if p != "self"]
        assert callable(getattr(PluginManager, hook, None)), f"PluginManager has no typed method {hook!r}"
        assert f"pm.{hook}({', '.join(params)})" in docs, f"the docs do not show pm.{hook}({', '.join(params)})"


def test_public_builtin_losses_and_estimators_are_documented_with_their_defaults():
    """docs/algorithms.md gives each public built-in's constructor with its defaults: built from
    the doc's own text, it equals the one built with the code's defaults."""
    import rlcore.algorithms

    text = (ROOT / "docs" / "algorithms.md").read_text()
    table = text.split("### Reusing a built-in loss or estimator", 1)[1].split("```", 1)[0]
    rows = dict(re.findall(r"^\| `(\w+)` \| `(\w+\([^`]*\))` \|", table, re.M))
    # the built-in loss and estimator classes (TokenObjective wraps a loss: documented in losses.py)
    public = {n for n in rlcore.algorithms._IMPLEMENTATIONS
              if isinstance(getattr(rlcore.algorithms, n), type) and n != "TokenObjective"}
    assert public <= set(rows), f"docs/algorithms.md does not list {sorted(public - set(rows))}"
    for name, call in rows.items():
        cls = getattr(rlcore.algorithms, name)
        assert call.startswith(f"{name}(")
        assert eval(call, {name: cls}) == cls(), f"docs/algorithms.md shows {call}, the defaults differ"


def test_every_extra_of_rlcore_is_documented():
    import tomllib

    extras = tomllib.loads((ROOT / "core" / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    docs = (ROOT / "README.md").read_text() + "".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    for extra in extras:
        assert f"rlcore[{extra}]" in docs, f"the extra rlcore[{extra}] is documented nowhere"


def test_the_readme_install_lines_bring_tensorboard():
    """output.tensorboard is on by default: a README line that installs core without the
    tensorboard extra makes every run print a note that it writes no event files."""
    text = (ROOT / "README.md").read_text()
    lines = [ln.split("#", 1)[0] for ln in text.splitlines() if ln.startswith("pip install")]
    installs_core = [ln for ln in lines if re.search(r"(?<![\w-])['\"]?rlcore(?:\[|['\"]?(?:\s|$))", ln)]
    assert installs_core, "the README shows no line that installs rlcore"
    for ln in installs_core:
        assert re.search(r"rlcore\[[\w,-]*tensorboard", ln), f"README: {ln.strip()!r} installs rlcore without its tensorboard extra"


def test_writing_plugins_says_how_rlcore_is_installed_today():
    text = (ROOT / "docs" / "writing-plugins.md").read_text()
    assert "not on an index" not in text
    assert "bin/wheels" in text and "pip install --find-links" in text


@pytest.mark.slow
def test_core_metrics_table_lists_exactly_what_a_run_writes(tmp_path, monkeypatch):
    """docs/writing-plugins.md names every metric core writes per step, and only those."""
    import json

    from rlcore.testing.runs import main

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


def test_every_registered_pytest_marker_is_selected_by_bin_test():
    """A marker no runner selects or deselects is a stale label: each registered marker is named
    in a ``-m`` expression of bin/test (``engine``: always deselected in the core suite, ``slow``:
    left out by ``bin/test --quick``), and the README says how to run without the slow ones."""
    import tomllib

    registered = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    runner = (ROOT / "bin" / "test").read_text()
    selected = set(re.findall(r"\bnot (\w+)", runner))  # the names in bin/test's marker expressions
    for line in registered:
        name = re.match(r"\w+", line).group(0)
        assert name in selected, f"the pytest marker {name!r} is registered but bin/test never selects or deselects it"
    assert "bin/test --quick" in (ROOT / "README.md").read_text()


def _modules(src: Path, package: str) -> list[str]:
    """Every module and package under ``src/package``, dotted (a package by its ``__init__``)."""
    names = []
    for path in sorted((src / package).rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_architecture_lists_every_core_module():
    """docs/architecture.md names every package and module of core (`rlcore.x`), with a line on
    what it is for; a module added without its line fails here."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    missing = [name for name in _modules(ROOT / "core" / "src", "rlcore") if f"`{name}`" not in text]
    assert not missing, f"docs/architecture.md does not list these core modules: {', '.join(missing)}"


def test_architecture_lists_every_plugin_module():
    """The same for every first-party plugin's package (plugins/*/src) and the example plugin."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    sources = [*sorted((ROOT / "plugins").glob("*/src")), ROOT / "examples" / "third_party_plugin" / "src"]
    missing = [name for src in sources for pkg in sorted(p.name for p in src.glob("rlcore_*") if p.is_dir()
                                                         and not p.name.endswith(".egg-info"))
               for name in _modules(src, pkg) if f"`{name}`" not in text]
    assert not missing, f"docs/architecture.md does not list these plugin modules: {', '.join(missing)}"


def test_the_role_table_in_hooks_md_is_the_one_in_hookspecs():
    """docs/hooks.md's role table has one row per provider hook, as ROLES (read from the
    ``@provider`` decorators) has it: the key or core's rule, the descriptor, one or many."""
    from rlcore.hookspecs import ROLES

    text = (ROOT / "docs" / "hooks.md").read_text()
    table = text.split("### The role table", 1)[1].split("\n### ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    documented = {}
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        documented[cells[0].strip("`")] = (cells[1].strip("`"), cells[2].strip("`"), cells[3])
    assert documented == {hook: (role.selected_by, role.descriptor.__name__, role.selects)
                          for hook, role in ROLES.items()}
