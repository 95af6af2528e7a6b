"""The sglang weight syncs: ``sglang-tensor`` (colocated, CUDA-IPC or shared memory),
``sglang-nccl`` (a broadcast group between the trainer and the server's ranks) and
``sglang-disk`` (safetensors the server reloads).

Every push streams the engine's HF-named export through :func:`rlcore.sync.iter_buckets`
(flattened, one dtype per bucket, never splitting a tensor) and, for the tensor and NCCL paths,
runs inside SGLang's weight-update session on servers that have one (>= 0.5.21)::

    begin_weight_update(selector)
      bucket 0 .. n-2   flush_cache=False
      bucket n-1        flush_cache=True, weight_version="<version>"
    end_weight_update()

(one bucket is held back so the last one is known; older servers get the same sequence without
begin/end). A push that fails midway still closes the session and raises
:class:`~rlcore.errors.WeightSyncError`; the server then holds a mix of versions (SGLang loads in
place), which the error says.

**Coverage** (every push, level ``coverage``): each tensor's name and shape are checked against the
checkpoint the server started from before it is bucketed, and a stream that ends without every
tensor of that checkpoint fails before its last bucket is sent (a tied ``lm_head`` may be left
out). SGLang's checksum merely changing is no verification: it changes on a partial load too.

**Transport self-test and drop detection** (``sync.verify: true``) use SGLang's own ``/weights_checker``:

* once per run, before the first push: ``snapshot`` → ``reset_tensors`` (every engine tensor
  becomes random) → the checkpoint the server started from is sent again through this very
  transport → ``compare``. SGLang's comparison of its own tensors (sharded, fused, post-processed
  by its loaders) proves that this transport writes every engine tensor and writes it exactly;
* on every push: every request is acknowledged by every rank, and SGLang's ``checksum`` of its
  tensors after the push must differ from the one before whenever what was sent differs
  (rlcore's own checksums of the stream), which catches an update the server silently dropped.

Engine tensors that no HF checkpoint carries (``k_scale`` of a quantized KV cache, say) are
randomized by the reset and not restored: the comparison then names them, and
``sglang.verify_skip`` lists them for SGLang to skip (needs SGLang >= 0.5.21).
"""

from __future__ import annotations

import hashlib
import itertools
import re
import shutil
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
from rlcore.errors import ConfigError, WeightSyncError
from rlcore.sync import (
    Bucket,
    ChecksumSlots,
    SentChecksums,
    WeightManifest,
    iter_buckets,
    prune_versions,
    verification_level,
)
from rlcore.types import SyncReport
from rlcore_enginekit.serving import EngineServerError, answer_message

from rlcore_sglang import protocol, wire
from rlcore_sglang.backend import SGLangBackend
from rlcore_sglang.settings import check_settings

MB = 1 << 20
T = TypeVar("T")
_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def with_last(items: Iterable[T]) -> Iterator[tuple[T, bool]]:
    """``(item, is_last)``, holding one item back so the last is known when it is yielded."""
    it = iter(items)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield prev, False
        prev = item
    yield prev, True


def layer_key(name: str) -> str:
    """``model.layers.3.mlp.experts.7.w1.weight`` → ``model.layers.3``: one decoder layer's tensors
    stay in one bucket (per dtype) for servers that post-process fused weights per request."""
    m = _LAYER.match(name)
    return m.group(1) if m else name


def iter_checkpoint(model_dir: str | Path, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF-named tensors of a safetensors checkpoint, one at a time, on ``device``."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise WeightSyncError(f"no *.safetensors in {model_dir}: cannot re-send the checkpoint the server started from")
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name).to(device)


def stream_fingerprint(checksums: dict[str, int]) -> str:
    """An order-independent digest of rlcore's per-tensor checksums of what was sent."""
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(f"{name}={checksums[name]};".encode())
    return h.hexdigest()


class _SGLangSync(ABC):
    """What the three transports share: session, versions, verification, the report."""

    method = "sglang"
    #: whether this transport reaches SGLang's speculative draft runner (the NCCL path does not)
    reaches_draft = True

    def __init__(self, settings: Any, bucket_bytes: int, verify: bool = True, output_dir: str | None = None):
        check_settings(settings)
        self.settings = settings
        self.bucket_bytes = int(bucket_bytes)
        self.verify = bool(verify)
        self.output_dir = Path(output_dir or ".")
        self._selftest: dict[str, Any] | None = None
        self._last_fingerprint: str | None = None
        self._last_engine_checksum: str | None = None
        # the sender's checksums, summed by the copies that fill each bucket (kept across pushes)
        self._sent = SentChecksums() if self.verify else None

    # ------------------------------------------------------------------ helpers ----------

    @property
    def updates_draft(self) -> bool:
        """Whether a push reaches the speculative draft runner (transport and selector allow it)."""
        return self.reaches_draft and self.settings.selector != "target"

    def _backend(self, target: Any) -> SGLangBackend:
        if not isinstance(target, SGLangBackend):
            raise WeightSyncError(
                f"the sglang weight syncs feed the sglang rollout backend, got {type(target).__name__}; "
                "set rollout.backend: sglang",
                receiver_version=getattr(target, "weight_version", None),
            )
        if target.features is None or target.transport is None:
            raise WeightSyncError("the sglang rollout backend is not started", receiver_version=None)
        if not self.reaches_draft and target.features.speculative_algorithm \
                and not self.settings.speculative_draft_model_path:
            # a server given by sglang.url reveals its speculative algorithm only now
            raise WeightSyncError(
                f"{self.method} cannot feed this SGLang server: it drafts with {target.features.speculative_algorithm} "
                "from the policy's MTP layers, and update_weights_from_distributed loads only the target runner "
                "(sgl-project/sglang#27718), so the draft would stay at its start weights; use sglang-tensor or "
                "sglang-disk", receiver_version=target.weight_version)
        target.restore_for_push()  # weights released for training (sglang.release_for_training) come back
        if "weights" in target.released_tags:
            raise WeightSyncError(
                "SGLang's weights are released; resume_memory({'weights'}) before pushing new ones",
                receiver_version=target.weight_version,
            )
        return target

    def _call(self, backend: SGLangBackend, route: str, body: dict[str, Any] | None, what: str,
              timeout: float | None = None) -> Any:
        try:
            answer = backend.transport.call(route, body, timeout=timeout)
        except EngineServerError as exc:
            if exc.status == 404:
                raise WeightSyncError(
                    f"{what}: {backend.transport.describe()} has no route {route} "
                    f"(SGLang {protocol.version_text(backend.features.version)})", receiver_version=None
                ) from exc
            raise WeightSyncError(f"{what} failed: {exc}", receiver_version=None) from exc
        if not protocol.is_success(answer):
            raise WeightSyncError(f"{what} failed: {answer_message(answer)}", receiver_version=None)
        return answer

    def _keep_together(self, backend: SGLangBackend) -> Callable[[str], str] | None:
        mode = self.settings.keep_together
        if mode == "auto":
            mode = "none" if backend.features.weight_update_session else "layer"
        return layer_key if mode == "layer" else None

    def _checker(self, backend: SGLangBackend, action: str) -> dict[str, Any]:
        try:
            body = protocol.weights_checker_body(action, skip=list(self.settings.verify_skip),
                                                 selector=self.settings.selector, features=backend.features)
        except ValueError as exc:
            raise WeightSyncError(str(exc), receiver_version=backend.weight_version) from exc
        return self._call(backend, "/weights_checker", body, f"SGLang weights_checker {action!r}")

    def _engine_checksum(self, backend: SGLangBackend) -> tuple[str, int]:
        answer = self._checker(backend, "checksum")
        ranks = answer.get("ranks") or []
        count = sum(len(r.get("checksums") or {}) for r in ranks)
        digest = answer.get("per_engine_checksum")
        if digest is None or not count:
            raise WeightSyncError(f"SGLang's weights_checker returned no checksums: {answer}", receiver_version=None)
        return str(digest), count

    # --------------------------------------------------------------- the session --------

    def _session_call(self, backend: SGLangBackend, route: str, body: dict[str, Any]) -> None:
        self._call(backend, route, body, route.strip("/").replace("_", " "))

    def _in_session(self, backend: SGLangBackend, send: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``send()`` between begin/end on servers with the session; end is attempted even when
        ``send`` fails, so the next push can begin."""
        if not backend.features.weight_update_session:
            return send()
        self._session_call(backend, "/begin_weight_update", protocol.begin_session_body(self.settings.selector))
        try:
            stats = send()
        except BaseException as exc:
            try:
                self._session_call(backend, "/end_weight_update", {})
            except WeightSyncError as end_exc:
                exc.add_note(f"closing SGLang's weight-update session also failed: {end_exc}")
            raise
        self._session_call(backend, "/end_weight_update", {})
        return stats

    # -------------------------------------------------------------------- push -----------

    def _refuse_early(self, backend: SGLangBackend) -> None:
        """Problems a transport can see before anything is sent (the self-test resets SGLang's
        tensors first, so a transport that cannot work must say so before it). None by default."""
        return None

    @abstractmethod
    def _send(self, backend: SGLangBackend, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, Any]:
        """Move the stream into the server as ``version``; return the stats for the report."""

    def _transfer(self, backend: SGLangBackend, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, Any]:
        return self._in_session(backend, lambda: self._send(backend, weights, version))

    def _run_selftest(self, backend: SGLangBackend, device: torch.device) -> dict[str, Any]:
        t0 = time.perf_counter()
        current = backend.weight_version
        self._checker(backend, "snapshot")
        self._checker(backend, "reset_tensors")
        try:
            stats = self._transfer(backend, iter_checkpoint(backend.model_dir, device), current)
            self._checker(backend, "compare")
        except Exception as exc:
            raise WeightSyncError(
                f"{self.method} self-test failed: after SGLang's reset_tensors, re-sending the checkpoint the server "
                f"started from ({backend.model_dir}) through this transport did not restore every engine tensor "
                f"exactly: {exc}. The server now holds randomized tensors: restart it. Engine-only tensors that "
                "no checkpoint carries belong in sglang.verify_skip.",
                receiver_version=None,
            ) from exc
        digest, count = self._engine_checksum(backend)
        self._last_engine_checksum = digest
        self._last_fingerprint = stats.get("fingerprint")
        return {"engine_tensors": count, "sent_tensors": stats["tensors"], "seconds": time.perf_counter() - t0}

    @staticmethod
    def _manifest(backend: SGLangBackend) -> WeightManifest | None:
        """What the server holds, in HF names: the checkpoint it started from (``None`` when the
        backend did not start it from a local directory)."""
        model_dir = backend.model_dir
        if not model_dir or not Path(model_dir).is_dir() or not any(Path(model_dir).glob("*.safetensors")):
            return None
        return WeightManifest.from_checkpoint(model_dir, where="SGLang server")

    def push(self, weights: Iterable[tuple[str, torch.Tensor]], target: Any, version: int) -> SyncReport:
        backend = self._backend(target)
        t0 = time.perf_counter()
        before = backend.weight_version
        weights = iter(weights)
        try:
            first = next(weights)
        except StopIteration:
            raise WeightSyncError("the engine exported no weights: nothing to push", receiver_version=before) from None
        weights = itertools.chain([first], weights)
        details: dict[str, Any] = {"sglang_version": protocol.version_text(backend.features.version),
                                   "tp_size": backend.features.tp_size,
                                   "session": backend.features.weight_update_session}
        self._refuse_early(backend)
        if self.verify and self._selftest is None:
            self._selftest = self._run_selftest(backend, first[1].device)
            details["selftest"] = self._selftest
        manifest = self._manifest(backend)
        if manifest is not None:
            weights = manifest.checked(weights)
        try:
            stats = self._transfer(backend, weights, version)
        except WeightSyncError as exc:
            self._last_fingerprint = self._last_engine_checksum = None  # the server's state is unknown now
            raise WeightSyncError(
                f"{self.method} push of version {version} failed: {exc}; SGLang loads in place, so the server may "
                f"hold a mix of versions {before} and {version}: push again before generating",
                receiver_version=None,
            ) from exc
        except Exception as exc:
            self._last_fingerprint = self._last_engine_checksum = None
            raise WeightSyncError(
                f"{self.method} push of version {version} failed: {type(exc).__name__}: {exc}; the server may hold "
                f"a mix of versions {before} and {version}: push again before generating",
                receiver_version=None,
            ) from exc
        backend.set_weight_version(version, draft_updated=self.updates_draft)
        checked = 0
        if self.verify:
            digest, checked = self._engine_checksum(backend)
            fingerprint = stats.get("fingerprint")
            if fingerprint != self._last_fingerprint and digest == self._last_engine_checksum:
                raise WeightSyncError(
                    f"{self.method} push of version {version}: the weights sent differ from the last push, but "
                    f"SGLang's checksum of its {checked} tensors did not change: the server did not take them",
                    receiver_version=None,
                )
            self._last_fingerprint, self._last_engine_checksum = fingerprint, digest
            details["engine_checksum"] = digest
        details.update({k: v for k, v in stats.items() if k not in ("tensors", "buckets", "bytes", "fingerprint")})
        # SGLang's checksum changing is a sanity check, not a level: it changes on a partial load too
        details["level"] = verification_level(*(["coverage"] if manifest is not None else []))
        return SyncReport(version, stats["tensors"], stats["buckets"], stats["bytes"], time.perf_counter() - t0,
                          verified=self.verify, checked=checked, method=self.method, details=details)

    def _account(self, stats: dict[str, Any], bucket: Bucket) -> None:
        stats["tensors"] += len(bucket.metas)
        stats["buckets"] += 1
        stats["bytes"] += bucket.nbytes
        if self._sent is not None:
            self._sent.record(bucket)

    def _new_stats(self) -> tuple[dict[str, Any], ChecksumSlots | None]:
        """A push's counters, and the slots its bucket fills checksum into (None when not verifying:
        pass them to ``iter_buckets(checksums=...)``)."""
        return {"tensors": 0, "buckets": 0, "bytes": 0}, (self._sent.start() if self._sent is not None else None)

    def _finish_stats(self, stats: dict[str, Any]) -> dict[str, Any]:
        if stats["buckets"] == 0:
            raise WeightSyncError("the weight stream was empty: nothing was sent", receiver_version=None)
        if self._sent is not None:
            stats["fingerprint"] = stream_fingerprint(self._sent.values())  # one read for the push
        return stats

    def close(self) -> None:
        """Forget the verification baseline: a sync used again after close() re-runs its self-test
        (the server behind it may have been restarted)."""
        self._selftest = self._last_fingerprint = self._last_engine_checksum = None


# ------------------------------------------------------------------------ sglang-tensor ---


class SGLangTensorSync(_SGLangSync):
    """``sglang-tensor``: each bucket goes to ``/update_weights_from_tensor`` as
    ``load_format="flattened_bucket"``, one ForkingPickler payload per inference TP rank. A GPU
    bucket travels as a CUDA-IPC handle carrying the GPU's UUID (trainer and server share the
    GPUs); a CPU bucket is allocated in a named shared-memory file and travels by that name (trainer
    and server share the host). The server copies each bucket into its own weights before it
    answers, so a bucket is released once its request returns."""

    method = "sglang-tensor"

    def _send(self, backend: SGLangBackend, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, Any]:
        stats, checksums = self._new_stats()
        f = backend.features
        buckets = iter_buckets(weights, self.bucket_bytes, keep_together=self._keep_together(backend),
                               allocator=wire.shared_memory_allocator, checksums=checksums)
        used_cuda = False
        for bucket, last in with_last(buckets):
            used_cuda |= bucket.buffer.is_cuda
            payloads = wire.serialize_per_rank(wire.flattened_bucket_payload(bucket), f.tp_size)
            body = protocol.update_from_tensor_body(
                payloads, flush_cache=last, weight_version=str(version) if last else None,
                selector=self.settings.selector, features=f,
            )
            self._call(backend, "/update_weights_from_tensor", body,
                       f"bucket {bucket.index} ({len(bucket.metas)} tensors, {bucket.nbytes / MB:.1f} MiB)")
            self._account(stats, bucket)
            del payloads, body
        if used_cuda:
            torch.cuda.ipc_collect()  # release the IPC blocks the server has closed
        return self._finish_stats(stats)


# -------------------------------------------------------------------------- sglang-nccl ---


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def open_sender_group(master_address: str, master_port: int, world_size: int, group_name: str, backend: str,
                      timeout_s: float = 600.0) -> Any:
    """The trainer's end (rank 0) of the group SGLang's ranks join through
    ``init_weights_update_group``. The trainer hosts the TCP rendezvous; the store keys are
    namespaced the way SGLang's side namespaces them (a ``PrefixStore(group_name)`` around the
    rendezvous store, then torch's own per-group prefixes inside ``_new_process_group_helper``),
    so both ends find each other. The returned process group is used directly (``pg.broadcast``)
    and needs no default group in the trainer."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper

    timeout = timedelta(seconds=timeout_s)
    store, rank, world = next(dist.rendezvous(f"tcp://{master_address}:{master_port}", 0, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(world, rank, [], Backend(backend), PrefixStore(group_name, store),
                                      group_name=group_name, timeout=timeout)
    return pg


def broadcast_from_trainer(pg: Any, tensor: torch.Tensor) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    pg.broadcast([tensor], opts).wait()


def shared_gpu_problem(trainer_gpu: int, features: protocol.ServerFeatures, backend_name: str) -> str | None:
    """Why an NCCL group of the trainer and a server it launched on the same visible devices
    cannot form, or None. NCCL refuses two ranks of one communicator on one device ("Duplicate
    GPU detected", seen with SGLang 0.5.17 on one H100/H200), and only at the first broadcast."""
    if backend_name != "nccl" or trainer_gpu not in features.gpu_indices:
        return None
    return (f"sglang-nccl with sglang.nccl_backend 'nccl': the trainer's GPU cuda:{trainer_gpu} is also a GPU of the "
            f"SGLang server (devices {features.gpu_indices}), and NCCL refuses two ranks of one group on one device "
            "('Duplicate GPU detected'); on a shared GPU use sync.name 'sglang-tensor' (CUDA IPC) or "
            "sglang.nccl_backend 'gloo', or give the server other GPUs (--base-gpu-id in sglang.launch_args)")


class SGLangNCCLSync(_SGLangSync):
    """``sglang-nccl``: the trainer (rank 0) and SGLang's TP ranks (``1 .. tp_size``) form a
    group once; then every bucket is one uint8 broadcast, announced by
    ``/update_weights_from_distributed`` with ``load_format="flattened_bucket"`` and the bucket's
    names/dtypes/shapes, from which SGLang's ``FlattenedTensorBucket.empty`` recomputes the same
    contiguous layout (checked before each send). The announcement blocks until the server has
    received and loaded the bucket, so it runs in a thread while the trainer broadcasts."""

    method = "sglang-nccl"
    reaches_draft = False

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.pg: Any = None
        self._backend_ref: SGLangBackend | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlcore-sglang-nccl")
        self._lock = threading.Lock()

    def _device(self) -> torch.device:
        if self.settings.nccl_backend == "nccl":
            if not torch.cuda.is_available():
                raise WeightSyncError("sglang-nccl with nccl_backend 'nccl' needs a CUDA device in the trainer",
                                      receiver_version=None)
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _ensure_group(self, backend: SGLangBackend) -> Any:
        with self._lock:
            if self.pg is not None:
                return self.pg
            s = self.settings
            port = int(s.nccl_master_port) or free_port(s.nccl_master_address)
            world = 1 + backend.features.tp_size
            body = protocol.init_group_body(master_address=s.nccl_master_address, master_port=port, rank_offset=1,
                                            world_size=world, group_name=s.nccl_group_name, backend=s.nccl_backend)
            joining = self._pool.submit(self._call, backend, "/init_weights_update_group", body,
                                        "SGLang init_weights_update_group")
            try:
                self.pg = open_sender_group(s.nccl_master_address, port, world, s.nccl_group_name, s.nccl_backend,
                                            timeout_s=float(s.request_timeout_s))
            finally:
                joining.result(timeout=float(s.request_timeout_s))
            self._backend_ref = backend
            return self.pg

    def _refuse_early(self, backend: SGLangBackend) -> None:
        device = self._device()
        if device.type != "cuda" or self.settings.url:
            return  # a server at sglang.url may run anywhere: NCCL itself says so if it shares the GPU
        problem = shared_gpu_problem(device.index, backend.features, self.settings.nccl_backend)
        if problem:
            raise WeightSyncError(problem, receiver_version=backend.weight_version)

    def _transfer(self, backend: SGLangBackend, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, Any]:
        self._ensure_group(backend)  # outside the weight-update session: joining loads nothing
        return super()._transfer(backend, weights, version)

    def _send(self, backend: SGLangBackend, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, Any]:
        pg = self._ensure_group(backend)
        stats, checksums = self._new_stats()
        f = backend.features
        buckets = iter_buckets(weights, self.bucket_bytes, keep_together=self._keep_together(backend),
                               device=self._device(), checksums=checksums)
        for bucket, last in with_last(buckets):
            names, dtypes, shapes = wire.nccl_bucket_metadata(bucket)
            body = protocol.update_from_distributed_body(
                names, dtypes, shapes, group_name=self.settings.nccl_group_name, flush_cache=last,
                weight_version=str(version) if last else None, selector=self.settings.selector, features=f,
            )
            what = f"bucket {bucket.index} ({len(names)} tensors, {bucket.nbytes / MB:.1f} MiB)"
            announced = self._pool.submit(self._call, backend, "/update_weights_from_distributed", body, what)
            try:
                broadcast_from_trainer(pg, bucket.buffer)
            finally:
                announced.result(timeout=float(self.settings.request_timeout_s))
            self._account(stats, bucket)
        return self._finish_stats(stats)

    def close(self) -> None:
        if self.pg is not None and self._backend_ref is not None and self._backend_ref.transport is not None:
            try:
                self._call(self._backend_ref, "/destroy_weights_update_group",
                           {"group_name": self.settings.nccl_group_name}, "SGLang destroy_weights_update_group")
            except WeightSyncError:
                pass  # the server may already be gone; the group dies with it
        if self.pg is not None:
            import torch.distributed as dist

            try:
                dist.destroy_process_group(self.pg)
            except (RuntimeError, ValueError, KeyError):
                pass
            self.pg = None
        self._pool.shutdown(wait=False)
        super().close()


# -------------------------------------------------------------------------- sglang-disk ---


class SGLangDiskSync(_SGLangSync):
    """``sglang-disk``: each push becomes ``<disk_dir>/v<version>/`` (safetensors shards in HF
    names, one per bucket, next to the non-weight files of the directory the server started
    from), written under a temporary name and renamed, then ``/update_weights_from_disk`` with
    ``weight_version``. No session is needed on any version. The directory must be readable by
    the server; the last ``keep`` versions are kept."""

    method = "sglang-disk"

    def __init__(self, *args: Any, keep: int = 2, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.keep = keep
        self.directory = Path(self.settings.disk_dir) if self.settings.disk_dir else self.output_dir / "sglang_sync"

    def _transfer(self, backend: SGLangBackend, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, Any]:
        return self._send(backend, weights, version)

    def _send(self, backend: SGLangBackend, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, Any]:
        from safetensors.torch import save_file

        stats, checksums = self._new_stats()
        final = (self.directory / f"v{version}").resolve()
        tmp = self.directory / f".v{version}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            for bucket in iter_buckets(weights, self.bucket_bytes, checksums=checksums):
                tensors = {n: t.to("cpu", copy=True) for n, t in bucket.tensors()}
                save_file(tensors, str(tmp / f"model-{bucket.index:05d}.safetensors"),
                          metadata={"format": "pt", "rlcore_version": str(version)})
                self._account(stats, bucket)
            for f in Path(backend.model_dir).iterdir():
                if f.is_file() and not f.name.endswith(_WEIGHT_FILES) and f.name not in _WEIGHT_INDEXES:
                    shutil.copy2(f, tmp / f.name)
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._call(backend, "/update_weights_from_disk",
                   protocol.update_from_disk_body(str(final), weight_version=str(version)), f"loading {final}")
        self._prune(version)
        stats["path"] = str(final)
        return self._finish_stats(stats)

    def _prune(self, version: int) -> None:
        """Delete ``v<n>`` for every ``n <= version - keep``."""
        prune_versions(Path(self.directory), version, self.keep)


# ---------------------------------------------------------------------------- factories ---


def _args(ctx: Any) -> tuple[Any, int, bool, str | None]:
    if ctx.settings is None:
        raise ConfigError("the sglang weight syncs need the sglang plugin active (plugins: [sglang])", key="plugins")
    return ctx.settings, int(ctx.config.sync.bucket_mb * MB), bool(ctx.config.sync.verify), ctx.output_dir


def build_tensor_sync(ctx: Any) -> SGLangTensorSync:
    settings, bucket_bytes, verify, out = _args(ctx)
    return SGLangTensorSync(settings, bucket_bytes, verify=verify, output_dir=out)


def build_nccl_sync(ctx: Any) -> SGLangNCCLSync:
    settings, bucket_bytes, verify, out = _args(ctx)
    return SGLangNCCLSync(settings, bucket_bytes, verify=verify, output_dir=out)


def build_disk_sync(ctx: Any) -> SGLangDiskSync:
    settings, bucket_bytes, verify, out = _args(ctx)
    return SGLangDiskSync(settings, bucket_bytes, verify=verify, output_dir=out)
