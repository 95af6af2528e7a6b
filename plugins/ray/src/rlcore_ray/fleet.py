"""Rollout replicas as Ray actors, and the fleet the writer rank talks to as one rollout backend.

:class:`RolloutReplica` is the actor: it builds ``rollout.backend`` from the run's config in its
own process and serves it. :class:`RolloutFleet` is what the writer trainer rank holds: it splits
each ``generate`` call's prompts across the replicas (contiguous, sizes differing by at most one,
every sample of a prompt on the same replica) and concatenates the answers in prompt order; it
receives weight pushes (it is a :class:`~rlcore.types.BucketReceiver` and a
:class:`~rlcore.types.DiskReceiver`) and forwards each bucket to every replica through Ray's
object store (one ``ray.put`` per bucket, read by all replicas). A replica that dies is a
:class:`~rlcore.errors.RolloutError` naming it, at once (Ray reports the actor's death); one
that does not answer within ``cluster.rollout.timeout_s`` is the same error, never a hang; an
error raised inside a replica (its engine process died, a bucket failed to load) is re-raised
naming the replica.

A backend whose weight pushes need more than the backend itself (rlcore-vllm: shared-memory
segments, its worker extension's RPCs) offers ``fleet_receiver()``, a
:class:`~rlcore.types.BucketReceiver` built in the replica; the fleet's push calls go to it.
Its ``commit_update`` may return a report (JSON-able dict), which the fleet keeps per replica
(:attr:`RolloutFleet.commit_reports`).

A Ray actor runs one call at a time, so a push sent while a replica generates would wait behind
the whole ``generate`` (and an overlapped loop that waits for the push before taking the samples
would deadlock). A replica therefore generates on a thread of its own: ``submit`` starts a request
and returns, ``collect`` waits for it at most :data:`COLLECT_WAIT_S` seconds, so a push's calls
reach the replica within that much of being sent while requests are in flight. Whether the push
may then land mid-request is the backend's own answer (``resumes_in_flight()``, e.g. the local
rollout's partial rollouts); the fleet reports it only when every replica's backend says so.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from rlcore.errors import RolloutError, WeightSyncError
from rlcore.sync import Bucket, WeightManifest
from rlcore.types import Prompt, Sample, SamplingSettings


def split_prompts(prompts: Sequence[Prompt], parts: int) -> list[list[Prompt]]:
    """Contiguous shares of ``prompts`` whose sizes differ by at most one (empty shares dropped)."""
    base, extra = divmod(len(prompts), parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        if stop > start:
            out.append(list(prompts[start:stop]))
        start = stop
    return out


def read_dir(path: str | Path) -> dict[str, bytes]:
    """Every file under ``path`` (relative name -> bytes): an HF directory shipped to another node."""
    root = Path(path)
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}


#: the longest a replica's ``collect`` call holds the actor (the longest a push waits behind a generate)
COLLECT_WAIT_S = 0.1

#: the calls of a push, which go to a replica's fleet receiver
RECEIVER_METHODS = frozenset({"begin_update", "receive_bucket", "commit_update", "abort_update", "weight_checksums",
                              "weight_manifest"})


def bucket_from_store(bucket: Bucket) -> Bucket:
    """A bucket as :meth:`RolloutFleet.receive_bucket` put it (its buffer a numpy view, read-only
    in Ray's object store) with a torch buffer over the same memory; receivers copy out of it."""
    if isinstance(bucket.buffer, torch.Tensor):
        return bucket
    with warnings.catch_warnings():  # read-only: every receiver copies out before the call returns
        warnings.simplefilter("ignore", UserWarning)
        return replace(bucket, buffer=torch.from_numpy(bucket.buffer))


def quiet_transformers() -> None:
    """No progress bar for every model load in a replica (its log goes to the driver's), as the
    trainer's run build does; transformers comes with rlcore (an ImportError probe: rlcore-ray does
    not depend on it itself)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


class RolloutReplica:
    """One rollout replica (made a Ray actor by :mod:`rlcore_ray.launch`)."""

    def __init__(self, config_yaml: str, index: int, output_dir: str):
        from rlcore.parallel.worker import stack_from_yaml
        from rlcore.types import BuildContext

        quiet_transformers()
        self.index = index
        stack = stack_from_yaml(config_yaml)
        # the backend's own config section (``vllm:`` for rlcore-vllm), as the trainer would pass it
        sections = {ps.plugin: ps.section for ps in stack.plugins.plugin_settings()}
        section = sections.get(stack.rollout_backend.plugin)
        self.backend = stack.rollout_backend.factory(BuildContext(
            config=stack.config, settings=stack.config[section] if section else None, output_dir=output_dir,
            engine=None, extras={}))
        make_receiver = getattr(self.backend, "fleet_receiver", None)
        self.receiver = make_receiver() if callable(make_receiver) else self.backend
        self._dir = tempfile.mkdtemp(prefix=f"rlcore-replica{index}-")
        self._mapped: Any = None  # the sync.name=mapped endpoint, made at the first mapped push
        self._requests: dict[int, _Request] = {}  # generate requests running on their own threads

    def where(self) -> dict[str, Any]:
        import ray

        return {"replica": self.index, "pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()}

    def capabilities(self) -> frozenset[str]:
        return frozenset(self.backend.capabilities())

    def start(self, files: dict[str, bytes], version: int) -> int:
        model_dir = Path(self._dir) / "policy_hf"
        for name, data in files.items():
            (model_dir / name).parent.mkdir(parents=True, exist_ok=True)
            (model_dir / name).write_bytes(data)
        self.backend.start(str(model_dir), version=version)
        return self.backend.weight_version

    def generate(self, prompts: list[Prompt], params: SamplingSettings) -> list[Sample]:
        return self.backend.generate(prompts, params)

    def submit(self, request: int, prompts: list[Prompt], params: SamplingSettings) -> None:
        """Start ``generate`` on a thread of its own (see the module docstring)."""
        self._requests[request] = _Request(self.backend, prompts, params)

    def collect(self, request: int, wait_s: float) -> tuple[bool, list[Sample] | None]:
        """``(True, samples)`` once request ``request`` is done (its error raised here), else
        ``(False, None)`` after at most ``wait_s`` seconds."""
        req = self._requests[request]
        if not req.done.wait(wait_s):
            return False, None
        del self._requests[request]
        if req.error is not None:
            raise req.error
        return True, req.samples

    def resumes_in_flight(self) -> bool:
        resumes = getattr(self.backend, "resumes_in_flight", None)
        return bool(resumes()) if callable(resumes) else False

    def call(self, method: str, *args: Any) -> Any:
        """Any other backend method (pause, resume, release_memory, ...); the weight-push calls
        (begin_update, receive_bucket, ...) go to the backend's fleet receiver."""
        target = self.receiver if method in RECEIVER_METHODS else self.backend
        if method == "receive_bucket":
            args = (bucket_from_store(args[0]),)
        return getattr(target, method)(*args)

    def weight_version(self) -> int:
        return self.backend.weight_version

    def _backend_metrics(self, method: str) -> dict[str, float]:
        """The backend's optional ``method()`` metrics as floats (none when it has no such method)."""
        get = getattr(self.backend, method, None)
        return {str(k): float(v) for k, v in get().items()} if callable(get) else {}

    def rollout_metrics(self) -> dict[str, float]:
        """The backend's own metrics of its last ``generate`` (none when it reports none)."""
        return self._backend_metrics("rollout_metrics")

    def memory_metrics(self) -> dict[str, float]:
        """The backend's own metrics of its last memory release (KV-cache bytes freed; none when it
        reports none)."""
        return self._backend_metrics("memory_metrics")

    def shutdown(self) -> None:
        self.backend.shutdown()

    def mapped_push(self, msg: tuple) -> tuple:
        """One ``sync.name: mapped`` push: copy out of the writer's lent parameters (its reply)."""
        if self._mapped is None:
            from rlcore_ray.mapped_sync import ReplicaEndpoint

            self._mapped = ReplicaEndpoint()
        return self._mapped.serve(self.receiver, msg)


class _Request:
    """One ``generate`` call running on its own thread in a replica."""

    def __init__(self, backend: Any, prompts: list[Prompt], params: SamplingSettings):
        self.done = threading.Event()
        self.samples: list[Sample] | None = None
        self.error: BaseException | None = None
        threading.Thread(target=self._run, args=(backend, prompts, params), daemon=True,
                         name="rlcore-replica-generate").start()

    def _run(self, backend: Any, prompts: list[Prompt], params: SamplingSettings) -> None:
        try:
            self.samples = backend.generate(prompts, params)
        except BaseException as exc:  # noqa: BLE001 - raised again by collect(), in the caller
            self.error = exc
        finally:
            self.done.set()


class RolloutFleet:
    """The replicas as one rollout backend (see the module docstring)."""

    def __init__(self, replicas: Sequence[Any], timeout_s: float = 600.0):
        if not replicas:
            raise RolloutError("a rollout fleet needs at least one replica")
        self.replicas = list(replicas)
        self.timeout_s = float(timeout_s)
        self._version = -1
        self._caps: frozenset[str] | None = None
        self._manifest: WeightManifest | None = None
        self._pending: list[list[Any]] = []  # per bucket in flight: one ack per replica
        #: what each replica's ``commit_update`` returned for the last push (None for the local rollout)
        self.commit_reports: list[Any] = []
        #: the weight version each replica reported after the last push (checked equal to it)
        self.replica_weight_versions: list[int] = []
        self._request_ids = itertools.count()
        self._resumes: bool | None = None

    # every remote call goes through here: a dead or silent replica is an error naming it. The
    # answers are taken as they come (ray.wait), so one replica's failure is reported at once,
    # not after the replicas before it have finished their shares
    def _get(self, refs: list[Any], indices: list[int], what: str) -> list[Any]:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        waiting = dict(zip(refs, indices, strict=True))
        done: dict[Any, Any] = {}
        deadline = time.monotonic() + self.timeout_s
        while waiting:
            ready, _ = ray.wait(list(waiting), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                i = min(waiting.values())
                raise RolloutError(f"rollout replica {i} of {len(self.replicas)} did not answer {what} within "
                                   f"cluster.rollout.timeout_s={self.timeout_s:g} s")
            ref = ready[0]
            i = waiting.pop(ref)
            name = f"rollout replica {i} of {len(self.replicas)}"
            try:
                done[ref] = ray.get(ref, timeout=self.timeout_s)
            except RayActorError as exc:
                detail = " ".join(str(exc).split())[:300]
                raise RolloutError(f"{name} died during {what}: {detail}") from exc
            except GetTimeoutError as exc:
                raise RolloutError(f"{name} did not answer {what} within "
                                   f"cluster.rollout.timeout_s={self.timeout_s:g} s") from exc
            except RayTaskError as exc:  # raised inside the replica: say which one, keep the kind
                cause = getattr(exc, "cause", None)
                if not isinstance(cause, BaseException):
                    cause = exc
                detail = " ".join(str(cause).split())[:600]
                msg = f"{name} failed during {what}: {type(cause).__name__}: {detail}"
                if isinstance(cause, WeightSyncError):
                    raise WeightSyncError(msg, receiver_version=None) from exc
                raise RolloutError(msg) from exc
        return [done[ref] for ref in refs]

    def _all(self, method: str, *args: Any) -> list[Any]:
        refs = [r.call.remote(method, *args) for r in self.replicas]
        return self._get(refs, list(range(len(refs))), method)

    def capabilities(self) -> frozenset[str]:
        if self._caps is None:
            caps = self._get([r.capabilities.remote() for r in self.replicas], list(range(len(self.replicas))),
                             "capabilities")
            self._caps = frozenset.intersection(*caps)
        return self._caps

    @property
    def weight_version(self) -> int:
        return self._version

    def start(self, model_dir: str, version: int = 0) -> None:
        import ray

        files = ray.put(read_dir(model_dir))  # replicas on other nodes cannot read the writer's disk
        self.replica_weight_versions = self._get([r.start.remote(files, version) for r in self.replicas],
                                                 list(range(len(self.replicas))), "start")
        self._version = version

    def generate(self, prompts: Sequence[Prompt], params: SamplingSettings) -> list[Sample]:
        shares = split_prompts(prompts, len(self.replicas))
        if not all(hasattr(self.replicas[i], "submit") for i in range(len(shares))):
            # an actor of another kind (without submit/collect): one blocking generate call each
            refs = [self.replicas[i].generate.remote(share, params) for i, share in enumerate(shares)]
            return [s for part in self._get(refs, list(range(len(refs))), "generate") for s in part]
        request = next(self._request_ids)
        self._get([self.replicas[i].submit.remote(request, share, params) for i, share in enumerate(shares)],
                  list(range(len(shares))), "generate")
        parts: dict[int, list[Sample]] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(parts) < len(shares):
            todo = [i for i in range(len(shares)) if i not in parts]
            answers = self._get([self.replicas[i].collect.remote(request, COLLECT_WAIT_S) for i in todo], todo,
                                "generate")
            parts.update({i: samples for i, (done, samples) in zip(todo, answers, strict=True) if done})
            if len(parts) < len(shares) and time.monotonic() > deadline:
                i = min(set(range(len(shares))) - set(parts))
                raise RolloutError(f"rollout replica {i} of {len(self.replicas)} did not finish generate within "
                                   f"cluster.rollout.timeout_s={self.timeout_s:g} s")
        return [s for i in range(len(shares)) for s in parts[i]]

    def resumes_in_flight(self) -> bool:
        """Whether every replica's backend resumes requests in flight on weights pushed meanwhile."""
        if self._resumes is None:
            if not all(hasattr(r, "resumes_in_flight") for r in self.replicas):
                self._resumes = False
            else:
                answers = self._get([r.resumes_in_flight.remote() for r in self.replicas],
                                    list(range(len(self.replicas))), "resumes_in_flight")
                self._resumes = all(answers)
        return self._resumes

    def rollout_metrics(self) -> dict[str, float]:
        """Per replica *i*: the weight version it reported after the last push
        (``rollout/replica{i}_weight_version``) and its backend's own metrics of its last
        ``generate``, ``rollout/<name>`` as ``rollout/replica{i}_<name>`` (vLLM's sleep/wake
        seconds and freed bytes, draft acceptance, ...).

        Kept per replica, not reduced: no one reduction fits every metric (seconds: the slowest
        replica is what the step waits for; freed bytes: a sum; acceptance: a mean weighted by
        draft rounds the fleet does not see), and per-replica values show which replica lags."""
        out = {f"rollout/replica{i}_weight_version": float(v) for i, v in enumerate(self.replica_weight_versions)}
        return {**out, **self._per_replica("rollout_metrics")}

    def _per_replica(self, method: str) -> dict[str, float]:
        """Every replica's ``method()`` metrics (replicas without the method left out),
        ``rollout/<name>`` as ``rollout/replica{i}_<name>``."""
        reporting = [i for i, r in enumerate(self.replicas) if hasattr(r, method)]
        answers = self._get([getattr(self.replicas[i], method).remote() for i in reporting], reporting,
                            method) if reporting else []
        return {f"rollout/replica{i}_{name.removeprefix('rollout/')}": float(v)
                for i, metrics in zip(reporting, answers, strict=True) for name, v in metrics.items()}

    def memory_metrics(self) -> dict[str, float]:
        """Each replica backend's metrics of its last memory release (core reads them after the
        release before a push: vLLM's KV-cache bytes freed), ``rollout/<name>`` as
        ``rollout/replica{i}_<name>``, kept per replica like :meth:`rollout_metrics`."""
        return self._per_replica("memory_metrics")

    def pause(self) -> None:
        self._all("pause")

    def resume(self) -> None:
        self._all("resume")

    def release_memory(self, tags: frozenset[str]) -> None:
        self._all("release_memory", tags)

    def resume_memory(self, tags: frozenset[str]) -> None:
        self._all("resume_memory", tags)

    def reset_prefix_cache(self) -> None:
        self._all("reset_prefix_cache")

    def shutdown(self) -> None:
        try:
            self._all("shutdown")
        except RolloutError:
            pass  # a replica already gone has nothing left to shut down

    # ------------------------------------------------------------ receiving (sync) ---------

    def weight_manifest(self) -> WeightManifest:
        if self._manifest is None:
            self._manifest = self._get([self.replicas[0].call.remote("weight_manifest")], [0], "weight_manifest")[0]
        return self._manifest

    def begin_update(self, version: int) -> None:
        self._all("begin_update", version)
        self._pending = []

    def receive_bucket(self, bucket: Bucket) -> None:
        import ray

        # at most two buckets in flight: wait for every replica to have staged the one before the
        # last before putting a new one, so the object store holds ~2 buckets, not the model
        while len(self._pending) >= 2:
            self._get(self._pending.pop(0), list(range(len(self.replicas))), "receive_bucket")
        # one copy in the object store for all; a numpy view goes in without a copy on this side (a
        # torch tensor is pickled first: measured two more private copies of the bucket, ~3.5
        # buckets of extra memory per push instead of ~1)
        ref = ray.put(replace(bucket, buffer=bucket.buffer.cpu().numpy()))
        self._pending.append([r.call.remote("receive_bucket", ref) for r in self.replicas])

    def commit_update(self, version: int) -> None:
        pending, self._pending = self._pending, []
        for acks in pending:
            self._get(acks, list(range(len(self.replicas))), "receive_bucket")
        self.commit_reports = self._all("commit_update", version)  # all stage first, then all commit
        versions = self.replica_versions()
        for i, v in enumerate(versions):
            if v != version:
                raise WeightSyncError(f"rollout replica {i} of {len(self.replicas)} reports weight version {v} after "
                                      f"the push of version {version}", receiver_version=None)
        self.replica_weight_versions = versions
        self._version = version

    def abort_update(self) -> None:
        self._pending = []
        try:
            self._all("abort_update")
        except RolloutError:
            pass  # the push fails anyway; the error that made it fail is the one to report

    def load_from_disk(self, model_dir: str, version: int) -> None:
        self._all("load_from_disk", model_dir, version)
        self._version = version

    def weight_checksums(self, names: Any = None) -> dict[str, int]:
        """Replica 0's checksums, after checking every other replica holds the same."""
        names = list(names) if names is not None else None
        sums = self._all("weight_checksums", names)
        for i, other in enumerate(sums[1:], start=1):
            bad = sorted(n for n in sums[0] if other.get(n) != sums[0][n])
            if bad:
                raise WeightSyncError(f"rollout replica {i} holds other weights than replica 0 after the push "
                                      f"({len(bad)} tensors differ, e.g. {bad[:3]})", receiver_version=None)
        return sums[0]

    def replica_checksums(self, names: Any = None) -> list[dict[str, int]]:
        """Every replica's checksums of the named tensors (replica *i* at index *i*)."""
        return self._all("weight_checksums", list(names) if names is not None else None)

    def replica_versions(self) -> list[int]:
        """The weight version every replica reports (replica *i* at index *i*)."""
        refs = [r.weight_version.remote() for r in self.replicas]
        return self._get(refs, list(range(len(refs))), "weight_version")

    # --------------------------------------------- sync.name: mapped (rlcore_ray/mapped_sync.py) ---

    def mapped_fleet(self) -> RolloutFleet:
        """This fleet, for :class:`~rlcore_ray.mapped_sync.MappedFleetSync` (reached through
        the trainer's wrappers of the rollout backend)."""
        return self

    def where(self) -> list[dict[str, Any]]:
        """Each replica's process and Ray node."""
        return self._get([r.where.remote() for r in self.replicas], list(range(len(self.replicas))), "where")

    def note_version(self, version: int) -> None:
        """A push that reached every replica by another way than this fleet's bucket calls."""
        self._version = version
