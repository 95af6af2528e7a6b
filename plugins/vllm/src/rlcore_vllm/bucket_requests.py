"""What a worker is asked to load from a bucket in a shared segment, and what its finish reports
must show (the shm push of :mod:`rlcore_vllm.sync` and a Ray replica's
:mod:`rlcore_vllm.fleet_receiver` both use them)."""

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
