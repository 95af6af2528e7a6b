"""Checksums of many tensors at once, equal to :func:`rlcore.sync.tensor_checksum` of each.

``tensor_checksum`` launches a handful of kernels and waits for the GPU once per tensor; on a MoE
with 1,651 tensors that is thousands of launches and 1,651 host waits. :class:`ChecksumPlan`
computes the same per-tensor values for a fixed list of tensors with one Triton kernel over all of
them (each program sums one chunk of one tensor's 32-bit words, column by column as
``tensor_checksum`` does, so no word needs a modulo) and one copy of the partial sums to the host. The plan (the chunk table on the GPU) is built once and rerun for every push, since a
transport sends the same tensors, at the same addresses, push after push.

Where Triton is missing, on a CPU, or for a tensor whose byte size or address is not a multiple of
4, the plan falls back to ``tensor_checksum`` for that tensor: the values are the same either way
(the CUDA benchmark checks this on every tensor of both models).
"""

from __future__ import annotations

import torch

from rlcore.sync import tensor_checksum

_P = (1 << 31) - 1  # the modulus of tensor_checksum
_W = 65521  # its position period
_ROWS = 16
CHUNK_WORDS = _ROWS * _W  # a chunk starts at a multiple of _W words, so position = index % _W + 1
_BLOCK = 1024

_kernel = None


def _triton_kernel():
    """The kernel, compiled lazily; ``None`` where Triton cannot be imported."""
    global _kernel
    if _kernel is not None:
        return _kernel
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def word_sums(addr_ptr, nwords_ptr, out_ptr, BLOCK: tl.constexpr, ROWS: tl.constexpr, W: tl.constexpr,
                  P: tl.constexpr):
        # one chunk of ROWS x W words, seen as ROWS rows of W: word r*W + c has position c + 1, so a
        # column's words are summed first (no modulo per word) and weighted once
        pid = tl.program_id(0)
        base = tl.load(addr_ptr + pid).to(tl.pointer_type(tl.int32))
        n = tl.load(nwords_ptr + pid).to(tl.int32)
        offs = tl.arange(0, BLOCK)
        acc1 = tl.zeros([BLOCK], dtype=tl.int64)
        acc2 = tl.zeros([BLOCK], dtype=tl.int64)
        for cb in range(0, W, BLOCK):
            c = cb + offs
            colsum = tl.zeros([BLOCK], dtype=tl.int64)
            for r in tl.static_range(ROWS):  # unrolled: ROWS independent loads in flight
                idx = r * W + c
                colsum += tl.load(base + idx, mask=(c < W) & (idx < n), other=0).to(tl.int64)
            acc1 += colsum
            # |colsum| <= ROWS * 2^31 = 2^35, times c + 1 <= 2^16, over W / BLOCK terms: < 2^58
            acc2 += colsum * (c + 1).to(tl.int64)
        tl.store(out_ptr + 2 * pid, tl.sum(acc1, axis=0))
        tl.store(out_ptr + 2 * pid + 1, tl.sum(acc2 % P, axis=0))

    _kernel = word_sums
    return _kernel


class ChecksumPlan:
    """``tensor_checksum`` of each of ``tensors`` (all on one device), computed together.

    The tensors must stay alive and at their addresses between :meth:`compute` calls (a
    transport's parameters do); build a new plan when they move. ``backend`` says what ran:
    ``"triton"`` (one kernel for all eligible tensors) or ``"per-tensor"``.
    """

    def __init__(self, tensors: list[torch.Tensor], use_triton: bool | None = None):
        self.tensors = list(tensors)
        self.fallback: list[int] = []  # indices computed with tensor_checksum
        eligible: list[int] = []
        device = self.tensors[0].device if self.tensors else torch.device("cpu")
        kernel = _triton_kernel() if device.type == "cuda" and use_triton is not False else None
        for i, t in enumerate(self.tensors):
            nbytes = t.numel() * t.element_size()
            if (kernel is not None and t.device == device and t.is_contiguous() and nbytes % 4 == 0
                    and t.data_ptr() % 4 == 0 and nbytes > 0):
                eligible.append(i)
            else:
                self.fallback.append(i)
        self.backend = "triton" if eligible else "per-tensor"
        self._eligible = eligible
        if not eligible:
            return
        addrs, counts, owner = [], [], []
        for i in eligible:
            t = self.tensors[i]
            words = t.numel() * t.element_size() // 4
            for first in range(0, words, CHUNK_WORDS):
                addrs.append(t.data_ptr() + 4 * first)
                counts.append(min(CHUNK_WORDS, words - first))
                owner.append(i)
        self._words = {i: self.tensors[i].numel() * self.tensors[i].element_size() // 4 for i in eligible}
        self._addr = torch.tensor(addrs, dtype=torch.int64, device=device)
        self._count = torch.tensor(counts, dtype=torch.int64, device=device)
        self._owner = torch.tensor(owner, dtype=torch.int64)
        self._out = torch.empty(len(addrs), 2, dtype=torch.int64, device=device)
        self._kernel = kernel

    def compute(self) -> list[int]:
        """The checksums, in the order of ``tensors`` (waits for the GPU once)."""
        out: list[int] = [0] * len(self.tensors)
        for i in self.fallback:
            out[i] = tensor_checksum(self.tensors[i])
        if not self._eligible:
            return out
        self._kernel[(self._addr.numel(),)](self._addr, self._count, self._out, BLOCK=_BLOCK, ROWS=_ROWS, W=_W, P=_P)
        partial = self._out.cpu()
        sums = torch.zeros(len(self.tensors), 2, dtype=torch.int64).index_add_(0, self._owner, partial).tolist()
        for i in self._eligible:
            s1 = sums[i][0] % _P
            s2 = sums[i][1] % _P
            out[i] = (s1 << 31) | (s2 ^ (self._words[i] & 0x7FFFFFFF))
        return out
