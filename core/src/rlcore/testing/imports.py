"""Checks that a plugin module imports cheaply (``rlcore plugins`` imports every installed one)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterable

__all__ = ["modules_loaded_by"]


def modules_loaded_by(statements: str, watched: Iterable[str]) -> list[str]:
    """Run ``statements`` in a fresh interpreter (this one's ``sys.executable``) and return, sorted,
    the names in ``watched`` (exact module names, e.g. ``"torch"``, ``"vllm"``,
    ``"rlcore_myplugin.head"``) that are in ``sys.modules`` afterwards.

    .. code-block:: python

        def test_plugin_module_is_cheap_to_import():
            assert modules_loaded_by("import rlcore_myplugin.plugin", ["torch", "triton"]) == []

    Raises ``AssertionError`` with the child's stderr when ``statements`` themselves fail.
    """
    names = sorted(set(watched))
    code = f"{statements}\nimport json, sys\nprint(json.dumps([m for m in {names!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        raise AssertionError(f"{statements!r} failed in a fresh interpreter:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
