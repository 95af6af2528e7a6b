"""Checksums of weights: :func:`tensor_checksum` of one tensor, and :class:`ChecksumPlan`, the same
values for many tensors at once.

:func:`tensor_checksum` is a 62-bit checksum of a tensor's raw bytes computed with torch integer
ops, so a CUDA sender and a CPU (or other-process) receiver get the same number (about 650 MB/s
on one core of the CI machine).

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

_P = (1 << 31) - 1  # Mersenne prime
_W = 65521  # position weights cycle with this period (largest prime below 2^16)


def tensor_checksum(t: torch.Tensor) -> int:
    """A position-weighted checksum of the tensor's bytes (dtype-agnostic, device-agnostic).

    Over the 32-bit words ``w_i`` of the raw bytes (zero-padded to a multiple of 4):
    ``s1 = Σ w_i mod P`` and ``s2 = Σ w_i · ((i mod 65521) + 1) mod P`` with ``P = 2^31 - 1``,
    packed into one int together with the word count. Exact integer arithmetic, so a CUDA
    sender and a CPU receiver agree; order-sensitive; one pass over memory: the words are viewed
    as ``[rows, 65521]`` and summed per column in int64 (no partial sum can overflow), then the
    65521 column sums are weighted.
    """
    flat = t.detach().contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
    pad = (-raw.numel()) % 4
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    elif raw.storage_offset() % 4:  # a 2-byte tensor at offset 2 of a bucket: int32 view needs 4
        raw = raw.clone()
    words = raw.view(torch.int32)
    n = words.numel()
    if n < _W:  # one partial row: the same sums without the 65521-wide column pass (small tensors)
        w64 = words.to(torch.int64)
        s1 = int(w64.sum()) % _P
        s2 = int(((w64 % _P) * torch.arange(1, n + 1, dtype=torch.int64, device=w64.device)).sum()) % _P
        return (s1 << 31) | (s2 ^ (n & 0x7FFFFFFF))
    full = n - n % _W
    if full:
        colsum = words[:full].view(-1, _W).sum(dim=0, dtype=torch.int64)
    else:
        colsum = torch.zeros(_W, dtype=torch.int64, device=words.device)
    tail = words[full:]
    if tail.numel():
        colsum[: tail.numel()] += tail.to(torch.int64)
    s1 = int(colsum.sum()) % _P
    weights = torch.arange(1, _W + 1, dtype=torch.int64, device=colsum.device)
    s2 = int(((colsum % _P) * weights).sum()) % _P
    return (s1 << 31) | (s2 ^ (n & 0x7FFFFFFF))


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
