"""Running megatron-core on a machine without GPUs (CI, laptops).

megatron-core assumes CUDA in three places that matter for a tiny model on CPU:

* modules allocate with ``device=torch.cuda.current_device()``;
* layers enter ``tensor_parallel.get_cuda_rng_tracker().fork()`` around dropout regions, and the
  tracker keeps CUDA RNG states;
* 0.15/0.16 without Transformer Engine leave some optional fused-kernel names undefined in
  ``moe_utils`` (a ``NameError`` in router gating; fixed in 0.17).

:func:`install_cpu_shim` answers each of them once per process, and only when CUDA is absent:
``current_device`` returns ``"cpu"``, the RNG tracker is a no-op (the engine runs with dropout
off, so no RNG state is ever consumed inside a fork), and the missing names are bound to
``None`` (the code paths that use them are the fused ones, which the engine turns off). It must
run before megatron-core's model modules are imported, because they bind the tracker by name.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

_INSTALLED = False

_OPTIONAL_FUSED_NAMES = (
    "te_general_gemm",
    "fused_topk_with_score_function",
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
    "fused_permute",
    "fused_unpermute",
    "fused_permute_with_probs",
    "fused_sort_chunks_by_index",
    "fused_sort_chunks_by_index_with_probs",
)


class _NoCudaRngTracker:
    """Stands in for megatron's CUDA RNG tracker on CPU: forks are no-ops."""

    def fork(self, name: str | None = None) -> Any:
        return contextlib.nullcontext()

    def add(self, *args: Any, **kwargs: Any) -> None:
        pass

    def reset(self) -> None:
        pass

    def get_states(self) -> dict:
        return {}

    def set_states(self, states: Any) -> None:
        pass

    def is_initialized(self) -> bool:
        return True


_TRACKER = _NoCudaRngTracker()


def install_cpu_shim() -> None:
    """See module docstring. Idempotent; refuses to run where CUDA is available."""
    global _INSTALLED
    if _INSTALLED:
        return
    if torch.cuda.is_available():
        raise RuntimeError("the megatron CPU shim must not be installed on a machine with CUDA")
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]

    import megatron.core.tensor_parallel as tp
    import megatron.core.tensor_parallel.random as tp_random

    def get_tracker(*args: Any, **kwargs: Any) -> _NoCudaRngTracker:
        return _TRACKER

    tp_random.get_cuda_rng_tracker = get_tracker
    tp.get_cuda_rng_tracker = get_tracker

    import megatron.core.transformer.moe.moe_utils as moe_utils

    for name in _OPTIONAL_FUSED_NAMES:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)
    _INSTALLED = True
