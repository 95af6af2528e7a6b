"""The built-in weight syncs: ``inproc`` (buckets straight into an in-process receiver; a receiver
that loads in place, ``lands_directly()``, takes the sender's tensors themselves, a bucket's worth
at a time, so a push copies the bytes once) and
``disk`` (safetensors in HF names, then a reload); ``inproc`` with ``sync.delta`` sends only what
changed since the receiver's version (:mod:`rlcore.delta`). Both stream the engine's export through the
core bucket builder and version every push. Verification (``details["level"]``, see
:mod:`rlcore.sync`): ``coverage`` where the receiver has a ``weight_manifest()`` (every tensor it
holds arrived with its shape; the local receiver also refuses a wrong shape or a partial push
before swapping anything in) and ``exact`` with ``verify`` (checksums of what the receiver holds
after the push equal the sent ones). A push that fails midway raises and leaves the receiver on
its previous version."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlcore.checksums import warm_checksum_kernels
from rlcore.delta import DeltaEncoder, DeltaPlan
from rlcore.errors import WeightSyncError
from rlcore.platforms import run_device
from rlcore.sync import Bucket, Phases, SentChecksums, check_after_push, iter_buckets, prune_versions
from rlcore.types import BucketReceiver, DiskReceiver, RolloutBackend, SyncReport, implements

MB = 1 << 20


def _device_sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class _Tally:
    """What a push has streamed so far (and, verifying, the slots of what it sent)."""

    phases: Phases
    checksums: SentChecksums | None = None  # None: not verifying
    shapes: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    nbytes: int = 0
    ntensors: int = 0
    nbuckets: int = 0

    def buckets(self, weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
        """The buckets, each filled by one copy-and-checksum launch when verifying (the sums stay
        on the device until :meth:`sent`): no wait per bucket."""
        slots = self.checksums.start() if self.checksums is not None else None
        stream = iter(iter_buckets(weights, bucket_bytes, checksums=slots))
        while True:
            with self.phases("copy"):
                bucket = next(stream, None)
            if bucket is None:
                return
            if self.checksums is not None:
                self.checksums.record(bucket)
            yield from self._counted(bucket, [(m.name, m.shape) for m in bucket.metas], bucket.nbytes)
            del bucket  # not held while the next one fills (peak: the open bucket and the one received)

    def groups(self, weights: Iterable[tuple[str, torch.Tensor]],
               bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The sender's own tensors, a bucket's worth at a time, for a receiver that copies them
        straight into its weights (no bucket, no copy on this side); verifying, each group's
        checksums are queued as it goes (read once, by :meth:`sent`)."""
        if self.checksums is not None:
            self.checksums.start()
        group: list[tuple[str, torch.Tensor]] = []
        nbytes = 0
        for name, t in weights:
            t = t.detach()
            group.append((name, t))
            nbytes += t.numel() * t.element_size()
            if nbytes >= bucket_bytes:
                yield from self._sent_group(group, nbytes)
                group, nbytes = [], 0
        if group:
            yield from self._sent_group(group, nbytes)

    def _sent_group(self, group: list[tuple[str, torch.Tensor]], nbytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        if self.checksums is not None:
            with self.phases("sender_checksum"):
                self.checksums.add(group)
        yield from self._counted(group, [(n, tuple(t.shape)) for n, t in group], nbytes)

    def _counted(self, item: Any, shapes: list[tuple[str, tuple[int, ...]]], nbytes: int) -> Iterator[Any]:
        """``item`` (a bucket or a group of tensors), counted once the receiver has taken it."""
        self.shapes += shapes
        yield item
        self.nbytes += nbytes
        self.ntensors += len(shapes)
        self.nbuckets += 1

    def sent(self) -> dict[str, int] | None:
        """The sender's checksums (one read of the device slots), None when not verifying."""
        if self.checksums is None:
            return None
        with self.phases("wait"):  # the queued copies and checksums complete
            _device_sync(self.checksums.slots.device)
        with self.phases("sender_checksum"):
            return self.checksums.values()


class InprocSync:
    """``inproc``: flattened buckets handed to a :class:`~rlcore.types.BucketReceiver`. With
    ``delta`` (a :class:`~rlcore.delta.DeltaEncoder`, ``sync.delta``) a push sends only what changed
    since the receiver's version, into a receiver with ``begin_delta``; verified as a full push."""

    def __init__(self, bucket_bytes: int, verify: bool = True, delta: DeltaEncoder | None = None):
        self.bucket_bytes = int(bucket_bytes)
        self.verify = verify
        # kept across pushes: the sender's checksums, one device slot per tensor, sized by the last push
        self._sent = SentChecksums() if verify else None
        self.delta = delta

    def push(self, weights: Iterable[tuple[str, torch.Tensor]], target: RolloutBackend, version: int) -> SyncReport:
        t0 = time.perf_counter()
        if self.delta is None:
            return self._push(weights, target, version, None, t0)
        if not callable(getattr(target, "begin_delta", None)):
            raise WeightSyncError(f"sync.delta is on but the receiver {type(target).__name__} cannot apply delta "
                                  f"pushes (it has no begin_delta): set sync.delta=false",
                                  receiver_version=target.weight_version)
        plan = self.delta.plan(weights, target.weight_version)
        try:
            report = self._push(plan.stream, target, version, plan, t0)
        except BaseException:
            self.delta.failed()  # what the receiver holds is not the snapshot any more: the next push is full
            raise
        self.delta.committed(plan, version)
        return report

    def _push(self, weights: Iterable[tuple[str, torch.Tensor]], target: RolloutBackend, version: int,
              plan: DeltaPlan | None, t0: float) -> SyncReport:
        if not implements(target, BucketReceiver):
            raise WeightSyncError(f"inproc sync needs a BucketReceiver backend, got {type(target).__name__}")
        before = target.weight_version
        phases = Phases()
        delta = plan is not None and not plan.full
        tally = _Tally(phases, None if delta else self._sent)  # a delta's pieces are not what is compared
        with phases("control"):
            if delta:
                target.begin_delta(version, plan.base, plan.unchanged)
            else:
                target.begin_update(version)
        # a receiver that loads in place may take the tensors themselves: one copy per push, not two
        direct = callable(getattr(target, "lands_directly", None)) and target.lands_directly()
        try:
            if direct:
                for group in tally.groups(weights, self.bucket_bytes):
                    with phases("copy"):
                        target.receive_tensors(group)
                    del group
            else:
                for bucket in tally.buckets(weights, self.bucket_bytes):
                    with phases("copy"):
                        target.receive_bucket(bucket)
                    del bucket  # the receiver copied it or keeps it: nothing here holds it
            with phases("commit"):
                target.commit_update(version)
        except Exception as exc:
            target.abort_update()
            if getattr(target, "holds_unknown_weights", False):  # it loads in place: part of the push landed
                where, now = ("it loaded part of the push in place and holds unknown weights until a push "
                              "completes"), None
            else:
                where, now = f"the receiver stays on version {target.weight_version}", before
            raise WeightSyncError(
                f"inproc push of version {version} failed after {tally.nbuckets} "
                f"{'group(s) of tensors' if direct else 'bucket(s)'}: "
                f"{type(exc).__name__}: {exc}; {where}",
                receiver_version=now,
            ) from exc
        # a delta is checked as a full push is: every tensor the trainer holds, against every one the receiver does
        sent, shapes = (self._checksums(plan.named, phases), plan.shapes) if delta else (tally.sent(), tally.shapes)
        with phases("receiver_checksum"):
            checked, level = check_after_push(target, shapes, sent, version, "inproc")
        return SyncReport(version, tally.ntensors, tally.nbuckets, tally.nbytes, time.perf_counter() - t0,
                          verified=self.verify, checked=checked, method="inproc",
                          details={"level": level, "phases": dict(phases.seconds),
                                   "landing": "direct" if direct else "buckets",
                                   **(plan.details() if plan is not None else {})})

    def _checksums(self, named: list[tuple[str, torch.Tensor]], phases: Phases) -> dict[str, int] | None:
        """The sender's checksums of ``named`` (all its tensors), None when not verifying."""
        if self._sent is None:
            return None
        self._sent.start()
        with phases("sender_checksum"):
            self._sent.add(named)
        with phases("wait"):
            _device_sync(self._sent.slots.device)
        with phases("sender_checksum"):
            return self._sent.values()

    def close(self) -> None:
        pass


class DiskSync:
    """``disk``: write ``<dir>/v<version>/model-*.safetensors`` (one file per bucket, HF names),
    then ask a :class:`~rlcore.types.DiskReceiver` to reload it. The directory appears
    atomically (written under a temporary name, then renamed); ``keep`` versions are kept."""

    def __init__(self, directory: str | Path, bucket_bytes: int, verify: bool = True, keep: int = 2):
        self.directory = Path(directory)
        self.bucket_bytes = int(bucket_bytes)
        self.verify = verify
        self.keep = keep

    def push(self, weights: Iterable[tuple[str, torch.Tensor]], target: RolloutBackend, version: int) -> SyncReport:
        from safetensors.torch import save_file

        if not implements(target, DiskReceiver):
            raise WeightSyncError(f"disk sync needs a DiskReceiver backend, got {type(target).__name__}")
        t0 = time.perf_counter()
        before = target.weight_version
        final = self.directory / f"v{version}"
        tmp = self.directory / f".v{version}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        tally = _Tally(Phases(), SentChecksums() if self.verify else None)
        try:
            for bucket in tally.buckets(weights, self.bucket_bytes):
                # safetensors refuses tensors that share storage: one copy per tensor
                save_file({n: t.clone() for n, t in bucket.tensors()},
                          str(tmp / f"model-{tally.nbuckets:05d}.safetensors"),
                          metadata={"format": "pt", "rlcore_version": str(version)})
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            target.load_from_disk(str(final), version)
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise WeightSyncError(
                f"disk push of version {version} failed: {type(exc).__name__}: {exc}; the receiver "
                f"stays on version {target.weight_version}",
                receiver_version=before,
            ) from exc
        checked, level = check_after_push(target, tally.shapes, tally.sent(), version, "disk")
        self._prune(version)
        return SyncReport(version, tally.ntensors, tally.nbuckets, tally.nbytes, time.perf_counter() - t0,
                          verified=self.verify, checked=checked, method="disk",
                          details={"path": str(final), "level": level})

    def _prune(self, version: int) -> None:
        prune_versions(self.directory, version, self.keep)

    def close(self) -> None:
        pass


def warm_for_run(ctx: Any, verify: bool) -> None:
    """Compile the checksum kernels on the run's device when the sync is set up, not in the first
    push (Triton's compile made the first verified push ~0.5 s slower on an H100)."""
    if verify:
        warm_checksum_kernels(run_device(ctx))


def build_inproc(ctx: Any) -> InprocSync:
    s = ctx.config.sync
    warm_for_run(ctx, bool(s.verify))
    delta = DeltaEncoder(float(s.delta_max_ratio), int(s.delta_full_every)) if getattr(s, "delta", False) else None
    return InprocSync(int(s.bucket_mb * MB), verify=bool(s.verify), delta=delta)


def build_disk(ctx: Any) -> DiskSync:
    warm_for_run(ctx, bool(ctx.config.sync.verify))
    out = Path(ctx.output_dir or ".") / "sync"
    return DiskSync(out, int(ctx.config.sync.bucket_mb * MB), verify=bool(ctx.config.sync.verify))
