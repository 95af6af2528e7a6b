"""Requests of vLLM's native weight-transfer API (vLLM 0.26 to 0.33), built from core buckets.

The engine side is ``init_weight_transfer_engine({"init_info": ...})``, then per push
``start_weight_update()`` (or ``start_draft_weight_update()`` for an MTP draft),
``update_weights({"update_info": ...})`` once per bucket and ``finish_weight_update()``; over
HTTP the routes of the same names (``VLLM_SERVER_DEV_MODE=1``). Field names follow vLLM's
``NCCLWeightTransferInitInfo`` / ``NCCLWeightTransferUpdateInfo`` / ``IPCWeightTransferInitInfo``
/ ``IPCWeightTransferUpdateInfo``.

Both transports run *packed*: one core bucket is one packed chunk. vLLM's packed consumers cut
chunks from the per-tensor sizes in order, contiguously, closing a chunk once it exceeds
``packed_buffer_size_bytes``; a core bucket holds one dtype at offsets aligned to that dtype's
size (so contiguous) and at most ``bucket_bytes`` unless a single tensor is larger, so with
``packed_buffer_size_bytes = bucket_bytes`` every ``update_weights`` call receives exactly one
bucket. :func:`check_packable` enforces that.

Where the NCCL packing parameters go depends on the vLLM release: 0.32 / 0.33 read them once from
``NCCLWeightTransferInitInfo``, 0.26 from every ``NCCLWeightTransferUpdateInfo``. The requests
follow the fields of the installed classes (:func:`installed_nccl_fields`), not a version string.
"""

from __future__ import annotations

import base64
import os
import pickle
import weakref
from dataclasses import dataclass, fields
from typing import Any

from rlcore.errors import WeightSyncError
from rlcore.sync import Bucket


def to_rpc_text(obj: Any) -> str:
    """``obj`` as one string for the engine's RPC (base64 pickle: the route passes strings only).
    Only rlcore's own trainer and workers exchange these, over the offline engine's RPC."""
    return base64.b64encode(pickle.dumps(obj)).decode("ascii")


def from_rpc_text(text: str) -> Any:
    """The object :func:`to_rpc_text` made (from rlcore's own trainer or worker only)."""
    return pickle.loads(base64.b64decode(text))  # noqa: S301 - rlcore's own processes, offline engine


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (vLLM resolves it with ``getattr(torch, name)``)."""
    return str(dtype).split(".")[-1]


def check_packable(bucket: Bucket, bucket_bytes: int) -> None:
    """Raise when vLLM's packed consumer would cut this bucket differently."""
    expected = 0
    for m in bucket.metas:
        if m.offset != expected:
            raise ValueError(f"bucket {bucket.index}: {m.name!r} at offset {m.offset}, a packed chunk needs {expected} "
                             f"(build buckets with align_bytes=None)")
        expected += m.nbytes
    if expected != bucket.nbytes:
        raise ValueError(f"bucket {bucket.index}: {bucket.nbytes} bytes for {expected} bytes of tensors")
    if len(bucket.metas) > 1 and expected > bucket_bytes:
        raise ValueError(f"bucket {bucket.index} holds {len(bucket.metas)} tensors in {expected} bytes, more than "
                         f"the packed buffer of {bucket_bytes} bytes")


@dataclass(frozen=True)
class NCCLFields:
    """The field names of the installed vLLM's NCCL ``init_info`` and ``update_info`` classes."""

    init: frozenset[str]
    update: frozenset[str]


def installed_nccl_fields() -> NCCLFields:
    """The fields of the installed vLLM's ``NCCLWeightTransferInitInfo`` / ``...UpdateInfo``
    (``nccl_engine`` defines both in 0.26 and re-exports them in 0.32 / 0.33)."""
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLWeightTransferInitInfo,
        NCCLWeightTransferUpdateInfo,
    )

    return NCCLFields(frozenset(f.name for f in fields(NCCLWeightTransferInitInfo)),
                      frozenset(f.name for f in fields(NCCLWeightTransferUpdateInfo)))


def nccl_packing(bucket_bytes: int, layout: NCCLFields) -> tuple[dict[str, Any], dict[str, Any]]:
    """The packing parameters (one bucket per packed chunk, double-buffered) as the extra fields of
    the init info and of each update info: on whichever of the two declares them."""
    packing = {"packed": True, "packed_buffer_size_bytes": int(bucket_bytes), "packed_num_buffers": 2}
    if set(packing) <= layout.init:
        return packing, {}
    if set(packing) <= layout.update:
        return {}, packing
    raise WeightSyncError(f"the installed vLLM's NCCL weight transfer declares the packed fields {sorted(packing)} "
                          f"on neither its init info (fields {sorted(layout.init)}) nor its update info (fields "
                          f"{sorted(layout.update)}); vllm.transport: nccl needs a vLLM with packed NCCL transfers "
                          f"(0.26 to 0.33), or choose vllm.transport: shm")


def trainer_nccl_group(master_address: str, master_port: int, world_size: int, device: int) -> Any:
    """The trainer's end (rank 0) of the NCCL group the engine workers join at init:
    ``nccl_common.stateless_init_process_group`` on vLLM 0.32 / 0.33; 0.26 has no ``nccl_common``
    and makes it with ``NCCLWeightTransferEngine.trainer_init`` (on the current CUDA device)."""
    try:
        from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group
    except ImportError:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        return NCCLWeightTransferEngine.trainer_init({"master_address": master_address, "master_port": int(master_port),
                                                      "world_size": int(world_size)})
    return stateless_init_process_group(master_address, int(master_port), 0, int(world_size), device)


def nccl_init_info(master_address: str, master_port: int, engine_world_size: int, bucket_bytes: int,
                   layout: NCCLFields) -> dict[str, Any]:
    """``init_info`` for the NCCL backend: the trainer is rank 0, engine workers follow."""
    return {
        "master_address": master_address,
        "master_port": int(master_port),
        "rank_offset": 1,
        "world_size": 1 + int(engine_world_size),
        **nccl_packing(bucket_bytes, layout)[0],
    }


def nccl_update_info(bucket: Bucket, bucket_bytes: int, layout: NCCLFields) -> dict[str, Any]:
    """``update_info`` for one bucket on the NCCL backend (the bytes follow by broadcast)."""
    return {
        "names": bucket.names,
        "dtype_names": [dtype_name(m.dtype) for m in bucket.metas],
        "shapes": [list(m.shape) for m in bucket.metas],
        **nccl_packing(bucket_bytes, layout)[1],
    }


def installed_ipc_init_fields() -> frozenset[str]:
    """The fields of the installed vLLM's ``IPCWeightTransferInitInfo``."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferInitInfo

    return frozenset(f.name for f in fields(IPCWeightTransferInitInfo))


def ipc_init_info(init_fields: frozenset[str]) -> dict[str, Any]:
    """``init_info`` for the IPC backend: packed, one bucket per handle (:func:`ipc_update_info`),
    which a vLLM whose IPC init info has no ``packed`` field (0.26: per-tensor handles) cannot take."""
    if "packed" not in init_fields:
        raise WeightSyncError("the installed vLLM's IPC weight transfer has no packed mode (its init info declares "
                              f"{sorted(init_fields) or 'no fields'}), and rlcore sends one CUDA IPC handle per "
                              "bucket: choose vllm.transport: nccl or shm with this vLLM")
    return {"packed": True}


def ipc_update_info(bucket: Bucket, handle: dict[str, tuple], *, pickled: bool) -> dict[str, Any]:
    """``update_info`` for one bucket on the IPC backend.

    ``handle`` maps the GPU's UUID to the ``rebuild_cuda_tensor`` arguments of the bucket buffer
    (:func:`cuda_ipc_handle`). ``pickled`` sends them as ``ipc_handles_pickled`` (base64 pickle),
    which both the offline RPC and the HTTP route accept when the engine runs with
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``.
    """
    info: dict[str, Any] = {
        "names": bucket.names,
        "dtype_names": [dtype_name(m.dtype) for m in bucket.metas],
        "shapes": [list(m.shape) for m in bucket.metas],
        "tensor_sizes": [m.nbytes for m in bucket.metas],
    }
    if pickled:
        info["ipc_handles_pickled"] = to_rpc_text(handle)
    else:
        info["ipc_handles"] = handle
    return info


#: buffers this process made handles of (key: :func:`_lent_key`): what
#: :func:`buffer_lent_here` gives a worker in this same process (weak: the sender holds its buffers)
_LENT_HERE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def cuda_ipc_handle(buffer: Any) -> dict[str, tuple]:
    """``{gpu_uuid: rebuild_cuda_tensor args}`` for a CUDA uint8 buffer (GPU only)."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buffer)
    _LENT_HERE[_lent_key(args)] = buffer
    uuid = str(torch.cuda.get_device_properties(buffer.device.index or 0).uuid)
    return {uuid: args}


def buffer_lent_here(args: tuple | list) -> Any:
    """The buffer of ``rebuild_cuda_tensor`` arguments made by :func:`cuda_ipc_handle` in this very
    process (an in-process engine, ``vllm.multiprocessing: false``), else None: CUDA refuses to open
    an IPC handle in the process that made it."""
    return _LENT_HERE.get(_lent_key(args))


def _lent_key(args: tuple | list) -> tuple:
    # this process, the block's handle, the storage's offset in it, the tensor's size and offset there
    return os.getpid(), bytes(args[7]), int(args[9]), tuple(args[1]), int(args[3])
