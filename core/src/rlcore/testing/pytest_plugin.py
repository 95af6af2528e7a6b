"""pytest plugin shipped with rlcore (entry point ``pytest11: rlcore``).

Fixtures for plugin authors:

``rlcore_plugin_manager``
    A fresh :class:`~rlcore.manager.PluginManager` that does not autoload entry points, with
    core's built-ins registered. Register your plugin module on it to test it in isolation.
``rlcore_bare_plugin_manager``
    The same without the built-ins.
``register_plugin``
    ``register_plugin(module_or_object, name=None, manager=None)`` registers a plugin on a
    manager (default: ``rlcore_plugin_manager``) and unregisters it when the test ends, passed
    or failed. Also usable as a context manager: ``with register_plugin(mod) as name: ...``.
``rlcore_config``
    ``rlcore_config(*dotlist, plugins=manager)`` returns the run config validated against the
    manager (default: ``rlcore_plugin_manager``), as :func:`rlcore.stack.load_config` does for
    ``rlcore check``: the sections and algorithms of plugins registered with ``register_plugin``
    included (``rlcore_config("algorithm.name=my-algo", "algorithm.my_key=2")``).
``tiny_model_dirs``
    Session-scoped tiny HF model directories: ``dense_a``, ``dense_b`` (same architecture,
    other weights), ``moe_a``, ``moe_b`` (Qwen3-MoE), created locally on first use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def rlcore_bare_plugin_manager():
    from rlcore.manager import PluginManager

    return PluginManager(autoload=False)


@pytest.fixture
def rlcore_plugin_manager():
    from rlcore.manager import PluginManager

    pm = PluginManager(autoload=False)
    pm.load_builtins()
    return pm


class _Registrar:
    def __init__(self, default_manager: Any):
        self.default = default_manager
        self.done: list[tuple[Any, str]] = []

    def __call__(self, plugin: Any, name: str | None = None, manager: Any = None, **kw: Any) -> _Registration:
        pm = manager or self.default
        reg_name = pm.register(plugin, name, **kw)
        self.done.append((pm, reg_name))
        return _Registration(pm, reg_name)

    def cleanup(self) -> None:
        while self.done:
            pm, name = self.done.pop()
            pm.unregister(name)


class _Registration(str):
    """The registered name; as a context manager it unregisters on exit."""

    def __new__(cls, pm: Any, name: str):
        obj = super().__new__(cls, name)
        obj.pm = pm
        return obj

    def __enter__(self) -> str:
        return str(self)

    def __exit__(self, *exc: Any) -> None:
        self.pm.unregister(str(self))


@pytest.fixture
def register_plugin(rlcore_plugin_manager) -> Iterator[_Registrar]:
    reg = _Registrar(rlcore_plugin_manager)
    try:
        yield reg
    finally:
        reg.cleanup()


@pytest.fixture
def rlcore_config(rlcore_plugin_manager, monkeypatch):
    from rlcore.manager import ENV_PLUGINS
    from rlcore.stack import load_config

    def make(*dotlist: str, plugins: Any = None) -> Any:
        # exactly what `rlcore check` / `rlcore train` validate: every section and algorithm the
        # manager's registered plugins provide, and the hints for installed-but-inactive ones.
        # RLCORE_PLUGINS picks a run's plugins from the installed ones; a test's manager has
        # those it registered, so the variable of the shell the tests run in is not read here.
        with monkeypatch.context() as env:
            env.delenv(ENV_PLUGINS, raising=False)
            cfg, _ = load_config(None, dotlist, plugins=plugins or rlcore_plugin_manager)
        return cfg

    return make


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Any]:
    from rlcore.testing.models import make_model_dir

    root = tmp_path_factory.mktemp("rlcore-tiny-models")
    return {
        "dense_a": make_model_dir(root / "dense_a", "qwen2", seed=1),
        "dense_b": make_model_dir(root / "dense_b", "qwen2", seed=2),
        "moe_a": make_model_dir(root / "moe_a", "qwen3_moe", seed=3),
        "moe_b": make_model_dir(root / "moe_b", "qwen3_moe", seed=4),
    }


@pytest.fixture
def fake_distribution(tmp_path, monkeypatch):
    """``fake_distribution(name, version, entry_points={ep_name: "module"}, modules={"module": source})``
    writes an installed-looking distribution (``.dist-info`` with ``entry_points.txt``) and its
    modules into a temporary directory on ``sys.path``, so entry-point discovery finds it exactly
    as it finds a pip-installed plugin. Everything is removed after the test."""
    import importlib
    import sys
    import textwrap

    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    created_modules: list[str] = []

    def make(name: str, version: str = "1.0", entry_points: dict[str, str] | None = None,
             modules: dict[str, str] | None = None) -> Any:
        norm = name.replace("-", "_")
        info = root / f"{norm}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        lines = ["[rlcore]"] + [f"{k} = {v}" for k, v in (entry_points or {}).items()]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        for mod, src in (modules or {}).items():
            (root / f"{mod}.py").write_text(textwrap.dedent(src))
            created_modules.append(mod)
        importlib.invalidate_caches()
        return info

    yield make
    for mod in created_modules:
        sys.modules.pop(mod, None)
    importlib.invalidate_caches()


@contextlib.contextmanager
def registered(pm: Any, plugin: Any, name: str | None = None, **kw: Any) -> Iterator[str]:
    """Context manager form for code without the fixture."""
    n = pm.register(plugin, name, **kw)
    try:
        yield n
    finally:
        pm.unregister(n)
