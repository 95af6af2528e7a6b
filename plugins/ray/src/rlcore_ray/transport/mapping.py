"""The pieces of the source-mapped plane (:mod:`rlcore_ray.transport.mapped`): sharing a storage with
the other process once, opening it there, and the receiver's copy program.

* :func:`export_storage` / :func:`open_storage`: a CUDA storage travels as torch's own IPC
  description (``UntypedStorage._share_cuda_``: the IPC handle of the caching-allocator block that
  holds it, plus the storage's byte offset in that block), so many parameters in one block cost one
  ``cudaIpcOpenMemHandle`` on the receiver (torch caches opened blocks by handle). A receiver in the
  exporting process itself (vLLM's engine in the trainer's process, ``vllm.multiprocessing: false``)
  gets the exported storage back: CUDA refuses to open an IPC handle in the process that made it,
  and torch's own cache does not catch that case. The CPU analogue,
  for tests on machines without a GPU, is a storage in shared memory named by its file
  (``_share_filename_cpu_``, torch's ``file_system`` sharing): the same bookkeeping, another handle.
* :class:`CopyProgram`: the receiver's copies for one layout, built once. Pairs whose source bytes
  and destination bytes both follow on from the previous pair's (parameters carved out of one flat
  buffer on both sides) merge into one run; runs are viewed with the widest integer type their
  sizes and addresses allow; runs of at least ``big_bytes`` are copied one by one (a plain
  device-to-device ``copy_``), the rest with one Triton kernel over a table of 8-byte-aligned
  chunks (``fused="triton"``, the ``"auto"`` choice on CUDA where Triton imports: one launch for all
  of them; measured 1.3x faster than ``_foreach_copy_`` on 1,649 expert tensors of 3 MiB, see
  docs/benchmarks/transport.md) or with one ``torch._foreach_copy_`` per element width
  (``"foreach"``, and whatever the kernel does not take: CPU, runs not 8-byte aligned).
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch

from rlcore_ray.transport.protocol import TransportError

_WIDTHS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))
_COPY_BLOCK, _COPY_ITERS = 1024, 64  # a chunk of the Triton copy: 64 x 1024 int64 words (512 KiB)

_copy_kernel = None


def triton_copy_kernel():
    """The batched copy kernel, compiled lazily; ``None`` where Triton cannot be imported."""
    global _copy_kernel
    if _copy_kernel is not None:
        return _copy_kernel
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def copy_chunks(src_ptr, dst_ptr, nwords_ptr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        pid = tl.program_id(0)
        src = tl.load(src_ptr + pid).to(tl.pointer_type(tl.int64))
        dst = tl.load(dst_ptr + pid).to(tl.pointer_type(tl.int64))
        n = tl.load(nwords_ptr + pid).to(tl.int32)
        offs = tl.arange(0, BLOCK)
        for it in range(ITERS):
            idx = it * BLOCK + offs
            mask = idx < n
            tl.store(dst + idx, tl.load(src + idx, mask=mask), mask=mask)

    _copy_kernel = copy_chunks
    return _copy_kernel


#: storages this process exported, by key: what :func:`open_storage` hands back to a receiver in this
#: same process (weak: an export does not keep a storage alive; the sender holds what it lends)
_EXPORTED_HERE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _storage_key(kind: str, meta: tuple) -> tuple:
    """A storage's name across processes: its block (CUDA) or file (CPU), and its offset in the block."""
    return bytes(meta[1]), int(meta[3]) if kind == "cuda" else 0


def export_storage(storage: torch.UntypedStorage) -> tuple[tuple, tuple]:
    """``(key, payload)`` of a storage another process can open with :func:`open_storage`. ``key``
    names the storage (block handle and offset), ``payload[1][1]`` the block (CUDA) or file (CPU),
    ``payload[2]`` the exporting process."""
    if storage.device.type == "cuda":
        meta = storage._share_cuda_()
        # (device, block handle, storage bytes, storage offset in the block, ref-counter handle,
        #  ref-counter offset, event handle, event sync required)
        key = _storage_key("cuda", meta)
        _EXPORTED_HERE[key] = storage
        return key, ("cuda", tuple(meta), os.getpid())
    if storage.device.type == "cpu":
        if not storage.is_shared():
            raise TransportError("a CPU tensor of a mapped push must be in shared memory (tensor.share_memory_() "
                                 "under torch.multiprocessing.set_sharing_strategy('file_system'))")
        try:
            meta = storage._share_filename_cpu_()
        except RuntimeError as exc:
            raise TransportError(f"this CPU storage cannot be shared by name ({exc}); use "
                                 "torch.multiprocessing.set_sharing_strategy('file_system') before share_memory_()") from exc
        storage._shared_incref()  # the receiver's open takes this reference over (as torch's pickling does)
        key = _storage_key("cpu", meta)
        _EXPORTED_HERE[key] = storage
        return key, ("cpu", tuple(meta), os.getpid())
    raise TransportError(f"a mapped push cannot share a {storage.device.type} storage (cuda or shared cpu only)")


def open_storage(payload: tuple) -> torch.UntypedStorage:
    """The storage :func:`export_storage` described: opened by its handle, or, in the process that
    exported it, that storage itself."""
    kind, meta = payload[0], payload[1]
    here = _EXPORTED_HERE.get(_storage_key(kind, meta))
    if here is not None and len(payload) > 2 and payload[2] == os.getpid():
        if kind == "cpu":
            here._shared_decref()  # the reference the export took for the receiver, as the open below drops it
        return here
    if kind == "cuda":
        torch.cuda._lazy_init()
        return torch.UntypedStorage._new_shared_cuda(*meta)
    storage = torch.UntypedStorage._new_shared_filename_cpu(*meta)
    storage._shared_decref()
    return storage


def block_of(payload: tuple) -> bytes:
    """The caching-allocator block (CUDA) or the file (CPU) that holds a storage."""
    return bytes(payload[1][1])


def typed_view(storage: torch.UntypedStorage, byte_offset: int, shape: tuple[int, ...] | list[int],
               dtype: torch.dtype) -> torch.Tensor:
    """A contiguous ``dtype`` tensor of ``shape`` at ``byte_offset`` of ``storage``."""
    item = torch.empty((), dtype=dtype).element_size()
    if byte_offset % item:
        raise TransportError(f"offset {byte_offset} is not a multiple of the {dtype} item size")
    shape = tuple(int(s) for s in shape)
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    out = torch.empty(0, dtype=dtype, device=storage.device)
    return out.set_(storage, byte_offset // item, shape, tuple(reversed(stride)))


def _flat(t: torch.Tensor) -> tuple[torch.UntypedStorage, int, int]:
    s = t.untyped_storage()
    return s, t.data_ptr() - s.data_ptr(), t.numel() * t.element_size()


class CopyProgram:
    """Copies ``pairs`` of ``(destination, source)`` tensors (same dtype, shape, device; both
    contiguous) as few, wide copies; built once for a layout, :meth:`run` every push."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], big_bytes: int = 16 << 20,
                 fused: str = "auto"):
        if fused not in ("auto", "foreach", "triton"):
            raise ValueError(f"fused must be 'auto', 'foreach' or 'triton', got {fused!r}")
        spans = []  # (src storage, src offset, dst storage, dst offset, nbytes)
        for dst, src in pairs:
            if dst.shape != src.shape or dst.dtype != src.dtype:
                raise TransportError(f"copy pair differs: {tuple(dst.shape)} {dst.dtype} <- {tuple(src.shape)} {src.dtype}")
            if not (dst.is_contiguous() and src.is_contiguous()):
                raise TransportError("copy pairs must be contiguous tensors")
            ss, so, n = _flat(src)
            ds, do, _ = _flat(dst)
            if n:
                spans.append((ss, so, ds, do, n))
        spans.sort(key=lambda s: (s[0].data_ptr(), s[1]))
        runs: list[list] = []
        for ss, so, ds, do, n in spans:
            last = runs[-1] if runs else None
            if (last is not None and last[0].data_ptr() == ss.data_ptr() and last[2].data_ptr() == ds.data_ptr()
                    and last[1] + last[4] == so and last[3] + last[4] == do):
                last[4] += n
            else:
                runs.append([ss, so, ds, do, n])
        self.pairs, self.runs = len(pairs), len(runs)
        self.big: list[tuple[torch.Tensor, torch.Tensor]] = []
        groups: dict[torch.dtype, tuple[list, list]] = {}
        self.bytes = 0
        for ss, so, ds, do, n in runs:
            width, dt = next((w, d) for w, d in _WIDTHS
                             if n % w == 0 and (ss.data_ptr() + so) % w == 0 and (ds.data_ptr() + do) % w == 0)
            src_v, dst_v = typed_view(ss, so, (n // width,), dt), typed_view(ds, do, (n // width,), dt)
            self.bytes += n
            if n >= big_bytes:
                self.big.append((dst_v, src_v))
            else:
                d, s = groups.setdefault(dt, ([], []))
                d.append(dst_v)
                s.append(src_v)
        self.groups = list(groups.values())
        self.table: tuple[torch.Tensor, ...] | None = None
        kernel = None
        if fused != "foreach" and torch.int64 in groups and groups[torch.int64][0][0].device.type == "cuda":
            kernel = triton_copy_kernel()
        if fused == "triton" and kernel is None and torch.int64 in groups:
            raise TransportError("CopyProgram(fused='triton') needs CUDA tensors and Triton (pip install triton); "
                                 "'auto' falls back to _foreach_copy_")
        if kernel is not None:
            dsts, srcs = groups.pop(torch.int64)  # the 8-byte runs go through the kernel
            self.groups = list(groups.values())
            chunk = _COPY_BLOCK * _COPY_ITERS
            rows = [(s.data_ptr() + 8 * at, d.data_ptr() + 8 * at, min(chunk, s.numel() - at))
                    for d, s in zip(dsts, srcs, strict=True) for at in range(0, s.numel(), chunk)]
            cols = list(zip(*rows, strict=True))
            self.table = tuple(torch.tensor(c, dtype=torch.int64, device=dsts[0].device) for c in cols)
            self._keep = (dsts, srcs)  # the table holds raw addresses: keep the views alive
            self._kernel = kernel
        self.fused = sum(len(d) for d, _ in self.groups) + (len(self._keep[0]) if self.table is not None else 0)

    def run(self) -> None:
        for dst, src in self.big:
            dst.copy_(src, non_blocking=True)
        for dsts, srcs in self.groups:
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
        if self.table is not None:
            self._kernel[(self.table[0].numel(),)](*self.table, BLOCK=_COPY_BLOCK, ITERS=_COPY_ITERS)

    def stats(self) -> dict[str, Any]:
        return {"pairs": self.pairs, "runs": self.runs, "big_copies": len(self.big), "fused_copies": self.fused,
                "fused_launches": len(self.groups) + (self.table is not None),
                "triton_chunks": 0 if self.table is None else self.table[0].numel(), "bytes": self.bytes}
