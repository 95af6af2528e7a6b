"""A vLLM engine as a Ray rollout replica's weight receiver (``VLLMBackend.fleet_receiver()``).

Under ``cluster.backend: ray`` the writer trainer rank pushes into a
:class:`~rlcore_ray.fleet.RolloutFleet`: each bucket is ``ray.put`` once, and every replica
hands it to this receiver, which copies it into a shared-memory segment of its own
(:class:`~rlcore_vllm.shm.SharedBucketPool`) and has rlcore's worker extension load it through
vLLM's layerwise reload: the worker path of the in-process ``shm`` push (:mod:`rlcore_vllm.sync`),
with the same name/shape checks before loading. The worker checksums every tensor from the bytes
it loads and, after vLLM's loaders ran, from the model's parameters (:mod:`rlcore_vllm.readback`):
the two must agree here before the workers compute again, and the received ones are this
replica's ``weight_checksums``, which the trainer compares with what it sent (``exact``, per replica). The workers' finish reports give ``coverage``
(:func:`~rlcore_vllm.bucket_requests.check_finish_reports`): a partial push fails in the replica that got it.

Unlike the local rollout, which stages a whole copy and swaps it in, a vLLM engine loads each
bucket as it arrives (its model refuses to compute until the push finishes), so a push that fails
or is aborted leaves the replica refusing to generate until a later push succeeds
(:meth:`~rlcore_vllm.backend.VLLMBackend.fail_push`).

With ``vllm.transport: broadcast`` (:mod:`rlcore_vllm.broadcast`) a bucket reaches the replica
without its bytes: they arrive by the writer's broadcast, on the replica's GPU (then handed to the
worker by CUDA IPC, as a colocated ``cuda_ipc`` push does) or, on CPU, in the shared segment; the
checks are the same.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any

from rlcore.sync import Bucket

from rlcore_vllm.broadcast import BroadcastGroup, tensors_extent
from rlcore_vllm.bucket_requests import (
    bucket_request,
    check_finish_reports,
    check_read_back,
    cuda_bucket_request,
)
from rlcore_vllm.shm import SharedBucketPool


class VLLMFleetReceiver:
    """See the module docstring. ``verify``: have the workers checksum what they load."""

    def __init__(self, backend: Any, verify: bool = True):
        self.backend = backend
        self.verify = bool(verify)
        self.pool: SharedBucketPool | None = None
        self._checksums: dict[str, int] = {}  # what the engine holds after the last complete push
        self._staged: dict[str, int] = {}
        self._workers: list[dict[str, Any]] = []
        self._stats: dict[str, Any] = {}
        self._active: int | None = None
        self._unlinked: set[str] = set()
        #: ``vllm.transport: broadcast``: the group with the writer, joined at the first bucket
        self.broadcast = getattr(backend, "transport", "shm") == "broadcast"
        self.group: BroadcastGroup | None = None

    @property
    def weight_version(self) -> int:
        return self.backend.weight_version

    def begin_update(self, version: int) -> None:
        self.backend.begin_push(version)
        self._active = int(version)
        self._staged = {}
        self._stats = {"buckets": 0, "tensors": 0, "bytes": 0,
                       "seconds": dict.fromkeys(("broadcast", "copy", "load"), 0.0)}
        try:
            self._workers = self.backend.rpc("rlcore_begin_update", {"version": int(version), "skip_draft": False,
                                                                     "verify": self.verify})
        except BaseException as exc:
            self._fail(exc)
            raise

    def receive_bucket(self, bucket: Bucket) -> None:
        if self._active is None:
            raise RuntimeError("receive_bucket outside begin_update/commit_update")
        try:
            if self.broadcast:
                nbytes, results, t0, t1, t2 = self._receive_broadcast(bucket)
            else:
                nbytes = bucket.nbytes
                t0 = time.perf_counter()
                buf = self._segment_buffer(nbytes)
                buf.copy_(bucket.buffer)  # out of Ray's object store into the segment the workers map
                t1 = time.perf_counter()
                results = self._load_from_segment(bucket, buf)
                t2 = time.perf_counter()
            for rank, res in enumerate(results):
                for name, value in res.get("checksums", {}).items():
                    if self._staged.setdefault(name, int(value)) != int(value):
                        raise RuntimeError(f"vLLM worker {rank} loaded other bytes for {name!r} than worker 0")
            self._stats["seconds"]["broadcast" if self.broadcast else "copy"] += t1 - t0
            self._stats["seconds"]["load"] += t2 - t1
            self._stats["buckets"] += 1
            self._stats["tensors"] += len(bucket.metas)
            self._stats["bytes"] += nbytes
        except BaseException as exc:
            self._fail(exc)
            raise

    def _segment_buffer(self, nbytes: int) -> Any:
        if self.pool is None:
            self.pool = SharedBucketPool(prefix="rlcore-vllm-replica")
        return self.pool.allocate(nbytes, "cpu")

    def _load_from_segment(self, bucket: Bucket, buf: Any) -> list[dict[str, Any]]:
        """The workers load ``bucket``'s tensors from ``buf``, a buffer of this replica's pool."""
        seg = self.pool.segment_of(buf)
        results = self.backend.rpc("rlcore_load_bucket", bucket_request(bucket, seg.path, seg.capacity, self.verify))
        # the workers copied out whatever vLLM's reload still buffers: the segment is free again
        self.pool.release(buf)
        if seg.path not in self._unlinked:
            # every worker has it mapped now (and finds it again by path): the name can go, so a
            # replica killed with SIGKILL leaves nothing behind in /dev/shm
            os.unlink(seg.path)
            self._unlinked.add(seg.path)
        return results

    def _receive_broadcast(self, bucket: Bucket) -> tuple[int, list[dict[str, Any]], float, float, float]:
        """``vllm.transport: broadcast``: the bytes of ``bucket`` (names, shapes and offsets only)
        come by the writer's broadcast; returns the bytes, the workers' results and the clock at
        the start, after the broadcast and after the load."""
        if bucket.nbytes:
            raise RuntimeError(f"vllm.transport 'broadcast': bucket {bucket.index} came with {bucket.nbytes} bytes "
                               f"through Ray; the writer sends only its tensors' names and places")
        if self.group is None:
            s = self.backend.settings
            self.group = BroadcastGroup.join(s.nccl_master_address, s.nccl_master_port, s.request_timeout_s)
        nbytes = tensors_extent(bucket.metas)
        t0 = time.perf_counter()
        if self.group.device == "cuda":
            import torch

            buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            self.group.broadcast(buf)  # waits until the bytes are on this GPU
            t1 = time.perf_counter()
            # vLLM's worker (its own process, same GPU) opens the buffer by CUDA IPC, copies what
            # it keeps and synchronises before it answers: the buffer is free once this returns
            results = self.backend.rpc("rlcore_load_bucket", cuda_bucket_request(replace(bucket, buffer=buf),
                                                                                 self.verify))
            del buf
        else:
            buf = self._segment_buffer(nbytes)
            self.group.broadcast(buf)
            t1 = time.perf_counter()
            results = self._load_from_segment(bucket, buf)
        return nbytes, results, t0, t1, time.perf_counter()

    def commit_update(self, version: int) -> dict[str, Any]:
        if self._active is None:
            raise RuntimeError("commit_update without begin_update")
        try:
            t0 = time.perf_counter()
            finish = self.backend.rpc("rlcore_finish_update", {"version": int(version)})
            check_finish_reports(finish)
            if self.verify:
                # what the model holds after loading must be what the workers received; the trainer
                # then compares the received checksums with the sent ones (``exact``, per replica)
                read_back = check_read_back(self._staged, finish)
                if read_back["unreadable"] or read_back["read_back"] + read_back["not_loaded"] != len(self._staged):
                    raise RuntimeError(f"{len(self._staged) - read_back['read_back']} tensor(s) could not be read "
                                       f"back from the model (e.g. {list(read_back['unreadable'].items())[:2]})")
            self.backend.rpc("rlcore_commit_update", {"version": int(version)})  # the workers compute again
            if self.group is not None and self.group.device == "cuda":
                import torch

                torch.cuda.ipc_collect()  # the workers closed their handles: free the buckets' memory
            self._stats["seconds"]["finish"] = time.perf_counter() - t0
        except BaseException as exc:
            self._fail(exc)
            raise
        self.backend.commit_push(version)
        self._active = None
        self._checksums = dict(self._staged)
        return {"version": self.backend.weight_version, "pid": os.getpid(), "workers": len(self._workers),
                "coverage": bool(self._workers) and all(w.get("coverage") for w in self._workers),
                "exact": self.verify, **self._stats}

    def abort_update(self) -> None:
        if self._active is not None:
            self._fail(RuntimeError("aborted by the trainer"))

    def weight_checksums(self, names: Any = None) -> dict[str, int]:
        """Checksums the workers computed of the bytes they loaded in the last complete push."""
        if names is None:
            return dict(self._checksums)
        return {n: self._checksums[n] for n in names if n in self._checksums}

    def _fail(self, exc: BaseException) -> None:
        """End the push in the workers (they keep refusing to compute, naming the partial version)
        and mark the engine's weights unknown."""
        self._active = None
        if self.pool is not None:
            self.pool.release_all()
        try:
            self.backend.rpc("rlcore_abort_update", {"reason": f"{type(exc).__name__}: {exc}"[:500]})
        except Exception:  # noqa: BLE001 - the original error is the one to report
            pass
        self.backend.fail_push(f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self.group is not None:
            self.group.close()
            self.group = None
