"""rlcore-npu tests. The platform tests run in the core venv against the torch_npu TEST DOUBLE
(torch_npu_double.py); the MindSpeed tests (marked ``engine("megatron")``) run in the megatron-core
venvs (scripts/suites/megatron-*.sh) against the MindSpeed TEST DOUBLE (mindspeed_double.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


_IN_FRESH_INTERPRETER = "RLCORE_NPU_DOUBLE_CHILD"


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A test that imports the torch_npu double runs in a fresh interpreter: importing it renames
    torch's PrivateUse1 backend to "npu", which torch allows once and never undoes, and from then on
    torch.accelerator names "npu" in this process (the optimizer's step then fails in later tests)."""
    if "torch_npu_path" not in pyfuncitem.fixturenames or os.environ.get(_IN_FRESH_INTERPRETER) == "1":
        return None
    cfg = pyfuncitem.config
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", pyfuncitem.nodeid],
                          cwd=cfg.rootpath, env={**os.environ, _IN_FRESH_INTERPRETER: "1"},
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"{pyfuncitem.nodeid} failed in a fresh interpreter:\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}",
                    pytrace=False)
    return True


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
