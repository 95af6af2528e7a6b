"""SGLang's weight-update wire formats, built with torch and the standard library only.

SGLang never needs to be importable on the trainer side; everything here produces what SGLang's
own receiving code accepts:

* **Flattened-bucket payloads** (``load_format="flattened_bucket"`` of
  ``/update_weights_from_tensor``). SGLang deserializes each TP rank's entry with
  ``MultiprocessingSerializer.deserialize`` — a ``SafeUnpickler`` whose allow-list (0.5.21+)
  names builtins, ``types.SimpleNamespace``, torch tensors/storages/dtypes/``Size`` and
  torch's multiprocessing rebuild functions — and expects ``{"flattened_tensor": uint8 tensor,
  "metadata": [objects with .name .shape .dtype .start_idx .end_idx .numel]}``, which it turns
  into ``FlattenedTensorMetadata`` and feeds to ``FlattenedTensorBucket.reconstruct_tensors``.
  rlcore's payload is a plain dict whose metadata are ``SimpleNamespace`` objects (never an
  rlcore class: the unpickler refuses those), pickled with ``multiprocessing``'s
  ``ForkingPickler`` so the tensor travels as a handle, not as bytes: a CUDA-IPC handle for a
  GPU bucket, the name of a shared-memory file for a CPU bucket.
* **GPU UUIDs in CUDA-IPC handles.** torch writes the *device index* of a CUDA tensor into the
  handle (argument 6 of ``rebuild_cuda_tensor``, ``storage_device``); an index means nothing in a
  server process with another ``CUDA_VISIBLE_DEVICES``. SGLang's receiver patches torch's rebuild
  function (``monkey_patch_torch_reductions``) to accept the GPU's UUID there instead, and
  SGLang's own senders write the UUID. This module's pickler writes the UUID too, through its
  own reducer (no global monkey-patching of torch in the trainer).
* **NCCL bucket metadata** (``/update_weights_from_distributed`` with ``flattened_bucket``): the
  receiver allocates ``FlattenedTensorBucket.empty(names, dtypes, shapes)``, which packs the
  tensors contiguously in the order given with no padding, and refuses a tensor whose byte
  offset is not a multiple of its item size. :func:`rlcore.sync.iter_buckets` with its default
  alignment builds exactly that layout, because each bucket holds a single dtype.
* **Routed experts**: SGLang returns the base64 of the raw int32 bytes of a
  ``[seqlen - 1, num_hidden_layers, topk]`` array, no header.
"""

from __future__ import annotations

import io
from functools import cache
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401 - registers torch's tensor/storage reducers on ForkingPickler
import torch.multiprocessing.reductions as torch_reductions
from rlcore.sync import Bucket

#: position of ``storage_device`` among ``rebuild_cuda_tensor``'s arguments (checked by a test
#: against torch's own signature, and the same constant SGLang's patch uses)
CUDA_REBUILD_DEVICE_ARG = 6


# ------------------------------------------------------------------- flattened buckets -----


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``: the spelling SGLang turns back with ``getattr(torch, ...)``."""
    name = str(dtype)
    if not name.startswith("torch."):
        raise ValueError(f"not a torch dtype: {dtype!r}")
    return name[len("torch."):]


def bucket_metadata(bucket: Bucket) -> list[SimpleNamespace]:
    """One ``SimpleNamespace`` per tensor with the fields of SGLang's ``FlattenedTensorMetadata``
    (``numel`` counts bytes, as SGLang's own bucket does: it is the numel of the uint8 view)."""
    return [
        SimpleNamespace(
            name=m.name,
            shape=torch.Size(m.shape),
            dtype=m.dtype,
            start_idx=m.offset,
            end_idx=m.offset + m.nbytes,
            numel=m.nbytes,
        )
        for m in bucket.metas
    ]


def flattened_bucket_payload(bucket: Bucket) -> dict[str, Any]:
    """The object one TP rank deserializes for ``load_format="flattened_bucket"``."""
    flat = bucket.buffer
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"a flattened bucket is a 1-D uint8 tensor, got {flat.dtype} {tuple(flat.shape)}")
    return {"flattened_tensor": flat.detach(), "metadata": bucket_metadata(bucket)}


def nccl_bucket_metadata(bucket: Bucket) -> tuple[list[str], list[str], list[list[int]]]:
    """``names, dtypes, shapes`` for ``/update_weights_from_distributed``.

    Raises when the bucket's layout is not the one SGLang's ``FlattenedTensorBucket.empty``
    recomputes from these lists (contiguous in this order, no gaps); the broadcast would
    otherwise hand every tensor after the first gap someone else's bytes."""
    offset = 0
    for m in bucket.metas:
        if m.offset != offset:
            raise ValueError(
                f"bucket {bucket.index}: tensor {m.name!r} starts at byte {m.offset}, but SGLang's receiver "
                f"places it at {offset} (the NCCL path needs contiguous, unpadded single-dtype buckets)"
            )
        if offset % m.dtype.itemsize:
            raise ValueError(f"bucket {bucket.index}: tensor {m.name!r} at byte {offset} is not aligned for {m.dtype}")
        offset += m.nbytes
    if offset != bucket.nbytes:
        raise ValueError(f"bucket {bucket.index} holds {bucket.nbytes} bytes but its tensors cover {offset}")
    names = [m.name for m in bucket.metas]
    dtypes = [dtype_name(m.dtype) for m in bucket.metas]
    shapes = [list(m.shape) for m in bucket.metas]
    return names, dtypes, shapes


def shared_memory_allocator(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 bucket allocated directly in a named shared-memory file for CPU buckets, so
    pickling it for another process names that file instead of first copying the bucket into
    shared memory (what torch does for an ordinary CPU tensor). GPU buckets are allocated as
    usual: their IPC handle shares them as they are."""
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    storage = torch.UntypedStorage._new_using_filename_cpu(nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))


# --------------------------------------------------------------------------- pickling -----


@cache
def cuda_device_uuid(index: int) -> str:
    """The UUID string SGLang's receiver matches against ``torch.cuda.get_device_properties(i).uuid``."""
    return str(torch.cuda.get_device_properties(index).uuid)


def with_device_uuid(rebuild_args: tuple, uuid_of=cuda_device_uuid) -> tuple:
    """``rebuild_cuda_tensor`` arguments with the device index replaced by the GPU's UUID (an
    argument that already is a UUID string is kept: an SGLang-patched torch wrote it)."""
    device = rebuild_args[CUDA_REBUILD_DEVICE_ARG]
    if isinstance(device, str):
        return rebuild_args
    if not isinstance(device, int):
        raise TypeError(f"rebuild_cuda_tensor argument {CUDA_REBUILD_DEVICE_ARG} is {device!r}, expected a device index")
    return (*rebuild_args[:CUDA_REBUILD_DEVICE_ARG], uuid_of(device), *rebuild_args[CUDA_REBUILD_DEVICE_ARG + 1:])


def _reduce_tensor(tensor: torch.Tensor):
    # torch's own reducer, also when SGLang's monkey_patch_torch_reductions has replaced it in this
    # process (an in-process Engine): SGLang's replacement rewrites argument 6 of every tensor's
    # rebuild arguments, which CPU tensors do not have
    reduce = getattr(torch_reductions, "_reduce_tensor_original", torch_reductions.reduce_tensor)
    rebuild, args = reduce(tensor)
    if tensor.is_cuda:
        args = with_device_uuid(args)
    return rebuild, args


def _reduce_cpu_storage_by_name(storage: torch.UntypedStorage):
    # torch's default CPU sharing passes a file descriptor through the sender's multiprocessing
    # resource_sharer, authenticated with the sender's multiprocessing authkey, which only its own
    # child processes know: an SGLang server started separately is refused ("digest received was
    # wrong", seen in this package's tests). Naming the shared-memory file instead (torch's
    # file_system strategy, for these payloads only) lets any process on the host open it.
    if storage.device.type != "cpu":
        return torch_reductions.reduce_storage(storage)
    if storage.nbytes() == 0:
        return torch_reductions.rebuild_storage_empty, (type(storage),)
    manager, handle, size = storage._share_filename_cpu_()
    storage._shared_incref()  # one reference per payload; the receiver's rebuild_storage_filename drops it
    return torch_reductions.rebuild_storage_filename, (type(storage), manager, handle, size)


class PayloadPickler(ForkingPickler):
    """``ForkingPickler`` (what SGLang's ``MultiprocessingSerializer.serialize`` uses) whose tensor
    reducer writes GPU UUIDs into CUDA-IPC handles and whose CPU storages travel by file name."""

    def __init__(self, file: Any, protocol: int | None = None):
        super().__init__(file, protocol)
        table = dict(self.dispatch_table)
        table[torch.Tensor] = _reduce_tensor
        table[torch.UntypedStorage] = _reduce_cpu_storage_by_name
        self.dispatch_table = table


def serialize(obj: Any) -> bytes:
    buf = io.BytesIO()
    PayloadPickler(buf).dump(obj)
    return buf.getvalue()


def serialize_per_rank(obj: Any, tp_size: int) -> list[bytes]:
    """One serialization per inference TP rank. Rank *i* deserializes only entry *i*; each
    serialization carries its own handle reference, so every rank's deserialize and release
    balance one reference and the producer's CUDA-IPC bookkeeping stays right."""
    if tp_size < 1:
        raise ValueError("tp_size must be >= 1")
    return [serialize(obj) for _ in range(tp_size)]
