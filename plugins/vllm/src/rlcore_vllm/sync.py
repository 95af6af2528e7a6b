"""The ``vllm`` weight sync: core buckets into a running vLLM engine, verified and versioned.

Transports (``vllm.transport``):

* ``shm`` (every platform; the one CI runs): :func:`rlcore.sync.iter_buckets` builds each bucket
  directly in a shared-memory segment (:class:`~rlcore_vllm.shm.SharedBucketPool`), and rlcore's
  worker extension maps it and loads it through vLLM's layerwise reload
  (:mod:`rlcore_vllm.worker_ext`). One RPC per bucket carries only names, shapes and offsets.
  Level ``coverage+exact``: every tensor's name and shape are checked in the worker against the
  checkpoint the engine was started from before it is loaded, the push fails unless every tensor
  of that checkpoint arrived (a tied ``lm_head`` is covered by the embedding and rebuilt with it)
  or when vLLM reports model parameters it did not reach; every tensor is checksummed
  (:func:`rlcore.sync.tensor_checksum`) on the trainer side, in every worker from the bytes it
  received, and again from what the model (target and draft) holds after vLLM's loaders ran: the
  tensor's slice of the parameter it was loaded into (:mod:`rlcore_vllm.readback`). ``exact``
  means the last: a loader that stores nothing fails the push naming the tensor. A tensor the
  worker cannot locate in a parameter (tensor-parallel shards) drops ``exact`` from the level
  (``details["unreadable"]`` says which and why). The engine refuses to compute from the first
  bucket until every check passed and the trainer commits the push.
* ``mapped`` (offline engine, trainer and engine on one machine): the first push goes through the
  worker path above (``cuda_ipc`` on a GPU, ``shm`` on CPU) and asks the worker to learn where each
  tensor landed (:mod:`rlcore_vllm.direct`); once the trainer verified it, every push lends the
  trainer's parameters to the worker (:class:`rlcore_ray.transport.MappedSender`: their storages
  shared once by CUDA IPC, or shared memory on CPU; no bucket) and the worker copies them straight
  into those parameter slices, checksummed as they land, in one RPC (``coverage+exact``: names,
  shapes and completeness against the engine's checkpoint, every tensor's bytes against the
  trainer's checksums). Where the worker cannot take direct copies (vLLM's processing changes the
  weights, a speculative draft, tensor parallelism) the learning push says why
  (``details["direct_refused"]``, warned once) and pushes keep the loaders.
* ``broadcast`` (Ray rollout replicas only): every bucket's bytes go from the writer trainer rank
  to all replicas by one collective broadcast (NCCL from GPU to GPU, gloo on CPU;
  :mod:`rlcore_vllm.broadcast`), only names and places through Ray; each replica hands them to
  its vLLM worker by the ``cuda_ipc`` (GPU) or ``shm`` (CPU) worker path, so the level is
  ``coverage+exact`` as for ``shm``.
* ``nccl`` / ``ipc`` (GPU): vLLM's native weight-transfer API, one packed chunk per core bucket
  (:mod:`rlcore_vllm.native`). These engines return nothing per chunk, so verification compares
  the engine's prompt log-probs on a probe sequence with the training engine's (level ``probe``).

LoRA adapter pushes (``lora.rank`` > 0, the backend started with adapters: :mod:`rlcore_vllm.adapters`)
go another way, whatever the transport: the adapter tensors are checked against the engine's adapter
(names, shapes, complete), cast to its LoRA dtype, written as a PEFT adapter directory in shared
memory and loaded by vLLM's ``LLMEngine.add_lora``; each worker then reports what it holds of the
adapter, as registered and in the stacked buffers' slot the forward reads, and every tensor's
checksum must equal the trainer's (``coverage+exact``) before the version is served and the older
adapter leaves vLLM. ``sync_bytes`` is the adapter's bytes in the LoRA dtype.

A push that fails at any point raises :class:`~rlcore.errors.WeightSyncError` with
``receiver_version=None`` and leaves the backend marked as holding unknown weights: it refuses to
generate until a later push succeeds; with ``shm`` the engine's workers refuse too, for any caller
(their refusal names the partial version).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

from rlcore.errors import ConfigError, WeightSyncError
from rlcore.sync import (
    LEVEL_CHECKS,
    PUSH_PHASES,
    Bucket,
    Phases,
    SentChecksums,
    iter_buckets,
    verification_level,
    verify_checksums,
)
from rlcore.types import Cap, SyncReport

from rlcore_vllm import native
from rlcore_vllm.adapters import check_held, expected_checksums
from rlcore_vllm.backend import VLLMBackend
from rlcore_vllm.broadcast import BroadcastGroup, tensors_extent
from rlcore_vllm.bucket_requests import (
    bucket_request,
    check_finish_reports,
    check_read_back,
    cuda_bucket_request,
)
from rlcore_vllm.platform import installed_vllm
from rlcore_vllm.settings import VLLMSettings, check_settings, choose_transport
from rlcore_vllm.shm import SharedBucketPool
from rlcore_vllm.speculative import check_draft_current, skips_draft

MB = 1 << 20
#: probe tolerance of the native transports' log-prob check, by serving dtype
PROBE_ATOL = {"float32": 1e-3, "float16": 5e-2, "bfloat16": 1e-1}


def timed(items: Iterable[Any], phases: dict[str, float], key: str) -> Iterator[Any]:
    """``items``, adding the time spent producing each (filling a bucket) to ``phases[key]``."""
    it = iter(items)
    while True:
        t0 = time.perf_counter()
        item = next(it, None)
        phases[key] += time.perf_counter() - t0
        if item is None:
            return
        yield item


class VLLMWeightSync:
    """See the module docstring."""

    def __init__(self, bucket_bytes: int, *, verify: bool = True, transport: str = "shm",
                 settings: Any = None, probe_engine: Any = None):
        self.bucket_bytes = int(bucket_bytes)
        self.verify = bool(verify)
        self.transport = transport
        self.settings = settings if settings is not None else VLLMSettings()
        check_settings(self.settings)
        self.probe_engine = probe_engine
        self.pool: SharedBucketPool | None = None
        self._native_ready = False
        self._nccl_group: Any = None
        self._nccl_fields: native.NCCLFields | None = None  # the installed vLLM's (read at the native init)
        self._broadcast_store: Any = None  # vllm.transport 'broadcast': the writer's rendezvous store
        self._broadcast_group: BroadcastGroup | None = None
        # the sender's checksums, summed by the copies that fill each bucket (kept across pushes)
        self._sent = SentChecksums() if self.verify else None
        # vllm.transport 'mapped': the worker's learned direct copies, and the sender lending the parameters
        self._direct_ready = False
        self._direct_refused: str | None = None
        self._mapped_sender: Any = None

    # ------------------------------------------------------------------------ push -----

    def push(self, weights: Iterable[tuple[str, Any]], target: Any, version: int) -> SyncReport:
        if not isinstance(target, VLLMBackend):
            if callable(getattr(target, "replica_checksums", None)):  # a Ray fleet of vLLM replicas
                return self._push_fleet(weights, target, version)
            raise WeightSyncError(f"sync 'vllm' feeds only the 'vllm' rollout backend, got {type(target).__name__}")
        if self.transport == "broadcast":
            raise WeightSyncError("vllm.transport 'broadcast' feeds Ray rollout replicas only (cluster.backend=ray)",
                                  receiver_version=None)
        before = target.weight_version
        kind = "adapter" if target.lora is not None else self.transport
        t0 = time.perf_counter()
        target.begin_push(version)
        stats = {"bytes": 0, "tensors": 0, "buckets": 0}
        try:
            if target.lora is not None:
                checked, details = self._push_adapter(weights, target, version, stats)
            elif self.transport in ("shm", "cuda_ipc"):
                checked, details = self._push_shm(weights, target, version, stats)
            elif self.transport == "mapped":
                checked, details = self._push_mapped(weights, target, version, stats)
            else:
                checked, details = self._push_native(weights, target, version, stats)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            target.fail_push(reason)
            msg = (f"vllm {kind} push of version {version} failed after {stats['buckets']} bucket(s): "
                   f"{reason}. The engine held version {before} before; it may now hold a mix of versions, so it "
                   f"refuses to generate until a push succeeds")
            raise WeightSyncError(msg, receiver_version=None) from exc
        target.commit_push(version, draft_version=details.get("draft_version"))
        pending = bool(details.get("probe_pending"))
        details.setdefault("level", verification_level(*details.pop("checks", [])))
        return SyncReport(version, stats["tensors"], stats["buckets"], stats["bytes"], time.perf_counter() - t0,
                          verified=self.verify and not pending, checked=checked, method=f"vllm-{kind}",
                          details=details)

    def finalize(self, target: Any, report: SyncReport) -> SyncReport:
        """Run a probe deferred because the KV cache was released during the push (core calls
        this once the backend is resumed). A mismatch marks the engine's weights unknown."""
        if not report.details.get("probe_pending"):
            return report
        try:
            checked = self._probe(target)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            target.fail_push(reason)
            raise WeightSyncError(f"vllm {self.transport} push of version {report.version} failed its probe after "
                                  f"the engine resumed: {reason}", receiver_version=None) from exc
        report.details["probe_pending"] = False
        report.details["level"] = verification_level(
            *[c for c in report.details.get("level", "").split("+") if c in LEVEL_CHECKS], "probe")
        report.verified = True
        report.checked = checked
        return report

    def _sent_slots(self) -> Any:
        """The slots a push's bucket fills checksum into (None when not verifying)."""
        return self._sent.start() if self._sent is not None else None

    def _push_shm(self, weights, target, version: int, stats: dict[str, int], *, cuda: bool | None = None,
                  learn_direct: bool = False) -> tuple[int, dict[str, Any]]:
        """The worker path: ``shm`` (buckets in shared host memory) or ``cuda_ipc`` (buckets on the
        trainer's GPU, opened by the worker through CUDA IPC); the checks are the same.
        ``learn_direct``: the worker also learns the direct copies of ``mapped``."""
        cuda = self.transport == "cuda_ipc" if cuda is None else cuda
        if cuda:
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError("vllm.transport 'cuda_ipc' needs the trainer on a CUDA GPU (engine.device=cuda); "
                                   "use 'shm' otherwise")
            device = torch.device("cuda", torch.cuda.current_device())
            buckets = iter_buckets(weights, self.bucket_bytes, device=device, checksums=self._sent_slots())
        else:
            if self.pool is None:
                self.pool = SharedBucketPool()
            buckets = iter_buckets(weights, self.bucket_bytes, device="cpu", allocator=self.pool.allocate,
                                   checksums=self._sent_slots())
        pool = self.pool
        # seconds per phase: trainer side (fill = export + copy into shared memory, checksum,
        # rpc = each bucket's collective_rpc round trip), worker side (summed over workers' calls:
        # check_map, verify, load = vLLM's loaders, detach), begin/finish (layerwise reload set-up
        # and finalisation); rpc minus the worker's own time is the RPC's transfer overhead
        phases = dict.fromkeys(("begin", "fill", "checksum", "rpc", "finish", "commit"), 0.0)
        worker: dict[str, float] = {}
        tb = time.perf_counter()
        skip_draft = skips_draft(self.settings, version)
        workers = target.rpc("rlcore_begin_update", {"version": version, "skip_draft": skip_draft,
                                                     "verify": self.verify, "learn_direct": learn_direct})
        phases["begin"] = time.perf_counter() - tb
        sent: dict[str, int] = {}
        # (the bucket's names, a worker's checksums of them) for every bucket and worker: compared once all are sent
        received: list[tuple[list[str], dict[str, int]]] = []
        pending_copies = 0
        t_load = 0.0
        try:
            for bucket in timed(buckets, phases, "fill"):
                if self._sent is not None:
                    self._sent.record(bucket)
                t1 = time.perf_counter()
                if cuda:
                    torch.cuda.current_stream().synchronize()  # the bucket's copies are done before the worker reads
                    # the worker copies what it keeps and synchronises before returning: the buffer is free
                    results = target.rpc("rlcore_load_bucket", cuda_bucket_request(bucket, self.verify))
                else:
                    seg = pool.segment_of(bucket.buffer)
                    results = target.rpc("rlcore_load_bucket", bucket_request(bucket, seg.path, seg.capacity,
                                                                              self.verify))
                    pool.release(bucket.buffer)
                t_load += time.perf_counter() - t1
                for res in results:
                    pending_copies += int(res.get("pending_copies", 0))
                    for k, v in res.get("seconds", {}).items():
                        worker[k] = worker.get(k, 0.0) + float(v)
                    if self.verify:
                        received.append((bucket.names, {k: int(v) for k, v in res["checksums"].items()}))
                stats["bytes"] += bucket.nbytes
                stats["tensors"] += len(bucket.metas)
                stats["buckets"] += 1
            phases["rpc"] = t_load
            if cuda:
                torch.cuda.ipc_collect()  # the workers closed their handles: free the buckets' memory
            if self._sent is not None:
                tc = time.perf_counter()
                sent = self._sent.values()  # one read for the push
                phases["checksum"] = time.perf_counter() - tc
            mismatched = [n for names, got in received for n in verify_checksums({k: sent[k] for k in names}, got)]
            tfin = time.perf_counter()
            finish = target.rpc("rlcore_finish_update", {"version": version})
            phases["finish"] = time.perf_counter() - tfin
            # every check before the commit: the workers refuse to compute until it
            if mismatched:
                raise RuntimeError(f"{len(mismatched)} tensor(s) arrived in the worker with other bytes than sent "
                                   f"(e.g. {sorted(set(mismatched))[:3]})")
            check_finish_reports(finish)
            read_back = (check_read_back(sent, finish) if self.verify
                         else {"read_back": 0, "not_loaded": 0, "unreadable": {}})
            draft = draft_details(finish, target, version, skip_draft)
            tcommit = time.perf_counter()
            committed = target.rpc("rlcore_commit_update", {"version": version})
            phases["commit"] = time.perf_counter() - tcommit
        except BaseException as exc:
            if pool is not None:
                pool.release_all()
            try:  # the workers keep refusing, naming the partial version and why
                target.rpc("rlcore_abort_update", {"reason": f"{type(exc).__name__}: {exc}"[:500]})
            except Exception:  # noqa: BLE001 - the original error is the one to report
                pass
            raise
        exact = (self.verify and not read_back["unreadable"]
                 and read_back["read_back"] + read_back["not_loaded"] == len(sent))
        checks = (["coverage"] if all(w.get("coverage") for w in workers) else []) + (["exact"] if exact else [])
        details = {**draft, "workers": len(workers), "rpc_load_seconds": t_load, "pending_copies": pending_copies,
                   "phases": loader_push_phases(phases, worker, len(workers)), "loader_phases": phases,
                   "worker_phases": worker, "read_back": read_back["read_back"],
                   "unreadable": dict(list(read_back["unreadable"].items())[:10]),
                   "checks": checks, "tied_refreshed": sorted({n for f in finish for n in f.get("refreshed", [])}),
                   "shm_resident_bytes": pool.resident_bytes if pool is not None else 0,
                   "moe_fix": any(w.get("moe_fix") for w in workers)}
        if learn_direct:
            reports = [f.get("direct") or {} for f in finish]
            ready = bool(reports) and all(r.get("ready") for r in reports) and all(c.get("direct_ready")
                                                                                   for c in committed)
            details["direct_ready"] = ready
            if not ready:
                details["direct_refused"] = next((r["reason"] for r in reports if r.get("reason")),
                                                 "a worker did not take the direct copies")
        return (len(sent) if self.verify else 0), details

    def _push_adapter(self, weights, target, version: int, stats: dict[str, int]) -> tuple[int, dict[str, Any]]:
        """A LoRA adapter push (module docstring): one directory, one load, every worker read back."""
        import torch

        phases = dict.fromkeys(PUSH_PHASES, 0.0)
        t = time.perf_counter()
        dtype = getattr(torch, target.dtype)
        # refused before anything is written: an unknown name, another shape, a partial push
        tensors = {n: v.detach().to("cpu", dtype).contiguous() for n, v in target.adapter_manifest.checked(weights)}
        phases["copy"] += time.perf_counter() - t
        t = time.perf_counter()
        expected = expected_checksums(tensors, target.adapter_scaling) if self.verify else None
        phases["sender_checksum"] = time.perf_counter() - t
        t = time.perf_counter()
        path = target.adapter_store.write(version, tensors)
        lora_id = None
        try:
            lora_id = target.load_adapter(version, path)
            phases["copy"] += time.perf_counter() - t
            t = time.perf_counter()
            held = check_held({n: tuple(v.shape) for n, v in tensors.items()}, expected, target.dtype,
                              target.adapter_report(lora_id))
            phases["receiver_checksum"] = time.perf_counter() - t
        except BaseException:
            target.discard_adapter(lora_id, path)
            raise
        t = time.perf_counter()
        target.commit_adapter(version, lora_id)  # served from the next request; the older adapter leaves vLLM
        phases["commit"] = time.perf_counter() - t
        stats.update(bytes=sum(v.numel() * v.element_size() for v in tensors.values()), tensors=len(tensors),
                     buckets=1)
        details = {"checks": held["checks"], "phases": phases, "adapter_dir": str(path), "lora_id": lora_id,
                   "lora_dtype": target.dtype, "lora_scaling": target.adapter_scaling,
                   "compared": (f"vLLM's registered adapter and its slot of the stacked LoRA buffers, against the "
                                f"trainer's tensors cast to {target.dtype}, lora_B times the scaling "
                                f"{target.adapter_scaling:g} (vLLM folds it into lora_B)"),
                   "slot_read": held["slot_read"], "slot_unreadable": held["slot_unreadable"]}
        return (len(tensors) if self.verify else 0), details

    def _push_mapped(self, weights, target, version: int, stats: dict[str, int]) -> tuple[int, dict[str, Any]]:
        """``vllm.transport: mapped``: a loader push that learns the direct copies until the worker
        holds them, then every push a direct copy out of the lent parameters (module docstring)."""
        weights = iter(weights)
        first = next(weights, None)
        if first is None:
            raise RuntimeError("the push carried no tensors")
        weights = itertools.chain([first], weights)
        cuda = first[1].device.type == "cuda"
        if not self._direct_ready:
            learn = self._direct_refused is None
            checked, details = self._push_shm(weights, target, version, stats, cuda=cuda, learn_direct=learn)
            if learn and details.get("direct_ready"):
                self._direct_ready = True
            elif learn:
                self._direct_refused = details["direct_refused"]
                warnings.warn(f"vllm.transport 'mapped': this engine cannot take direct copies "
                              f"({self._direct_refused}); every push goes through vLLM's loaders "
                              f"({'cuda_ipc' if cuda else 'shm'}), verified as before", stacklevel=2)
            if self._direct_refused:
                details["direct_refused"] = self._direct_refused
            details["path"] = "loaders"
            return checked, details
        from rlcore_ray.mapped_sync import lendable, transport_phases
        from rlcore_ray.transport import MappedSender

        pairs = lendable(weights)
        if self._mapped_sender is None:
            self._mapped_sender = MappedSender(WorkerChannel(target), verify=self.verify,
                                               timeout=float(self.settings.request_timeout_s))
        report = self._mapped_sender.send(pairs, version)  # a failed push raises (TransportError)
        phases = Phases()
        transport_phases(phases, report.details)
        stats["bytes"] += report.bytes
        stats["tensors"] += report.num_tensors
        details = dict(report.details, phases=dict(phases.seconds), path="direct",
                       checks=[c for c in report.details["level"].split("+") if c in LEVEL_CHECKS])
        details.pop("level")
        return report.checked, details

    # ------------------------------------------------------- Ray rollout replicas -----

    def _push_fleet(self, weights, fleet, version: int) -> SyncReport:
        """Into a :class:`~rlcore_ray.fleet.RolloutFleet` of vLLM replicas (``cluster.backend:
        ray``): core buckets, each ``ray.put`` once by the fleet and loaded by every replica's
        engine through the ``shm`` worker path (:mod:`rlcore_vllm.fleet_receiver`); all replicas
        finish (commit) together. Verified per replica: ``coverage`` in each replica's workers,
        ``exact`` here, every replica's checksums against the sent ones; a mismatch names the
        replica. Every replica must report the pushed version."""
        if self.transport not in ("shm", "broadcast"):
            raise WeightSyncError(f"vllm.transport {self.transport!r} cannot feed Ray rollout replicas (only 'shm' "
                                  f"and 'broadcast' do, through the fleet)", receiver_version=None)
        broadcast = self.transport == "broadcast"
        t0 = time.perf_counter()
        sent: dict[str, int] = {}
        stats = {"bytes": 0, "tensors": 0, "buckets": 0}
        phases = dict.fromkeys(("fill", "checksum", "send", "commit", "verify"), 0.0)
        n = len(fleet.replicas)
        device: Any = "cpu"
        if broadcast:  # buckets stay where the weights are (a GPU: NCCL sends them from there)
            weights = iter(weights)
            first = next(weights, None)
            if first is not None:
                device = first[1].device
                weights = itertools.chain([first], weights)
        fleet.begin_update(version)
        try:
            buckets = iter_buckets(weights, self.bucket_bytes, device=device, checksums=self._sent_slots())
            for bucket in timed(buckets, phases, "fill"):
                if self._sent is not None:
                    self._sent.record(bucket)
                ts = time.perf_counter()
                if broadcast:
                    self._broadcast_bucket(fleet, bucket)
                else:
                    fleet.receive_bucket(bucket)  # waits only when two buckets are still in flight
                phases["send"] += time.perf_counter() - ts
                stats["bytes"] += bucket.nbytes
                stats["tensors"] += len(bucket.metas)
                stats["buckets"] += 1
            tc = time.perf_counter()
            fleet.commit_update(version)  # every replica staged every bucket, then all finish
            phases["commit"] = time.perf_counter() - tc
            if self._sent is not None:
                tc = time.perf_counter()
                sent = self._sent.values()  # one read for the push
                phases["checksum"] = time.perf_counter() - tc
        except Exception as exc:
            fleet.abort_update()
            raise WeightSyncError(
                f"vllm push of version {version} into {n} Ray rollout replica(s) failed after {stats['buckets']} "
                f"bucket(s): {type(exc).__name__}: {exc}. The replicas may hold a mix of versions; they refuse to "
                f"generate until a push succeeds", receiver_version=None) from exc
        reports = [r or {} for r in fleet.commit_reports]
        checks = ["coverage"] if reports and all(r.get("coverage") for r in reports) else []
        if self.verify:
            tv = time.perf_counter()
            verify_replicas(fleet, sent, version)
            phases["verify"] = time.perf_counter() - tv
            checks.append("exact")
        details = {"level": verification_level(*checks), "replicas": n,
                   "replica_versions": list(fleet.replica_weight_versions), "phases": phases,
                   "replica_seconds": [r.get("seconds", {}) for r in reports]}
        if broadcast:
            details["broadcast_backend"] = self._broadcast_group.backend if self._broadcast_group else None
        return SyncReport(version, stats["tensors"], stats["buckets"], stats["bytes"], time.perf_counter() - t0,
                          verified=self.verify, checked=len(sent) * n, method=f"vllm-fleet-{self.transport}",
                          details=details)

    def _broadcast_bucket(self, fleet: Any, bucket: Bucket) -> None:
        """``vllm.transport: broadcast``: the bucket's names and places through the fleet, its bytes
        by one broadcast to every replica (the group is made at the first bucket of the run)."""
        import torch

        # the replicas then wait for the bytes in the group
        fleet.receive_bucket(replace(bucket, buffer=torch.empty(0, dtype=torch.uint8)))
        if self._broadcast_group is None:
            s = self.settings
            world = len(fleet.replicas) + 1
            backend = "nccl" if bucket.buffer.is_cuda else "gloo"
            self._broadcast_store = BroadcastGroup.open_store(s.nccl_master_address, s.nccl_master_port, world - 1,
                                                              backend, s.request_timeout_s)
            # gloo connects here, together with the replicas joining in their first receive_bucket
            self._broadcast_group = BroadcastGroup(self._broadcast_store, 0, world, backend, s.request_timeout_s)
        self._broadcast_group.broadcast(bucket.buffer[:tensors_extent(bucket.metas)])

    # ----------------------------------------------------------- native (GPU only) -----

    def _native_init(self, target) -> None:
        s = self.settings
        if self.transport == "ipc":
            target.weight_transfer("init", native.ipc_init_info(native.installed_ipc_init_fields()))
        else:
            self._nccl_fields = native.installed_nccl_fields()
            info = native.nccl_init_info(s.nccl_master_address, s.nccl_master_port, s.tensor_parallel_size,
                                         self.bucket_bytes, self._nccl_fields)
            # the workers block in init until the trainer joins as rank 0: run both together
            with concurrent.futures.ThreadPoolExecutor(1) as ex:
                fut = ex.submit(target.weight_transfer, "init", info)
                import torch

                self._nccl_group = native.trainer_nccl_group(s.nccl_master_address, s.nccl_master_port,
                                                             info["world_size"], torch.cuda.current_device())
                fut.result()
        self._native_ready = True

    def _send_bucket(self, target, bucket: Bucket) -> None:
        native.check_packable(bucket, self.bucket_bytes)
        if self.transport == "ipc":
            import torch

            torch.cuda.current_stream().synchronize()  # the bucket copy must be complete before the engine reads
            handle = native.cuda_ipc_handle(bucket.buffer)
            target.weight_transfer("update", native.ipc_update_info(bucket, handle, pickled=True))
            return
        import torch

        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            fut = ex.submit(target.weight_transfer, "update",
                            native.nccl_update_info(bucket, self.bucket_bytes, self._nccl_fields))
            self._nccl_group.broadcast(bucket.buffer, src=0, stream=torch.cuda.current_stream())
            fut.result()

    def _push_native(self, weights, target, version: int, stats: dict[str, int]) -> tuple[int, dict[str, Any]]:
        import torch

        if not self._native_ready:
            self._native_init(target)
        skip_draft = skips_draft(self.settings, version)
        # vllm.speculative: mtp always runs the draft phase (the target's mapper drops MTP tensors)
        draft_phase = (self.settings.draft_phase or self.settings.speculative == "mtp") and not skip_draft
        prefixes = tuple(self.settings.draft_weight_prefixes) if draft_phase else ()
        draft: list[tuple[str, Any]] = []

        def stream():
            for name, t in weights:
                if prefixes and name.startswith(prefixes):
                    draft.append((name, t.detach().clone()))
                yield name, t

        device = torch.device("cuda", torch.cuda.current_device())
        phases = [("start", stream)] + ([("start_draft", lambda: iter(draft))] if prefixes else [])
        for start, source in phases:
            target.weight_transfer(start)
            for bucket in iter_buckets(source(), self.bucket_bytes, device=device):
                self._send_bucket(target, bucket)
                if start == "start":
                    stats["bytes"] += bucket.nbytes
                    stats["tensors"] += len(bucket.metas)
                    stats["buckets"] += 1
            target.weight_transfer("finish", str(version) if start == "start" else None)
        details: dict[str, Any] = {"draft_tensors": len(draft), "checks": []}
        if target.mtp:
            if prefixes and not any(name.startswith("model.mtp_layers.") for name, _ in draft):
                raise RuntimeError("the push carried no MTP tensors (model.mtp_layers.*) for the speculative draft")
            details["draft_version"] = version if prefixes else target.draft_weight_version
            warning = check_draft_current(details["draft_version"], version, diagnostic_skip=skip_draft)
            if warning:
                details["draft_warning"] = warning
        checked = 0
        if self.verify:
            if target.kv_cache_released:
                # the probe generates, so it needs the KV cache that core restores only after
                # push() returns: core calls finalize() then, and the report stays unverified until
                details["probe_pending"] = True
            else:
                checked = self._probe(target)
                details["checks"] = ["probe"]
        return checked, details

    def _probe(self, target) -> int:
        """Compare the engine's prompt log-probs with the training engine's on one sequence."""
        if self.probe_engine is None:
            raise RuntimeError("a native-transport push is verified by a probe against the training engine, "
                               "and none was given; set sync.verify=false to push unverified")
        import torch

        vocab = int(self.probe_engine.info.vocab_size)
        ids = [(7 * i + 3) % vocab for i in range(16)]
        got = torch.tensor(target.prompt_logprobs(ids))
        want = torch.tensor(probe_logprobs(self.probe_engine, ids))
        atol = PROBE_ATOL.get(str(target.dtype), 1e-1)
        diff = float((got - want).abs().max())
        if diff > atol:
            raise RuntimeError(f"probe log-probs differ from the trainer's by {diff:.3g} > {atol} "
                               f"(serving dtype {target.dtype})")
        return len(ids) - 1

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self._broadcast_group is not None:
            self._broadcast_group.close()
            self._broadcast_group = self._broadcast_store = None
        self._mapped_sender = None  # its exports (the lent storages' handles) go with it
        if self._nccl_group is not None:
            destroy = getattr(self._nccl_group, "destroy", None)
            if callable(destroy):
                destroy()
            self._nccl_group = None


def loader_push_phases(own: dict[str, float], worker: dict[str, float], workers: int) -> dict[str, float]:
    """A loader push's seconds under :data:`rlcore.sync.PUSH_PHASES` (what the run's metrics carry
    as ``sync/<phase>_seconds``): ``copy`` the bucket fill and vLLM's loaders (layerwise reload, in
    the worker), ``sender_checksum`` reading the trainer's checksums, ``receiver_checksum`` the
    worker's of what it received, ``commit`` the finish (layerwise finalisation, read-back,
    coverage) and the commit, ``control`` the begin and each bucket's RPC less the worker's work
    in it. ``worker`` is summed over the workers, which run in parallel: divided by their count."""
    n = max(1, workers)
    inside = sum(worker.values()) / n
    return {"control": own["begin"] + max(0.0, own["rpc"] - inside),
            "copy": own["fill"] + (worker.get("check_map", 0.0) + worker.get("load", 0.0)
                                   + worker.get("detach", 0.0)) / n,
            "sender_checksum": own["checksum"], "receiver_checksum": worker.get("verify", 0.0) / n, "wait": 0.0,
            "commit": own["finish"] + own.get("commit", 0.0)}


class WorkerChannel:
    """:class:`rlcore_ray.transport.Channel` over the engine's RPC: a map message is one
    ``rlcore_mapped_push`` call on every worker, its result the reply (one worker's, or the first
    error of any; every worker must commit the same version)."""

    def __init__(self, target: VLLMBackend):
        self.target = target
        self._reply: tuple | None = None

    def send(self, msg: tuple) -> None:
        if msg[0] == "close":
            return
        results = self.target.rpc("rlcore_mapped_push", {"msg": native.to_rpc_text(msg)})
        replies = [native.from_rpc_text(r["reply"]) for r in results]
        errors = [f"worker {i}: {r[1]}" for i, r in enumerate(replies) if r[0] == "error"]
        if errors:
            self._reply = ("error", "; ".join(errors))
        elif len({r[1] for r in replies}) != 1:
            self._reply = ("error", f"the workers committed different versions {sorted({r[1] for r in replies})}")
        else:
            self._reply = replies[0]

    def recv(self, timeout: float | None) -> tuple:
        reply, self._reply = self._reply, None
        if reply is None:
            from rlcore_ray.transport import TransportError

            raise TransportError("protocol error: nothing was sent to the workers")
        return reply

    def poll(self, timeout: float = 0.0) -> bool:
        return self._reply is not None


def verify_replicas(fleet: Any, sent: dict[str, int], version: int) -> None:
    """``exact`` for a Ray fleet: every replica's checksums (its workers', of the bytes they
    loaded) equal the sent ones; the first replica that differs is named."""
    n = len(fleet.replicas)
    for i, got in enumerate(fleet.replica_checksums(sent.keys())):
        bad = verify_checksums(sent, got)
        if bad:
            raise WeightSyncError(f"rollout replica {i} of {n}: {len(bad)} of {len(sent)} tensors hold other bytes "
                                  f"than the trainer sent for version {version} (e.g. {bad[:3]})",
                                  receiver_version=None)


def draft_details(finish: list[dict[str, Any]], target: VLLMBackend, version: int, skip: bool) -> dict[str, Any]:
    """The draft's part of a shm push, from every worker's finish report: its coverage (every
    draft parameter but those shared with the target loaded) and its weight version, which must
    be ``version`` now (:func:`~rlcore_vllm.speculative.check_draft_current`)."""
    unserved = sum(int(f.get("draft_tensors_unserved", 0)) for f in finish)
    out: dict[str, Any] = {"draft_tensors_unserved": unserved} if unserved else {}
    if not any(f.get("has_draft") for f in finish):
        if target.mtp:  # speculation asked for, yet no worker found the draft: never let it keep old weights
            dist, release = installed_vllm() or ("vllm", "(version unknown)")
            raise RuntimeError(f"vllm.speculative is mtp but no worker of {dist} {release} holds a speculative draft "
                               f"where rlcore-vllm looks (model_runner.drafter.model, model_runner.speculator.model): "
                               f"this vLLM keeps its draft elsewhere, so pushes cannot reach it")
        return out  # no speculative draft in this engine (MTP tensors, if any, are counted above)
    short = [f for f in finish if f.get("draft_num_missing")]
    if short and not skip:
        f = short[0]
        raise RuntimeError(f"the push did not reach {f['draft_num_missing']} of the {f['draft_params']} parameters of "
                           f"the speculative draft (e.g. {f['draft_missing'][:5]}): the draft would keep older weights")
    if not skip and not all(f.get("draft_received") for f in finish):
        raise RuntimeError("the push carried no MTP tensors (model.mtp_layers.*) for the speculative draft: the "
                           "training engine does not export them, so the draft would keep its start weights")
    versions = [f.get("draft_version") for f in finish]
    draft_version = min((v if v is not None else target.start_version) for v in versions)
    out.update({"draft_version": draft_version, "draft_tensors": sum(int(f.get("draft_received", 0)) for f in finish),
                "draft_tensors_skipped": sum(int(f.get("draft_tensors_skipped", 0)) for f in finish)})
    warning = check_draft_current(draft_version, version, diagnostic_skip=skip)
    if warning:
        out["draft_warning"] = warning
    return out


def probe_logprobs(engine: Any, ids: list[int]) -> list[float]:
    """The training engine's log-probs of ``ids[1:]`` (plain softmax of its LM head, fp32)."""
    import torch
    from rlcore.batch import PackedBatch

    batch = PackedBatch.pack([ids], [1])
    with torch.no_grad():
        out = engine.forward(batch)
        head = engine.head()
        logits = out.hidden.float() @ head.weight[: head.vocab.vocab_size].float().t()
        lp = torch.log_softmax(logits, dim=-1)
        labels = torch.tensor(ids[1:], device=lp.device)
        return lp[: len(ids) - 1].gather(1, labels[:, None]).squeeze(1).cpu().tolist()


def build_sync(ctx: Any) -> VLLMWeightSync:
    settings = ctx.settings if ctx.settings is not None else VLLMSettings()
    check_settings(settings)
    cfg = ctx.config
    transport = choose_transport(settings, cfg)
    if transport == "mapped" and Cap.EXPORTS_OWN_PARAMETERS not in set(getattr(ctx, "engine_capabilities", ())):
        if settings.transport == "mapped":
            raise ConfigError(f"bad value for config key 'vllm.transport': 'mapped' lends the trainer's own parameters, "
                              f"and engine {cfg.engine.name!r} does not declare "
                              f"{Cap.EXPORTS_OWN_PARAMETERS!r} (its export computes tensors: gathered, fused or "
                              f"cast); use 'cuda_ipc' or 'auto'", key="vllm.transport")
        transport = "cuda_ipc"  # auto: the loaders' path is this engine's
    return VLLMWeightSync(int(cfg.sync.bucket_mb * MB), verify=bool(cfg.sync.verify),
                          transport=transport, settings=settings, probe_engine=ctx.engine)

