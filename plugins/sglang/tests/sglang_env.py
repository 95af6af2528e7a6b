"""Importing SGLang's own modules in the CPU-only sglang venv (scripts/suites/sglang.sh).

SGLang 0.5.23 imports fine without a GPU once its small pure-Python dependencies are installed,
except for one thing: its request structs (``io_struct``) import ``torchvision.transforms``
through a multimodal helper, and the only torchvision wheel PyPI has for torch 2.13 is a CUDA
build. Its C++ ops cannot load on the CPU build of torch, and torchvision's import then fails
registering fake kernels for two of them (``torchvision::nms``, ``torchvision::qnms``) whose
schemas do not exist. Defining those two schemas (no kernels) lets the import finish. No
torchvision operator is called by anything these tests exercise.
"""

from __future__ import annotations

import importlib
from typing import Any

_TORCHVISION_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_LIBS: list[Any] = []  # keep the library fragment alive: dropping it removes the schemas


def _define_torchvision_schemas() -> None:
    import torch

    if _LIBS or hasattr(torch.ops.torchvision, "nms"):
        return
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _TORCHVISION_SCHEMAS:
        lib.define(schema)
    _LIBS.append(lib)


def import_sglang_on_cpu() -> Any:
    """Import ``sglang`` (and make its request structs importable); returns the package."""
    import torch

    if torch.cuda.is_available():  # a real CUDA torch loads torchvision's ops itself
        return importlib.import_module("sglang")
    _define_torchvision_schemas()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Only CUDA ... support GGUF/AWQ quantization" and the like
        sglang = importlib.import_module("sglang")
        importlib.import_module("sglang.srt.managers.io_struct")
    return sglang
