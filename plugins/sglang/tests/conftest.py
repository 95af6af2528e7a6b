"""Fixtures for the SGLang tests. Tests marked ``engine`` need SGLang importable (the venv that
scripts/suites/sglang.sh builds); the main venv deselects them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
if str(HERE) not in sys.path:  # sglang_env and the stand-in server live next to the tests
    sys.path.insert(0, str(HERE))


@pytest.fixture(scope="session")
def sglang():
    from sglang_env import import_sglang_on_cpu

    try:
        return import_sglang_on_cpu()
    except ImportError as exc:
        pytest.fail(f"SGLang is not importable here ({exc}); run these tests with scripts/suites/sglang.sh")
