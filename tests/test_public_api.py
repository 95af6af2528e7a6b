"""The public API is held: every source file of every first-party plugin (``plugins/*/src``) and of
the example plugin imports

(a) from rlcore only its public modules (``rlcore.public_api.PUBLIC_MODULES``; those of
    ``FOR_TESTS_ONLY`` only in tests, which this test does not read),
(b) from another plugin only a public module: one its package's ``__init__`` names in ``__all__``,
(c) top-level modules of the standard library, of the plugin itself, or of a distribution its
    pyproject.toml depends on: ``dependencies`` or an optional extra, and what a first-party
    distribution it depends on requires in turn (torch comes with rlcore). An import inside a
    ``try`` that catches ``ImportError`` probes for an optional module and needs no declaration.

docs/writing-plugins.md shows the public module list; the check checks itself on planted imports.
The scan reads import statements (``importlib.import_module`` of a computed name is not seen).
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import tomllib
from rlcore.public_api import FOR_TESTS_ONLY, PUBLIC_MODULES

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core"

#: import name -> distribution of engines this venv does not install (their own suites' venvs do),
#: so that importlib.metadata cannot map them here
NOT_INSTALLED_HERE = {
    "vllm": "vllm",
    "sglang": "sglang",
    "triton": "triton",
    "megatron": "megatron-core",
    "transformer_engine": "transformer-engine",
    "torch_npu": "torch-npu",
    "mindspeed": "mindspeed",
}

_REQUIREMENT = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?")


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement(spec: str) -> tuple[str, tuple[str, ...]]:
    """``'rlcore-megatron[megatron-core]>=0.1'`` -> ``('rlcore-megatron', ('megatron-core',))``."""
    m = _REQUIREMENT.match(spec)
    assert m, f"cannot read the requirement {spec!r}"
    extras = tuple(e.strip() for e in (m.group(2) or "").split(",") if e.strip())
    return normalise(m.group(1)), extras


@dataclass(frozen=True)
class Distribution:
    """A first-party distribution of this checkout, read from its pyproject.toml."""

    root: Path
    name: str  #: normalised
    requires: tuple[str, ...]
    extras: dict[str, tuple[str, ...]]
    packages: tuple[str, ...]  #: top-level import packages under src/

    @classmethod
    def read(cls, root: Path) -> Distribution:
        project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
        src = root / "src"
        packages = tuple(sorted(p.name for p in src.iterdir() if (p / "__init__.py").is_file()))
        return cls(root, normalise(project["name"]), tuple(project.get("dependencies", ())),
                   {k: tuple(v) for k, v in project.get("optional-dependencies", {}).items()}, packages)

    @property
    def pyproject(self) -> str:
        return _rel(self.root / "pyproject.toml")

    def source_files(self) -> list[Path]:
        return sorted(f for pkg in self.packages for f in (self.root / "src" / pkg).rglob("*.py"))

    def module_file(self, module: str) -> Path | None:
        """The file of ``module`` (dotted, inside one of this distribution's packages), if it is one."""
        base = self.root / "src" / Path(*module.split("."))
        for f in (base.with_suffix(".py"), base / "__init__.py"):
            if f.is_file():
                return f
        return None

    def public_modules(self, package: str) -> tuple[str, ...]:
        """What the package's ``__init__`` declares public: the submodules its ``__all__`` names."""
        init = self.root / "src" / package / "__init__.py"
        for node in ast.parse(init.read_text()).body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                return tuple(ast.literal_eval(node.value))
        return ()


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def plugin_roots(root: Path = ROOT) -> list[Path]:
    """Every first-party plugin (plugins/<name>, rlcore-ray included once it exists) and the example."""
    found = [p.parent for p in sorted(root.glob("plugins/*/pyproject.toml")) if (p.parent / "src").is_dir()]
    return [*found, root / "examples" / "third_party_plugin"]


@dataclass(frozen=True)
class Import:
    line: int
    module: str  #: absolute, dotted
    names: tuple[str, ...] | None  #: ``from module import names``; None for ``import module``
    probe: bool  #: inside a ``try`` whose handler catches ImportError


_IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(t, ast.Name) and t.id in _IMPORT_ERRORS for t in types)


def imports_of(source: str) -> Iterator[Import]:
    """Every absolute import statement of a module, at any depth (functions, classes, branches)."""

    def walk(node: ast.AST, probe: bool) -> Iterator[Import]:
        if isinstance(node, ast.Try):
            guarded = probe or any(_catches_import_error(h) for h in node.handlers)
            for child in node.body:
                yield from walk(child, guarded)
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                yield from walk(child, probe)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(node.lineno, alias.name, None, probe)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield Import(node.lineno, node.module, tuple(a.name for a in node.names), probe)
        for child in ast.iter_child_nodes(node):
            yield from walk(child, probe)

    yield from walk(ast.parse(source), False)


class Checkout:
    """The first-party distributions: rlcore and the plugins given."""

    def __init__(self, plugins: list[Path]):
        self.core = Distribution.read(CORE)
        self.plugins = [Distribution.read(p) for p in plugins]
        self.by_name = {d.name: d for d in (self.core, *self.plugins)}
        self.by_package = {pkg: d for d in (self.core, *self.plugins) for pkg in d.packages}

    def allowed(self, plugin: Distribution) -> set[str]:
        """Distributions ``plugin`` may import: what it requires (extras included) and, through every
        first-party one among them, what that one requires (and the extras named)."""
        allowed: set[str] = set()
        todo = [requirement(s) for s in plugin.requires]
        todo += [requirement(s) for specs in plugin.extras.values() for s in specs]
        while todo:
            name, extras = todo.pop()
            if name in allowed and not extras:
                continue
            allowed.add(name)
            dist = self.by_name.get(name)
            if dist is not None:
                todo += [requirement(s) for s in dist.requires]
                todo += [requirement(s) for e in extras for s in dist.extras.get(e, ())]
        return allowed

    def distributions_of(self, top: str) -> list[str] | None:
        if top in self.by_package:
            return [self.by_package[top].name]
        installed = _installed_packages().get(top)
        if installed:
            return sorted({normalise(d) for d in installed})
        if top in NOT_INSTALLED_HERE:
            return [normalise(NOT_INSTALLED_HERE[top])]
        return None

    def targets(self, imp: Import, owner: Distribution) -> list[str]:
        """The modules an import statement loads from ``owner``'s packages: ``from pkg import sub``
        loads the submodule ``pkg.sub``; any other name loads ``pkg`` itself."""
        if imp.names is None:
            return [imp.module]
        subs = [f"{imp.module}.{n}" for n in imp.names if owner.module_file(f"{imp.module}.{n}") is not None]
        return subs + ([imp.module] if len(subs) < len(imp.names) else [])

    def violations(self, plugin: Distribution) -> list[str]:
        """One line per offending import of ``plugin``'s sources: plugin, file, line, module, why, what to do."""
        found = []
        allowed = self.allowed(plugin)
        for path in plugin.source_files():
            for imp in imports_of(path.read_text()):
                top = imp.module.split(".")[0]
                if top in sys.stdlib_module_names or top in plugin.packages:
                    continue
                owner = self.by_package.get(top)
                problems = [] if owner is None else [
                    (module, why) for module in self.targets(imp, owner)
                    if (why := self._private(module, owner)) is not None]
                if not imp.probe and (why := self._undeclared(top, allowed, plugin)) is not None:
                    problems.append((imp.module, why))
                found += [f"{plugin.name}: {_rel(path)}:{imp.line} imports {module}, {why}" for module, why in problems]
        return found

    def _private(self, module: str, owner: Distribution) -> str | None:
        """Why ``module`` (of first-party ``owner``) is not for a plugin's source, or None."""
        if owner is self.core:
            if module not in PUBLIC_MODULES:
                return ("which is not one of rlcore's public modules (rlcore.public_api.PUBLIC_MODULES): import it "
                        "through a public module, or make it public deliberately (add it to PUBLIC_MODULES with its "
                        "purpose and the same row to docs/writing-plugins.md)")
            if module in FOR_TESTS_ONLY:
                return ("which a plugin imports in its tests only (rlcore.public_api.FOR_TESTS_ONLY): its source "
                        "gets what it needs through its hooks")
            return None
        package, _, rest = module.partition(".")
        public = owner.public_modules(package)
        if not rest or rest.split(".")[0] in public:
            return None
        init = _rel(owner.root / "src" / package / "__init__.py")
        return (f"a private module of {owner.name} (the __all__ of {init} names its public modules: "
                f"{', '.join(public) or 'none'}): use one of those, or have {owner.name} make it public by adding "
                f"{rest.split('.')[0]!r} to that __all__")

    def _undeclared(self, top: str, allowed: set[str], plugin: Distribution) -> str | None:
        """Why importing the top-level module ``top`` needs a declaration ``plugin`` lacks, or None."""
        dists = self.distributions_of(top)
        if dists is None:
            return (f"and no installed distribution provides {top!r}: install it here, or name its distribution in "
                    f"NOT_INSTALLED_HERE (tests/test_public_api.py)")
        if allowed & set(dists):
            return None
        return (f"from {' or '.join(dists)}, which {plugin.pyproject} does not depend on: add it to [project] "
                f"dependencies, or to an optional extra if the plugin runs without it (and import it only where "
                f"it is needed)")


@cache
def _installed_packages() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def assert_import_only_the_public_api(checkout: Checkout, plugins: list[Distribution]) -> None:
    found = [v for plugin in plugins for v in checkout.violations(plugin)]
    assert not found, "plugins import outside the public API (docs/writing-plugins.md):\n" + "\n".join(found)


# ---------------------------------------------------------------------------- the tests ---


def test_first_party_plugins_import_only_the_public_api():
    checkout = Checkout(plugin_roots())
    assert_import_only_the_public_api(checkout, checkout.plugins)


def test_every_plugins_public_modules_exist():
    """A package's ``__all__`` names its public modules: each is a module of the package."""
    checkout = Checkout(plugin_roots())
    for plugin in checkout.plugins:
        for package in plugin.packages:
            for name in plugin.public_modules(package):
                assert plugin.module_file(f"{package}.{name}") is not None, (
                    f"{_rel(plugin.root / 'src' / package / '__init__.py')}: __all__ names {name!r}, "
                    f"which is not a module of {package} (__all__ there names public modules only)")


def test_the_docs_show_exactly_the_public_module_list():
    text = (ROOT / "docs" / "writing-plugins.md").read_text()
    table = text.split("You need only rlcore's public contracts:", 1)[1].split("\n\n", 2)[1]
    rows = re.findall(r"^\| `([a-z_.]+)` \| (.*) \|$", table, re.M)
    expected = [f"| `{name}` | {purpose} |" for name, purpose in PUBLIC_MODULES.items()]
    shown = [f"| `{name}` | {purpose} |" for name, purpose in rows]
    assert shown == expected, (
        "docs/writing-plugins.md's table of public modules differs from rlcore.public_api.PUBLIC_MODULES; "
        "its rows must be, in order:\n" + "\n".join(expected))


def test_public_modules_import_and_the_tests_only_ones_say_so():
    for name in PUBLIC_MODULES:
        importlib.import_module(name)
    assert FOR_TESTS_ONLY <= set(PUBLIC_MODULES)
    for name in FOR_TESTS_ONLY:
        assert PUBLIC_MODULES[name].startswith("in tests:"), f"{name}: its row must start with 'in tests:'"


PLANTED = '''\
from rlcore import errors, hookimpl
from rlcore.types import Cap
from rlcore.trainer import Trainer
from rlcore.engines import hf, tiny
import rlcore.stack


def factory(ctx):
    from rlcore_megatron.routers import RouterSeam
    import pytest
    import torch

    try:
        import transformer_engine
    except ImportError:
        transformer_engine = None
    return RouterSeam, pytest, torch, transformer_engine
'''

#: the planted plugin's clean module: another plugin's public module, through a declared dependency
CLEAN = '''\
def factory(ctx):
    from rlcore_megatron import seams
    from rlcore_mtp.loss import mtp_postprocess

    return seams, mtp_postprocess
'''


def _planted_plugin(tmp_path: Path, source: str, dependencies: list[str]) -> tuple[Checkout, Distribution]:
    """A plugin ``rlcore-planted`` beside the real ones, its ``plugin.py`` being ``source``."""
    root = tmp_path / "plugins" / "planted"
    (root / "src" / "rlcore_planted").mkdir(parents=True)
    deps = ", ".join(f'"{d}"' for d in dependencies)
    (root / "pyproject.toml").write_text(
        f'[project]\nname = "rlcore-planted"\nversion = "0.1.0"\ndependencies = [{deps}]\n')
    (root / "src" / "rlcore_planted" / "__init__.py").write_text('"""planted"""\n')
    (root / "src" / "rlcore_planted" / "plugin.py").write_text(source)
    checkout = Checkout([*plugin_roots(), root])
    return checkout, checkout.plugins[-1]


def test_the_check_fails_on_planted_bad_imports(tmp_path):
    checkout, planted = _planted_plugin(tmp_path, PLANTED, ["rlcore>=0.1,<0.2"])
    with pytest.raises(AssertionError) as failed:
        assert_import_only_the_public_api(checkout, [planted])
    lines = [line.strip() for line in str(failed.value).splitlines() if line.strip().startswith("rlcore-planted: ")]
    file = f"{planted.root}/src/rlcore_planted/plugin.py"
    reported = [re.match(rf"rlcore-planted: {re.escape(file)}:(\d+) imports (\S+), (.*)", line).groups()
                for line in lines]
    assert [(int(n), module) for n, module, _ in reported] == [
        (3, "rlcore.trainer"),  # (a) a core module outside the list
        (4, "rlcore.engines.hf"),  # (a) a submodule taken by a from-import (tiny, beside it, is public)
        (5, "rlcore.stack"),  # (a) public for tests only
        (9, "rlcore_megatron.routers"),  # (b) another plugin's private module...
        (9, "rlcore_megatron.routers"),  # (c) ...from a distribution not depended on
        (10, "pytest"),  # (c) installed here (rlcore's test extra) but not depended on
    ]  # torch comes with rlcore; transformer_engine is probed for
    why = [text for _, _, text in reported]
    assert "not one of rlcore's public modules" in why[0] and "add it to PUBLIC_MODULES" in why[0]
    assert "in its tests only" in why[2]
    assert "a private module of rlcore-megatron" in why[3] and "names its public modules: seams" in why[3]
    assert "from rlcore-megatron, which" in why[4] and "pyproject.toml does not depend on" in why[4]
    assert why[5].startswith("from pytest, which") and "add it to [project] dependencies" in why[5]


def test_the_check_passes_public_modules_of_declared_plugins(tmp_path):
    checkout, planted = _planted_plugin(tmp_path, CLEAN, ["rlcore>=0.1,<0.2", "rlcore-megatron>=0.1,<0.2", "rlcore-mtp"])
    assert_import_only_the_public_api(checkout, [planted])
    # the same imports without the declarations fail
    checkout, undeclared = _planted_plugin(tmp_path / "again", CLEAN, ["rlcore>=0.1,<0.2"])
    with pytest.raises(AssertionError, match="from rlcore-mtp, which .* does not depend on"):
        assert_import_only_the_public_api(checkout, [undeclared])


#: where the names imported from rlcore's public modules are read: every plugin's sources, tests
#: and benches, the examples, the cross-package tests and the scripts (core's own tests may reach
#: into its internals)
FACE_READERS = ("plugins", "examples", "tests", "scripts")


def names_imported_from_public_modules(root: Path = ROOT) -> dict[str, dict[str, list[str]]]:
    """module -> name -> the files that import it (``from module import name``)."""
    public = set(PUBLIC_MODULES) | set(FOR_TESTS_ONLY)
    found: dict[str, dict[str, list[str]]] = {}
    for top in FACE_READERS:
        for path in sorted((root / top).rglob("*.py")):
            if ".egg-info" in path.parts or "build" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in public:
                    for alias in node.names:
                        found.setdefault(node.module, {}).setdefault(alias.name, []).append(str(path.relative_to(root)))
    return found


def face_problems(root: Path = ROOT) -> list[str]:
    """What breaks the public faces: a public module without ``__all__`` or naming what it does
    not define, and every import of a name from a public module that is not in its ``__all__``
    (nor one of its submodules), read under ``root``'s FACE_READERS."""
    problems = []
    for module in sorted(set(PUBLIC_MODULES) | set(FOR_TESTS_ONLY)):
        mod = importlib.import_module(module)
        face = getattr(mod, "__all__", None)
        if face is None:
            problems.append(f"{module} declares no __all__")
            continue
        problems.extend(f"{module}.__all__ names {n!r}, which it does not define" for n in face if not hasattr(mod, n))
    for module, names in names_imported_from_public_modules(root).items():
        mod = importlib.import_module(module)
        face = set(getattr(mod, "__all__", ()))
        for name, files in sorted(names.items()):
            is_submodule = hasattr(mod, "__path__") and importlib.util.find_spec(f"{module}.{name}") is not None
            if name in face or is_submodule:
                continue
            problems.append(f"{files[0]} imports {name!r} from {module}, which is not in its __all__"
                            + (f" (and {len(files) - 1} more files)" if len(files) > 1 else ""))
    return problems


def test_every_public_module_names_its_face_and_only_that_face_is_imported():
    """Each public module declares ``__all__``, every name in it defined there; what the plugins,
    their tests and benches, the examples, these tests and the scripts import from a public module
    is in its ``__all__`` (or is one of its submodules): anything else is internal, so a change
    inside core cannot break them unseen."""
    problems = face_problems()
    assert not problems, "\n".join(problems)


def test_the_face_check_sees_an_internal_name_imported(tmp_path):
    planted = tmp_path / "plugins" / "planted" / "src" / "planted.py"
    planted.parent.mkdir(parents=True)
    planted.write_text("from rlcore.batch import PackedBatch, _layout_of\nfrom rlcore.testing import conformance\n")
    assert [p for p in face_problems(tmp_path) if "planted" in p] == [
        "plugins/planted/src/planted.py imports '_layout_of' from rlcore.batch, which is not in its __all__"]
