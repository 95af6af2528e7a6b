"""Checksums of weights: :func:`tensor_checksum` of one tensor, and :class:`ChecksumPlan`, the same
values for many tensors at once.

:func:`tensor_checksum` is a 62-bit checksum of a tensor's raw bytes computed with torch integer
ops, so a CUDA sender and a CPU (or other-process) receiver get the same number (about 650 MB/s
on one core of the CI machine).

``tensor_checksum`` launches a handful of kernels and waits for the GPU once per tensor; on a MoE
with 1,651 tensors that is thousands of launches and 1,651 host waits. :class:`ChecksumSlots`
computes the same per-tensor values into one device tensor (a slot per tensor) with one Triton
kernel per call (each program sums one chunk of one tensor's 32-bit words, column by column as
``tensor_checksum`` does, so no word needs a modulo), optionally **copying** every word it reads
(:meth:`ChecksumSlots.copy`: a copy and its checksum in one pass), and reads the slots back to the
host once (:meth:`ChecksumSlots.values`), at the end of a push. :class:`ChecksumPlan` is the same
for a fixed list of tensors (its chunk table built once, rerun every push).

Where Triton is missing, on a CPU, or for a tensor whose byte size or address is not a multiple of
4, the same sums are computed with torch ops on the tensor's device (:func:`_raw_sums`, no host
wait either): the values are the same either way (the CPU suites run the kernel under Triton's
interpreter against both; the CUDA benchmark checks every tensor of its models).
:func:`warm_checksum_kernels` compiles the kernels when a sync or receiver is set up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    s1, s2 = _raw_sums(t).tolist()  # one read-back
    return _pack(s1, s2, _nwords(t))


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

    @triton.jit(do_not_specialize=["nchunks"])  # one compile whatever the chunk count (warmed at setup)
    def copy_word_sums(table_ptr, nchunks, out_ptr, BLOCK: tl.constexpr, ROWS: tl.constexpr, W: tl.constexpr,
                       P: tl.constexpr, COPY: tl.constexpr):
        # one chunk of ROWS x W words, seen as ROWS rows of W: word r*W + c has position c + 1, so a
        # column's words are summed first (no modulo per word) and weighted once. With COPY, every
        # word read is also written to the destination: the checksum costs no second read.
        # table rows: source address, destination address, word count (one column per chunk)
        pid = tl.program_id(0)
        base = tl.load(table_ptr + pid).to(tl.pointer_type(tl.int32))
        dst = tl.load(table_ptr + nchunks + pid).to(tl.pointer_type(tl.int32))
        n = tl.load(table_ptr + 2 * nchunks + pid).to(tl.int32)
        offs = tl.arange(0, BLOCK)
        acc1 = tl.zeros([BLOCK], dtype=tl.int64)
        acc2 = tl.zeros([BLOCK], dtype=tl.int64)
        for cb in range(0, W, BLOCK):
            c = cb + offs
            colsum = tl.zeros([BLOCK], dtype=tl.int64)
            for r in tl.static_range(ROWS):  # unrolled: ROWS independent loads in flight
                idx = r * W + c
                mask = (c < W) & (idx < n)
                w = tl.load(base + idx, mask=mask, other=0)
                if COPY:
                    tl.store(dst + idx, w, mask=mask)
                colsum += w.to(tl.int64)
            acc1 += colsum
            # |colsum| <= ROWS * 2^31 = 2^35, times c + 1 <= 2^16, over W / BLOCK terms: < 2^58
            acc2 += colsum * (c + 1).to(tl.int64)
        tl.store(out_ptr + 2 * pid, tl.sum(acc1, axis=0))
        tl.store(out_ptr + 2 * pid + 1, tl.sum(acc2 % P, axis=0))

    _kernel = copy_word_sums
    return _kernel


def _words_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bytes as int32 words, zero-padded to a multiple of 4 (what is checksummed)."""
    flat = t.detach().contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
    pad = (-raw.numel()) % 4
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    elif raw.storage_offset() % 4:  # a 2-byte tensor at offset 2 of a bucket: int32 view needs 4
        raw = raw.clone()
    return raw.view(torch.int32)


_weights: dict[torch.device, torch.Tensor] = {}


def _raw_sums(t: torch.Tensor) -> torch.Tensor:
    """``[Σ w_i, Σ (colsum_c mod P)(c + 1)]`` (int64, on ``t``'s device, nothing read back to the
    host): the two sums of :func:`tensor_checksum` before their final ``mod P``, by torch ops.
    Adding these over pieces of one tensor (Triton chunks) gives the same residues mod P."""
    words = _words_of(t)
    n = words.numel()
    if n < _W:  # one partial row: the column sums are the words themselves
        w64 = words.to(torch.int64)
        pos = torch.arange(1, n + 1, dtype=torch.int64, device=w64.device)
        return torch.stack([w64.sum(), ((w64 % _P) * pos).sum()])
    full = n - n % _W
    colsum = words[:full].view(-1, _W).sum(dim=0, dtype=torch.int64)
    tail = words[full:]
    if tail.numel():
        colsum[: tail.numel()] += tail.to(torch.int64)
    weights = _weights.get(colsum.device)
    if weights is None:
        weights = _weights[colsum.device] = torch.arange(1, _W + 1, dtype=torch.int64, device=colsum.device)
    return torch.stack([colsum.sum(), ((colsum % _P) * weights).sum()])


def _pack(s1: int, s2: int, nwords: int) -> int:
    return ((s1 % _P) << 31) | ((s2 % _P) ^ (nwords & 0x7FFFFFFF))


def _nwords(t: torch.Tensor) -> int:
    return (t.numel() * t.element_size() + 3) // 4


def _triton_ok(t: torch.Tensor) -> bool:
    nbytes = t.numel() * t.element_size()
    return t.is_contiguous() and nbytes > 0 and nbytes % 4 == 0 and t.data_ptr() % 4 == 0


def _use_triton(device: torch.device, use_triton: bool | None):
    """The kernel where it runs: CUDA with Triton importable; ``use_triton=True`` also on CPU (only
    meaningful under ``TRITON_INTERPRET=1``, how the CPU suites run the kernel)."""
    if use_triton is False or (device.type != "cuda" and use_triton is not True):
        return None
    return _triton_kernel()


@dataclass
class PreparedChecksums:
    """One launch of :class:`ChecksumSlots`: Triton's chunk table (``None``: no tensor fits the
    kernel) and the tensors the torch fallback handles, as ``(slot, dst or None, src)``."""

    kernel: Any
    table: torch.Tensor | None
    nchunks: int
    copy: bool
    rest: list[tuple[int, torch.Tensor | None, torch.Tensor]]


def checksum_kernel_runs_on(device: torch.device | str) -> bool:
    """Whether :class:`ChecksumSlots` copies and checksums in one pass on ``device`` (CUDA with Triton)."""
    return _use_triton(torch.device(device), None) is not None


class ChecksumSlots:
    """Per-tensor checksums of a push accumulated in one device tensor (a slot per tensor), read
    back to the host once, by :meth:`values`, at the end of the push.

    :meth:`checksum` (read tensors) and :meth:`copy` (copy ``src`` into ``dst`` and checksum the
    words in the same pass: on a GPU one Triton kernel reads each byte once) only *launch* work:
    nothing waits for the device, so a sender fills its next bucket while the GPU checksums the
    last. The kernels are given raw addresses, not tensors, and nothing here keeps a tensor alive:
    a bucket freed right after :meth:`copy` goes back to the caching allocator, whose reuse is
    ordered on the same stream after the queued kernel (the lesson of the reverted queued plans,
    docs/benchmarks/two_gpu.md: holding the buckets grew the writer by 1-3 GB). Callers on other
    streams must synchronise themselves.

    The values equal :func:`tensor_checksum` of each tensor (the CPU fallback is the same formula
    in torch ops; tests compare both paths).
    """

    def __init__(self, device: torch.device | str | None = None, capacity: int = 256,
                 use_triton: bool | None = None):
        self.use_triton = use_triton
        self.capacity = max(1, capacity)
        self.device: torch.device | None = None
        self._sums: torch.Tensor | None = None
        self._nwords: list[int] = []
        #: kernel launches and fallback tensors since the last reset (what ran, for reports)
        self.launches = 0
        self.fallback_tensors = 0
        if device is not None:
            self._place(torch.device(device))

    def _place(self, device: torch.device) -> None:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._sums = torch.zeros(self.capacity, 2, dtype=torch.int64, device=device)

    def __len__(self) -> int:
        return len(self._nwords)

    def reset(self) -> None:
        """Forget every slot (the device tensor is kept, zeroed: one launch, no wait); the device
        is set again by the next tensors (``None`` until then when made without one)."""
        if self._sums is not None:
            self._sums.zero_()
        self._nwords = []
        self.launches = self.fallback_tensors = 0

    def _take(self, tensors: list[torch.Tensor]) -> list[int]:
        if self._sums is None or (tensors and not self._nwords and tensors[0].device != self.device
                                  and not (tensors[0].device.type == "cuda" == self.device.type
                                           and tensors[0].device.index in (None, self.device.index))):
            self._place(tensors[0].device if tensors else torch.device("cpu"))
        first = len(self._nwords)
        need = first + len(tensors)
        if need > self._sums.shape[0]:  # grows on the device (a push of more tensors than the last)
            grown = torch.zeros(max(need, 2 * self._sums.shape[0]), 2, dtype=torch.int64, device=self.device)
            grown[: self._sums.shape[0]] = self._sums
            self._sums = grown
            self.capacity = grown.shape[0]
        self._nwords += [_nwords(t) for t in tensors]
        return list(range(first, need))

    def checksum(self, tensors: list[torch.Tensor]) -> list[int]:
        """Queue the checksum of each tensor; returns their slots."""
        return self._run([(None, t) for t in tensors])

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
        """``dst.copy_(src)`` for every ``(dst, src)`` (same dtype and shape) and the checksum of the
        copied bytes, in one pass where the kernel runs; returns the slots."""
        for dst, src in pairs:
            if dst.dtype != src.dtype or dst.shape != src.shape:
                raise ValueError(f"copy with checksum needs equal dtype and shape, got {dst.dtype}{tuple(dst.shape)} "
                                 f"<- {src.dtype}{tuple(src.shape)}")
        return self._run(pairs)

    def _run(self, pairs: list[tuple[torch.Tensor | None, torch.Tensor]]) -> list[int]:
        slots = self._take([s if d is None else d for d, s in pairs])  # the slots live where the copies land
        self.run_prepared(self.prepare(pairs, slots))
        return slots

    def prepare(self, pairs: list[tuple[torch.Tensor | None, torch.Tensor]], slots: list[int]) -> PreparedChecksums:
        """The launch for ``pairs`` into ``slots`` (the chunk table on the device), to rerun with
        :meth:`run_prepared` while the tensors stay at their addresses (a plan's parameters do)."""
        kernel = _use_triton(self.device, self.use_triton)
        srcs, dsts, counts, owners, rest = [], [], [], [], []
        for slot, (dst, src) in zip(slots, pairs, strict=True):
            if (kernel is not None and src.device == self.device and _triton_ok(src)
                    and (dst is None or (dst.device == self.device and _triton_ok(dst)))):
                words = _nwords(src)
                for first in range(0, words, CHUNK_WORDS):
                    srcs.append(src.data_ptr() + 4 * first)
                    dsts.append(dst.data_ptr() + 4 * first if dst is not None else 0)
                    counts.append(min(CHUNK_WORDS, words - first))
                    owners.append(slot)
            else:
                rest.append((slot, dst, src))
        table = None
        if srcs:
            table = torch.tensor([srcs, dsts, counts, owners], dtype=torch.int64)
            if self.device.type == "cuda":  # pinned + non_blocking: the host does not wait for the copy
                table = table.pin_memory().to(self.device, non_blocking=True)
        copy = bool(pairs) and pairs[0][0] is not None
        return PreparedChecksums(kernel, table, len(srcs), copy, rest)

    def run_prepared(self, prep: PreparedChecksums) -> None:
        """Queue a prepared launch (its slots must exist: :meth:`prepare` after a reserve)."""
        for slot, dst, src in prep.rest:
            self.fallback_tensors += 1
            if dst is not None:
                with torch.no_grad():
                    dst.copy_(src)
            # the checksum of what landed (the destination) where the copy and the sums are two passes
            self._sums[slot] += _raw_sums(dst if dst is not None else src).to(self.device)
        if prep.table is not None:
            partial = torch.empty(prep.nchunks, 2, dtype=torch.int64, device=self.device)
            prep.kernel[(prep.nchunks,)](prep.table, prep.nchunks, partial, BLOCK=_BLOCK, ROWS=_ROWS, W=_W, P=_P,
                                         COPY=prep.copy)
            self._sums.index_add_(0, prep.table[3], partial)
            self.launches += 1

    def values(self, slots: list[int] | None = None) -> list[int]:
        """The checksums (``tensor_checksum`` values) of ``slots`` (default: all, in slot order);
        waits for the device once."""
        if not self._nwords:
            return []
        sums = self._sums[: len(self._nwords)].cpu().tolist()
        slots = range(len(self._nwords)) if slots is None else slots
        return [_pack(sums[s][0], sums[s][1], self._nwords[s]) for s in slots]


_warmed: set[str] = set()


def warm_checksum_kernels(device: torch.device | str) -> bool:
    """Compile and run the checksum kernels once on ``device`` (both variants: read-only and copy),
    so that the first push does not pay Triton's compile (~0.5 s measured). Called when a sync or a
    receiver is set up; cheap to call again. Returns True when this call did the warm-up."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if str(device) in _warmed:
        return False
    slots = ChecksumSlots(device, capacity=2)
    a = torch.arange(1024, dtype=torch.int32, device=device)
    b = torch.empty_like(a)
    slots.copy([(b, a)])
    slots.checksum([a])
    got = slots.values()
    if got[0] != got[1]:
        raise RuntimeError(f"checksum kernels on {device}: copy and read-only variants disagree ({got})")
    _warmed.add(str(device))
    return True


def warmed_devices() -> frozenset[str]:
    """Devices :func:`warm_checksum_kernels` has warmed in this process."""
    return frozenset(_warmed)


class ChecksumPlan:
    """``tensor_checksum`` of each of ``tensors`` (all on one device), computed together.

    The tensors must stay alive and at their addresses between :meth:`compute` calls (a
    transport's parameters do); build a new plan when they move. ``backend`` says what ran:
    ``"triton"`` (one kernel for all eligible tensors) or ``"per-tensor"``.
    """

    def __init__(self, tensors: list[torch.Tensor], use_triton: bool | None = None, *,
                 sources: list[torch.Tensor] | None = None):
        self.tensors = list(tensors)
        device = self.tensors[0].device if self.tensors else torch.device("cpu")
        self._slots = ChecksumSlots(device, capacity=len(self.tensors), use_triton=use_triton)
        slots = self._slots._take(self.tensors)
        pairs = list(zip(self.tensors, sources, strict=True)) if sources is not None else [(None, t) for t in self.tensors]
        self._prepared = self._slots.prepare(pairs, slots)
        self.backend = "triton" if self._prepared.table is not None else "per-tensor"

    @classmethod
    def copying(cls, pairs: list[tuple[torch.Tensor, torch.Tensor]], use_triton: bool | None = None) -> ChecksumPlan:
        """A plan whose every :meth:`compute` first copies each ``src`` into its ``dst`` (same dtype
        and shape) and checksums the landed bytes in the same pass (one Triton kernel on a GPU: the
        receiver reads each byte once); the values are ``tensor_checksum`` of each ``dst``."""
        for dst, src in pairs:
            if dst.dtype != src.dtype or dst.shape != src.shape:
                raise ValueError(f"copy with checksum needs equal dtype and shape, got {dst.dtype}{tuple(dst.shape)} "
                                 f"<- {src.dtype}{tuple(src.shape)}")
        return cls([d for d, _ in pairs], use_triton, sources=[s for _, s in pairs])

    def compute_async(self) -> ChecksumSlots:
        """Queue the checksums (nothing waits); read them with ``.values()`` of the result."""
        self._slots._sums.zero_()
        self._slots.launches = self._slots.fallback_tensors = 0
        self._slots.run_prepared(self._prepared)
        return self._slots

    def compute(self) -> list[int]:
        """The checksums, in the order of ``tensors`` (waits for the GPU once)."""
        return self.compute_async().values() if self.tensors else []
