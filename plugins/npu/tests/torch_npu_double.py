"""A TEST DOUBLE of torch_npu — exactly the interface rlcore-npu uses, nothing more.

torch_npu cannot be imported on these machines (it needs Ascend's CANN libraries, and installing
it breaks ``import torch`` where CANN is absent), so the platform code is tested against this
stand-in. Like the real package, importing it registers the ``torch.npu`` device module; that
module answers ``is_available``, ``device_count``, ``set_device``, ``current_device`` and
``synchronize`` and records the calls. It computes nothing on any device: tests that use it
check rlcore's platform logic (what is imported when, what is called, which errors say what),
never NPU numerics.

:func:`write_double` writes it as a real package on disk, so that ``import torch_npu`` goes
through the import system exactly as it would for the real one (and can fail the way the real
one fails without CANN: ``broken=True``).
"""

from __future__ import annotations

import sys
from pathlib import Path

DOUBLE_SOURCE = '''
"""torch_npu TEST DOUBLE written by plugins/npu/tests/torch_npu_double.py."""
import torch

IS_TEST_DOUBLE = True
calls = []


class _NpuDeviceModuleDouble:
    def __init__(self, count):
        self._count = count
        self._current = 0

    def is_available(self):
        calls.append(("is_available",))
        return self._count > 0

    def device_count(self):
        calls.append(("device_count",))
        return self._count

    def set_device(self, index):
        calls.append(("set_device", index))
        self._current = int(index)

    def current_device(self):
        return self._current

    def synchronize(self):
        calls.append(("synchronize",))


# what the real torch_npu does on import: name torch's PrivateUse1 device type "npu" and register
# its device module as torch.npu
torch.utils.rename_privateuse1_backend("npu")
torch._register_device_module("npu", _NpuDeviceModuleDouble({count}))
'''

BROKEN_SOURCE = '''
raise ImportError("libhccl.so: cannot open shared object file: No such file or directory")
'''


def write_double(root: Path, *, count: int = 2, broken: bool = False) -> Path:
    """Write the double as package ``torch_npu`` under ``root`` (put ``root`` on sys.path)."""
    pkg = root / "torch_npu"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(BROKEN_SOURCE if broken else DOUBLE_SOURCE.replace("{count}", str(count)))
    return root


def forget_double() -> None:
    """Undo what importing the double did (``torch.npu`` and the module)."""
    import torch

    sys.modules.pop("torch_npu", None)
    if hasattr(torch, "npu") and type(torch.npu).__name__ == "_NpuDeviceModuleDouble":
        del torch.npu  # the PrivateUse1 name "npu" stays: torch allows renaming it once per process
        sys.modules.pop("torch.npu", None)
