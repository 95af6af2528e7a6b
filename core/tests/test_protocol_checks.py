"""Protocol checks that behave the same on Python 3.11 and 3.12+.

From Python 3.12 ``isinstance(obj, P)`` against a runtime-checkable protocol looks members up
statically and misses methods a wrapper forwards through ``__getattr__``: on the GPU machine
(Python 3.12) every trainer rank's push was refused that way while CI (3.11) passed
(docs/benchmarks/two_gpu.md, calls 1-3). Code asks :func:`rlcore.types.implements` instead, and
this test fails when ``isinstance``/``issubclass`` against one of rlcore's runtime-checkable
protocols comes back anywhere in core or a plugin.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import rlcore.types as types_module
from rlcore.types import Platform, implements

ROOT = Path(__file__).resolve().parents[2]


def _runtime_protocols() -> set[str]:
    return {name for name, obj in vars(types_module).items()
            if inspect.isclass(obj) and getattr(obj, "_is_runtime_protocol", False)}


def _isinstance_against(protocols: set[str]) -> list[str]:
    found = []
    sources = [ROOT / "core" / "src", *sorted((ROOT / "plugins").glob("*/src"))]
    for root in sources:
        for path in sorted(root.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "issubclass")
                        and len(node.args) == 2):
                    continue
                second = node.args[1]
                for item in second.elts if isinstance(second, ast.Tuple) else [second]:
                    name = item.id if isinstance(item, ast.Name) else getattr(item, "attr", None)
                    if name in protocols:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.func.id}(..., {name})")
    return found


def test_no_isinstance_against_a_runtime_protocol():
    protocols = _runtime_protocols()
    assert {"BucketReceiver", "RolloutBackend", "Platform"} <= protocols, "the scan must know the protocols"
    found = _isinstance_against(protocols)
    assert not found, ("isinstance against a runtime-checkable protocol misses forwarded methods on Python 3.12+; "
                       f"use rlcore.types.implements: {found}")


class _CpuLikePlatform:
    device_type = "cpu"
    dist_backend = "gloo"

    def device(self, index=None):
        import torch

        return torch.device("cpu")

    def device_count(self):
        return 1

    def set_device(self, index):
        pass

    def synchronize(self):
        pass


class _Forwarding:
    """A wrapper that forwards everything to the platform it wraps (as a plugin's shim would)."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_implements_takes_forwarded_members_and_asks_for_data_members():
    assert implements(_CpuLikePlatform(), Platform)
    assert implements(_Forwarding(_CpuLikePlatform()), Platform)
    without_backend = type("NoBackend", (), {k: v for k, v in vars(_CpuLikePlatform).items() if k != "dist_backend"})
    assert not implements(without_backend(), Platform), "a platform without dist_backend is not a Platform"
    without_sync = type("NoSync", (), {k: v for k, v in vars(_CpuLikePlatform).items() if k != "synchronize"})
    assert not implements(without_sync(), Platform)


def test_a_forwarding_platform_is_accepted_by_resolve_device(monkeypatch):
    import rlcore.platforms as platforms
    from rlcore.types import PlatformSpec

    monkeypatch.setattr(platforms, "_ACTIVE", dict(platforms._ACTIVE))  # the activated platforms: restored after
    spec = PlatformSpec(name="fwd", device_type="cpu", factory=lambda ctx: _Forwarding(_CpuLikePlatform()))
    resolved = platforms.resolve_device("cpu", {"cpu": spec}, spec=spec)
    assert resolved.platform.dist_backend == "gloo" and str(resolved.device) == "cpu"
    bad = PlatformSpec(name="bad", device_type="cpu", factory=lambda ctx: object())
    with pytest.raises(TypeError, match=r"platform 'bad'.*not a Platform"):
        platforms.resolve_device("cpu", {"cpu": bad}, spec=bad)
