"""The two ends of a cross-process weight push: :class:`WeightSender` (the trainer rank that
sends) and :class:`WeightReceiver` (the rollout side, driving any
:class:`rlcore.types.BucketReceiver`)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

from rlcore.errors import WeightSyncError
from rlcore.sync import Bucket, TensorMeta, WeightManifest, iter_buckets, tensor_checksum, verification_level
from rlcore.transport.planes import ReceiverPlane, SenderPlane
from rlcore.transport.protocol import (
    Channel,
    Phases,
    SlotLedger,
    TransportError,
    dtype_name,
    dtype_of,
    expect,
    split_oversize,
)
from rlcore.types import SyncReport

MB = 1 << 20


class SenderAborted(WeightSyncError):
    """The sender aborted the push (its export failed, or it gave up)."""


class WeightSender:
    """Streams ``(HF name, tensor)`` pairs into ``num_slots`` fixed buffers of ``slot_bytes`` and
    lends each filled buffer to the receiver until it hands it back.

    * Memory: the buffers are all the sender ever allocates for a push (a tensor larger than a
      buffer goes in pieces), so with a streaming export (one gathered tensor at a time) the peak
      extra memory is ``num_slots × slot_bytes`` plus the tensor being gathered.
    * Overlap: while the receiver reads buffer ``i`` the sender fills buffer ``i+1``; with every
      buffer lent it waits for a ``release``. ``num_slots=1`` serialises the two.
    * Verification (``verify``): a checksum of every bucket's bytes
      (:func:`rlcore.sync.tensor_checksum`) is compared by the receiver with the bytes it reads
      (level ``exact``); the receiver's manifest adds ``coverage``. A bucket overwritten before
      it was read would fail here.
    * ``fused_fill``: a bucket's tensors are copied into it in one fused launch when it is full
      (:func:`rlcore.sync.iter_buckets` ``defer_copies``), which matters on a GPU with thousands
      of small (expert) tensors; it holds a bucket's source tensors until then.
    * Versions: every push carries ``version``; the receiver's target commits it only when every
      bucket arrived and verified, and aborts otherwise.
    """

    def __init__(self, channel: Channel, plane: SenderPlane, slot_bytes: int, *, num_slots: int = 2,
                 verify: bool = True, timeout: float | None = 600.0, fused_fill: bool = False):
        if slot_bytes < 1:
            raise ValueError(f"slot_bytes must be >= 1, got {slot_bytes}")
        self.channel, self.plane = channel, plane
        self.slot_bytes, self.num_slots = int(slot_bytes), int(num_slots)
        self.verify, self.timeout = bool(verify), timeout
        self.fused_fill = bool(fused_fill)
        self.ledger = SlotLedger(self.num_slots)
        self.slot_waits = 0  # fills that had to wait for a hand-back (this push)

    # the slot a bucket lives in (iter_buckets hands back prefix views of the buffers)
    def _slot_of(self, buffer: torch.Tensor) -> int:
        ptr = buffer.data_ptr()
        for i, b in enumerate(self.plane.buffers):
            if b.data_ptr() == ptr:
                return i
        raise TransportError("a bucket outside the transport's buffers")

    def _handle(self, msg: tuple) -> None:
        if msg[0] == "error":
            raise TransportError(f"the receiver failed: {msg[1]}")
        if msg[0] != "release":
            raise TransportError(f"protocol error: expected release from the receiver, got {msg[0]!r}")
        self.ledger.hand_back(msg[1])

    def _allocate(self, nbytes: int, device: Any, phases: Phases) -> torch.Tensor:
        """``iter_buckets`` allocator: a free slot, waiting for hand-backs when all are lent."""
        with phases("wait_slot"):
            while self.channel.poll(0):  # take every hand-back already in
                self._handle(self.channel.recv(None))
            slot = self.ledger.take()
            if slot is None:
                self.slot_waits += 1
            while slot is None:
                self._handle(self.channel.recv(self.timeout))
                slot = self.ledger.take()
        self.plane.before_fill(slot)
        return self.plane.buffers[slot][:nbytes]

    def send(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncReport:
        """Push every tensor of ``weights`` as ``version``; returns when the receiver committed it.
        Raises :class:`~rlcore.errors.WeightSyncError` (the receiver then holds its previous
        version, or, if it died, an unknown one)."""
        t0 = time.perf_counter()
        phases = Phases()
        self.plane.open(self.num_slots, self.slot_bytes)
        self.ledger.reset()
        self.slot_waits = 0
        parts: dict[str, tuple] = {}
        ntensors = nbuckets = nbytes = 0
        try:
            self.channel.send(("begin", int(version), self.plane.describe(), self.slot_bytes, self.num_slots))
            ready = expect(self.channel, ("ready",), self.timeout, "receiver")
            self.plane.on_ready(ready[2])
            stream = split_oversize(weights, self.slot_bytes, parts)
            buckets = iter_buckets(stream, self.slot_bytes, device=self.plane.device, group_by_dtype=False,
                                   defer_copies=self.fused_fill, allocator=lambda n, dev: self._allocate(n, dev, phases))
            while True:
                with phases("fill"):  # export (gathers included) + copies into the buffer
                    bucket = next(buckets, None)
                if bucket is None:
                    break
                slot = self._slot_of(bucket.buffer)
                self.plane.after_fill(slot)
                checksum = None
                if self.verify:
                    with phases("checksum"):
                        checksum = tensor_checksum(bucket.buffer)
                tensors = [(m.name, dtype_name(m.dtype), list(m.shape), m.offset, m.nbytes) for m in bucket.metas]
                mine = {m.name: parts.pop(m.name) for m in bucket.metas if m.name in parts}
                self.ledger.lend(slot)
                with phases("publish"):
                    self.channel.send(("bucket", nbuckets, slot, bucket.nbytes, tensors, mine, checksum))
                    self.plane.publish(slot, bucket.nbytes)
                # a tensor in pieces counts once, with its last piece
                ntensors += sum(1 for m in bucket.metas
                                if m.name not in mine or mine[m.name][3] + m.nbytes == mine[m.name][4])
                nbuckets += 1
                nbytes += bucket.nbytes
            with phases("end"):
                self.channel.send(("end", int(version), ntensors, nbuckets, nbytes))
                while True:
                    msg = self.channel.recv(self.timeout)
                    if msg[0] == "done":
                        break
                    self._handle(msg)
        except BaseException as exc:
            reason = f"{type(exc).__name__}: {exc}"
            self._abort(int(version), reason)
            if isinstance(exc, TransportError):
                raise
            raise WeightSyncError(f"push of version {version} failed on the sender after {nbuckets} bucket(s): "
                                  f"{reason}; the receiver aborts and keeps its previous version") from exc
        _, _, level, checked, receiver_phases = msg
        details = {"level": level, "transport": self.plane.kind, "slot_bytes": self.slot_bytes,
                   "num_slots": self.num_slots, "max_lent": self.ledger.max_lent,
                   "slot_waits": self.slot_waits,
                   "sender_phases": phases.as_dict(), "receiver_phases": receiver_phases}
        return SyncReport(int(version), ntensors, nbuckets, nbytes, time.perf_counter() - t0,
                          verified=self.verify, checked=checked, method=f"transport-{self.plane.kind}",
                          details=details)

    def _abort(self, version: int, reason: str) -> None:
        """Tell the receiver to abort (or, having failed itself, to stop skipping this push) and
        read up to its ``aborted``, so that no message of this push is left for the next."""
        try:
            self.channel.send(("abort", version, reason))
            while self.channel.recv(min(self.timeout or 30.0, 30.0))[0] != "aborted":
                pass
        except TransportError:  # a dead or silent receiver: the push failed anyway
            pass

    def close(self) -> None:
        self.plane.close()


class WeightReceiver:
    """Serves pushes into ``target`` (anything with ``begin_update(version)``,
    ``receive_bucket(bucket)``, ``commit_update(version)``, ``abort_update()``, i.e. a
    :class:`rlcore.types.BucketReceiver`).

    ``receive_bucket`` gets an :class:`rlcore.sync.Bucket` whose buffer is the sender's slot (or
    this receiver's copy of it): the target must copy what it keeps before returning (on a GPU:
    enqueue the copy on the current stream); the slot is handed back right after. A tensor sent
    in pieces is reassembled here and delivered as a bucket of its own.

    ``manifest`` (or the target's ``weight_manifest()``): every name and shape is checked before
    its bucket is delivered, and a push that misses a tensor is aborted at ``end``.
    """

    def __init__(self, channel: Channel, plane: ReceiverPlane, *, manifest: WeightManifest | None = None,
                 timeout: float | None = 600.0, device: torch.device | str | None = None):
        self.channel, self.plane, self.manifest = channel, plane, manifest
        self.timeout = timeout
        self.device = device  # where reassembled pieces live (default: the slot's device)

    def serve(self, target: Any, pushes: int | None = None) -> list[dict[str, Any]]:
        """Serve ``pushes`` pushes (``None``: until the channel closes); returns their summaries."""
        done: list[dict[str, Any]] = []
        while pushes is None or len(done) < pushes:
            try:
                msg = self.channel.recv(None)
            except TransportError:
                if pushes is None:
                    return done
                raise
            if msg[0] == "close":
                return done
            if msg[0] == "abort":  # the abort that follows a push this side already failed
                self.channel.send(("aborted", msg[1]))
                continue
            if msg[0] != "begin":
                raise TransportError(f"protocol error: expected begin from the sender, got {msg[0]!r}")
            done.append(self.serve_one(target, msg))
        return done

    def serve_one(self, target: Any, begin: tuple) -> dict[str, Any]:
        _, version, desc, slot_bytes, num_slots = begin
        phases = Phases()
        manifest = self.manifest
        if manifest is None and callable(getattr(target, "weight_manifest", None)):
            manifest = target.weight_manifest()
        received: list[str] = []
        pieces: dict[str, list] = {}  # name -> [reassembly buffer, bytes filled]
        verified = 0
        try:
            reply = self.plane.attach(desc)
            target.begin_update(version)
        except Exception as exc:
            self._fail(exc, aborted_by_sender=False)
            raise
        self.channel.send(("ready", version, reply))
        try:
            while True:
                with phases("wait"):
                    msg = self.channel.recv(self.timeout)
                kind = msg[0]
                if kind == "abort":
                    raise SenderAborted(f"the sender aborted the push of version {version}: {msg[2]}",
                                        receiver_version=None)
                if kind == "end":
                    break
                if kind != "bucket":
                    raise TransportError(f"protocol error: expected bucket/end from the sender, got {kind!r}")
                _, index, slot, nbytes, tensors, parts, checksum = msg
                real = [(parts[n][0], parts[n][2]) if n in parts else (n, shape) for n, _, shape, _, _ in tensors]
                with phases("fetch"):  # first: on a dist plane the sender is in this bucket's broadcast
                    view = self.plane.fetch(slot, nbytes)
                if manifest is not None:
                    manifest.check(real)
                metas = [TensorMeta(n, tuple(shape), dtype_of(dt), off, nb) for n, dt, shape, off, nb in tensors
                         if n not in parts]
                with phases("load"):
                    if metas:
                        target.receive_bucket(Bucket(index, metas[0].dtype, view, metas))
                    for n, _, _, off, nb in tensors:
                        if n in parts:
                            whole = self._piece(pieces, parts[n], view[off:off + nb])
                            if whole is not None:
                                target.receive_bucket(whole)
                if checksum is not None:
                    # after the load (stream-ordered after it on a GPU): bytes that changed before
                    # or while the target read them fail here
                    with phases("verify"):
                        got = tensor_checksum(view)
                    if got != checksum:
                        raise WeightSyncError(
                            f"bucket {index} of version {version} (slot {slot}, {len(tensors)} tensors, e.g. "
                            f"{[t[0] for t in tensors[:3]]}) arrived with other bytes than sent: its buffer was "
                            f"overwritten or corrupted in transit", receiver_version=None)
                    verified += 1
                self.plane.finished(slot)
                self.channel.send(("release", slot, index))
                received += [name for name, _ in real if name not in pieces]
            _, _, ntensors, nbuckets, _ = msg
            names = list(dict.fromkeys(received))
            if len(names) != ntensors:
                raise WeightSyncError(f"version {version}: the sender sent {ntensors} tensors, {len(names)} arrived",
                                      receiver_version=None)
            if pieces:
                raise WeightSyncError(f"version {version}: tensors sent in pieces never completed: {sorted(pieces)}",
                                      receiver_version=None)
            if manifest is not None:
                manifest.check_complete(names)
            with phases("commit"):
                target.commit_update(version)
        except BaseException as exc:
            try:
                target.abort_update()
            finally:
                self._fail(exc, aborted_by_sender=isinstance(exc, SenderAborted))
            raise
        checks = (["coverage"] if manifest is not None else []) + (["exact"] if verified == nbuckets else [])
        level = verification_level(*checks)
        self.channel.send(("done", version, level, len(names) if verified == nbuckets else 0, phases.as_dict()))
        return {"version": version, "tensors": len(names), "buckets": nbuckets, "level": level,
                "phases": phases.as_dict()}

    def _fail(self, exc: BaseException, aborted_by_sender: bool) -> None:
        """Tell the sender, then skip the rest of this push (up to its ``abort`` or ``end``),
        still taking part in the transfer of every bucket announced meanwhile (a dist plane's
        sender is blocked in that bucket's broadcast until the receiver joins it)."""
        if aborted_by_sender:
            self.channel.send(("aborted", None))
            return
        try:
            self.channel.send(("error", f"{type(exc).__name__}: {exc}"))
            while (msg := self.channel.recv(self.timeout))[0] not in ("abort", "end"):
                if msg[0] == "bucket":
                    self.plane.discard(msg[2], msg[3])
            if msg[0] == "abort":
                self.channel.send(("aborted", msg[1]))
        except TransportError:
            pass

    def _piece(self, pieces: dict[str, list], part: tuple, data: torch.Tensor) -> Bucket | None:
        """Copy one piece into its tensor's reassembly buffer; the whole tensor when complete."""
        name, dt, shape, offset, total = part
        entry = pieces.get(name)
        if entry is None:
            entry = pieces[name] = [torch.empty(total, dtype=torch.uint8, device=self.device or data.device), 0]
        buf = entry[0]
        buf[offset:offset + data.numel()].copy_(data)
        entry[1] += data.numel()
        if entry[1] < total:
            return None
        del pieces[name]
        return Bucket(-1, dtype_of(dt), buf, [TensorMeta(name, tuple(shape), dtype_of(dt), 0, total)])


def drain(weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Consume an export stream on a rank that does not send (its gathers are collectives every
    rank must join); returns how many tensors went by."""
    n = 0
    for _ in weights:
        n += 1
    return n
