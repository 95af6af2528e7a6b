"""The checksum kernel (rlcore.checksums) run by Triton's interpreter on CPU: the fused
copy-and-checksum and the read-only variant give the torch path's values (``tensor_checksum``'s).
Runs in the fused-triton suite (`bash scripts/suites/fused-triton.sh
core/tests/test_checksums_triton_interpreter.py`, TRITON_INTERPRET=1); skipped where Triton is
not installed (the main venv: its CPU tests cover the torch path)."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the kernel runs on CPU only under TRITON_INTERPRET=1")


def test_kernel_values_equal_the_torch_path_and_copies_bitwise():
    from rlcore.checksums import CHUNK_WORDS, ChecksumSlots, tensor_checksum

    g = torch.Generator().manual_seed(5)
    ts = [torch.randn(CHUNK_WORDS + 70_001, generator=g),               # two chunks, the second partial
          torch.randn(4, 65521, generator=g).to(torch.bfloat16),         # whole rows
          -torch.ones(1000, dtype=torch.int32),                          # negative words
          torch.randn(3, generator=g).to(torch.bfloat16)]                # 6 bytes: the torch path
    kernel = ChecksumSlots("cpu", use_triton=True)
    dsts = [torch.empty_like(t) for t in ts]
    copied = kernel.copy(list(zip(dsts, ts, strict=True)))
    read = kernel.checksum(ts)
    assert kernel.launches == 2 and kernel.fallback_tensors == 2  # the 6-byte tensor, in both calls
    values = kernel.values()
    ref = [tensor_checksum(t) for t in ts]
    assert [values[s] for s in copied] == ref and [values[s] for s in read] == ref
    assert all(torch.equal(d.view(torch.uint8), t.view(torch.uint8)) for d, t in zip(dsts, ts, strict=True))
    torch_path = ChecksumSlots("cpu", use_triton=False)
    torch_path.checksum(ts)
    assert torch_path.values() == ref and torch_path.launches == 0
