"""rlcore-npu tests. The platform tests run in the core venv against the torch_npu TEST DOUBLE
(torch_npu_double.py); the MindSpeed tests (marked ``engine("megatron")``) run in the megatron-core
venvs (scripts/suites/megatron-*.sh) against the MindSpeed TEST DOUBLE (mindspeed_double.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture
def torch_npu_path(tmp_path, monkeypatch):
    """``torch_npu_path(count=2, broken=False)``: put the torch_npu double on sys.path."""
    from torch_npu_double import forget_double, write_double

    def put(count: int = 2, broken: bool = False) -> Path:
        root = write_double(tmp_path / ("broken" if broken else f"npus{count}"), count=count, broken=broken)
        monkeypatch.syspath_prepend(str(root))
        forget_double()
        return root

    yield put
    forget_double()
