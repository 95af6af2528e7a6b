"""What a worker is asked to load from a bucket in a shared segment, and what its finish reports
must show: coverage, and the read-back checksums of ``exact`` (the shm push of
:mod:`rlcore_vllm.sync` and a Ray replica's :mod:`rlcore_vllm.fleet_receiver` both use them)."""

from __future__ import annotations

from typing import Any

from rlcore.sync import Bucket

from rlcore_vllm import native


def bucket_request(bucket: Bucket, path: str, capacity: int, verify: bool) -> dict[str, Any]:
    """The JSON request of ``rlcore_load_bucket`` for a bucket in a shared segment."""
    return {
        "path": path,
        "capacity": int(capacity),
        "verify": bool(verify),
        "tensors": [[m.name, native.dtype_name(m.dtype), list(m.shape), m.offset, m.nbytes] for m in bucket.metas],
    }


def cuda_bucket_request(bucket: Bucket, verify: bool) -> dict[str, Any]:
    """The JSON request of ``rlcore_load_bucket`` for a bucket in the trainer's GPU memory: the
    buffer's CUDA IPC handle (``{gpu_uuid: rebuild_cuda_tensor args}``, base64 pickle) instead of
    a segment path. The worker opens it on the same GPU (``vllm.transport: cuda_ipc``)."""
    handle = native.cuda_ipc_handle(bucket.buffer)
    return {
        "cuda_ipc": native.to_rpc_text(handle),
        "capacity": int(bucket.buffer.numel()),
        "verify": bool(verify),
        "tensors": [[m.name, native.dtype_name(m.dtype), list(m.shape), m.offset, m.nbytes] for m in bucket.metas],
    }


def check_finish_reports(finish: list[dict[str, Any]]) -> None:
    """Coverage at the end of a shm push, from every worker's ``rlcore_finish_update`` report:
    every tensor of the engine's checkpoint arrived and every vLLM parameter was reached."""
    not_sent = [f for f in finish if f.get("num_not_sent")]
    if not_sent:
        f = not_sent[0]
        raise RuntimeError(f"partial push: {f['num_not_sent']} of the {f['num_manifest']} tensors the vLLM engine "
                           f"holds did not arrive (e.g. {f['not_sent'][:5]}); layers that got them keep older "
                           f"weights")
    missing = [f for f in finish if f.get("num_missing")]
    if missing:
        raise RuntimeError(f"the push did not reach {missing[0]['num_missing']} of {missing[0]['num_params']} vLLM "
                           f"parameters (e.g. {missing[0]['missing'][:5]}); they keep older weights")


def check_read_back(sent: dict[str, int], finish: list[dict[str, Any]]) -> dict[str, Any]:
    """``exact`` from every worker's finish report: each tensor's checksum read back from the
    model's parameters after vLLM's loaders ran (:mod:`rlcore_vllm.readback`) equals the trainer's.
    Raises naming the tensors a loader did not store or stored other bytes for. Returns
    ``read_back`` (tensors read back, fewest over workers), ``not_loaded`` (MTP tensors loaded
    nowhere on purpose: no speculative draft, or the diagnostic skip; counted in the report) and
    ``unreadable`` (names the worker could not locate in a parameter, with the reason): ``exact``
    holds when ``read_back + not_loaded`` covers every sent tensor and nothing is unreadable."""
    unreadable: dict[str, str] = {}
    counts = []
    not_loaded = max((int(f.get("num_not_loaded", 0)) for f in finish), default=0)
    for rank, f in enumerate(finish):
        if f.get("num_not_stored"):
            raise RuntimeError(f"vLLM's loaders stored nothing for {f['num_not_stored']} pushed tensor(s) (e.g. "
                               f"{f['not_stored'][:5]}; read back in worker {rank}): no layer of the model held them "
                               f"after loading, so those weights keep an older version")
        got = {n: int(v) for n, v in (f.get("read_back") or {}).items()}
        bad = sorted(n for n, v in got.items() if n in sent and v != sent[n])
        if bad:
            raise RuntimeError(f"after vLLM's loaders ran, {len(bad)} tensor(s) in the model hold other bytes than the "
                               f"trainer sent (e.g. {bad[:5]}; read back in worker {rank})")
        unreadable.update(f.get("unreadable") or {})
        counts.append(sum(1 for n in got if n in sent))
    return {"read_back": min(counts) if counts else 0, "not_loaded": not_loaded, "unreadable": unreadable}
