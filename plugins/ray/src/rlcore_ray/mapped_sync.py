"""``sync.name: mapped``: the writer's parameters lent to its colocated rollout replicas.

The default way into a fleet of replicas (``inproc`` through :class:`~rlcore_ray.fleet.RolloutFleet`)
copies every byte into a bucket, then into Ray's object store, then into each replica. Here the
writer trainer rank lends its parameters' storages instead (:class:`~rlcore_ray.transport.MappedSender`:
CUDA IPC handles on a GPU, named shared memory on CPU), once; on every push each replica copies
straight out of them (:class:`~rlcore_ray.transport.MappedReceiver`, serving inside the replica
actor), and the writer holds no bucket at all. One control message goes to every replica at once
(:class:`FleetChannel`); the push returns when every replica has replied, i.e. finished reading,
so the optimizer step that follows cannot change bytes a replica is still reading (the lease of
:mod:`rlcore_ray.transport.mapped`). Verified, each replica's reply carries the checksums of what
it now holds (the local rollout sums them in the copy that lands them, on a GPU), and the writer
compares them with the checksums of what it lent (one kernel for all its tensors, queued before
the lend and read after the replies) and the replicas with each other (``coverage+exact``, as
``inproc``): one round trip per push, no per-tensor host work beyond the lend's own. The push's
phases (:data:`rlcore.sync.PUSH_PHASES`) go into ``SyncReport.details["phases"]``.

Where it applies, by capability (:func:`mapped_sync_spec`): the sync declares ``lends_storage``,
for which the ``ray`` launcher asks for ``cluster.placement: colocated`` and an engine that
declares ``exports_own_parameters`` (a TP/EP-gathered export has no storage worth lending; use
``inproc``); the rollout backend must declare ``staged_load`` (it stages a copy of what it is
lent, so a storage is only read while it loads). Storages cannot be mapped across hosts: the first
push compares the Ray node of the writer with each replica's. On CPU the parameters are moved
into shared memory at the first push (``share_memory_()`` moves a storage in place: the model and
the optimizer keep the same tensors).

Registration and implementation live here together; torch, the transport and Ray are imported
only by the code that runs a push, so that the plugin's ``weight_sync`` hook stays cheap.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from rlcore.errors import RolloutError, WeightSyncError
from rlcore.types import Cap, SyncReport, WeightSyncSpec

if TYPE_CHECKING:
    import torch


def mapped_sync_spec() -> WeightSyncSpec:
    """The ``mapped`` weight sync, as rlcore-ray registers it (its ``weight_sync`` hook)."""
    return WeightSyncSpec(
        name="mapped",
        factory=build_mapped,
        capabilities={Cap.VERIFIED, Cap.ATOMIC, Cap.CUDA_IPC, Cap.FEEDS_REPLICAS, Cap.LENDS_STORAGE},
        requires_backend={Cap.RECEIVE_BUCKETS, Cap.WEIGHT_CHECKSUMS, Cap.STAGED_LOAD},
        description="cluster.backend=ray, colocated replicas: parameters lent by storage, one copy per replica",
    )


class ReplyBox:
    """The replica's end of a mapped push: :meth:`MappedReceiver.serve_one` sends one reply per
    push, which the replica actor returns as its remote call's result."""

    def __init__(self) -> None:
        self.reply: tuple | None = None

    def send(self, msg: tuple) -> None:
        self.reply = msg

    def recv(self, timeout: float | None) -> tuple:
        from rlcore_ray.transport import TransportError

        raise TransportError("the replica end of a mapped push only replies (the request is the remote call)")

    def poll(self, timeout: float = 0.0) -> bool:
        return False


class ReplicaEndpoint:
    """Serves mapped pushes into one replica's rollout backend (lives in the replica actor)."""

    def __init__(self) -> None:
        from rlcore_ray.transport import MappedReceiver

        self.box = ReplyBox()
        self.receiver = MappedReceiver(self.box)

    def serve(self, target: Any, msg: tuple) -> tuple:
        """Serve one ``map`` message; ``msg[5]`` (when present and true) asks for the checksums of
        what the target holds after the push, in the layout's order, appended to the reply."""
        want_sums = len(msg) > 5 and bool(msg[5])
        self.box.reply = None
        try:
            self.receiver.serve_one(target, msg[:5])
        except Exception as exc:  # noqa: BLE001 - the reply carries it to the writer
            if self.box.reply is None:
                return ("error", f"{type(exc).__name__}: {exc}")
        reply = self.box.reply if self.box.reply is not None else ("error", "the replica sent no reply")
        if reply[0] != "mapped" or not want_sums:
            return reply
        t0 = time.perf_counter()
        names = self.receiver._names
        held = target.weight_checksums(names)
        sums = [held.get(n) for n in names]
        phases = dict(reply[4], checksum=time.perf_counter() - t0)
        return (*reply[:4], phases, sums)


class FleetChannel:
    """One :class:`~rlcore_ray.transport.Channel` to every replica of a fleet: a message is one
    remote call per replica, and the replies merge into one (an error names each replica that
    failed; a dead or silent replica is the fleet's :class:`~rlcore.errors.RolloutError`)."""

    def __init__(self, fleet: Any):
        self.fleet = fleet
        self._refs: list[Any] | None = None
        #: ask every replica for the checksums of what it holds after the push (in its reply)
        self.want_checksums = False
        #: replica 0's checksums from the last push's replies, in layout order (all replicas agreed)
        self.replica_sums: list[int | None] | None = None
        #: what differed between the replicas' checksums in the last push (None: they agree)
        self.replica_mismatch: str | None = None

    def send(self, msg: tuple) -> None:
        if msg[0] == "close":
            return
        self.replica_sums = self.replica_mismatch = None
        self._refs = [r.mapped_push.remote((*msg, self.want_checksums)) for r in self.fleet.replicas]

    def poll(self, timeout: float = 0.0) -> bool:
        return self._refs is not None

    def recv(self, timeout: float | None) -> tuple:
        from rlcore.sync import verification_level

        from rlcore_ray.transport import TransportError

        refs, self._refs = self._refs, None
        if refs is None:
            raise TransportError("protocol error: nothing was sent to the replicas")
        try:
            replies = self.fleet._get(refs, list(range(len(refs))), "a mapped push")
        except RolloutError as exc:  # the fleet's error says which replica died or did not answer
            raise TransportError(str(exc)) from exc
        failed = [f"replica {i}: {r[1]}" for i, r in enumerate(replies) if r[0] == "error"]
        if failed:
            return ("error", "; ".join(failed))
        version = {r[1] for r in replies}
        if len(version) != 1:
            return ("error", f"the replicas committed different versions {sorted(version)}")
        # the checks every replica passed (``"coverage+exact"`` -> {coverage, exact}; ``"none"`` -> {})
        passed = set.intersection(*({c for c in r[2].split("+") if c != "none"} for r in replies))
        phases: dict[str, float] = {}
        for r in replies:  # the slowest replica's time per phase
            for k, v in r[4].items():
                phases[k] = max(phases.get(k, 0.0), float(v))
        if self.want_checksums:
            sums = [r[5] if len(r) > 5 else None for r in replies]
            if any(s is None for s in sums):
                return ("error", "a replica replied without the checksums of what it holds")
            # replicas that committed different bytes: not a transport error (every replica committed),
            # the writer's check below fails the push naming it
            self.replica_sums = sums[0]
            for i, other in enumerate(sums[1:], start=1):
                if other != sums[0]:
                    bad = sum(a != b for a, b in zip(sums[0], other, strict=True))
                    self.replica_mismatch = (f"rollout replica {i} holds other weights than replica 0 after the "
                                             f"push ({bad} tensors differ)")
                    break
        return ("mapped", replies[0][1], verification_level(*passed), min(int(r[3]) for r in replies), phases)


class MappedFleetSync:
    """The ``mapped`` weight sync (see the module docstring)."""

    def __init__(self, verify: bool = True, timeout_s: float = 600.0):
        self.verify = bool(verify)
        self.timeout_s = float(timeout_s)
        self._sender: Any = None  # a MappedSender to the fleet, made at the first push
        self._fleet: Any = None
        self._channel: FleetChannel | None = None
        self._plan: Any = None  # the sender's ChecksumPlan, for the tensors at these addresses
        self._plan_key: tuple | None = None
        self._covered: tuple | None = None  # names and shapes last checked against the replicas' manifest

    def _fleet_of(self, target: Any) -> Any:
        fleet = getattr(target, "mapped_fleet", None)
        fleet = fleet() if callable(fleet) else None
        if fleet is None:
            raise WeightSyncError(
                "sync.name=mapped lends the trainer's parameters to rollout replicas in other processes: it needs "
                "cluster.backend=ray with cluster.placement=colocated (in one process use sync.name=inproc)",
                receiver_version=getattr(target, "weight_version", None))
        return fleet

    def _check_same_machine(self, fleet: Any) -> None:
        import ray

        here = ray.get_runtime_context().get_node_id()
        for i, where in enumerate(fleet.where()):
            if where["node"] != here:
                raise WeightSyncError(
                    f"sync.name=mapped: rollout replica {i} runs on Ray node {where['node']}, the writer rank on "
                    f"{here}: parameters can be lent only on one machine. Put them together (cluster.placement="
                    f"colocated with cluster.strategy=STRICT_PACK) or use sync.name=inproc", receiver_version=None)

    def push(self, weights: Iterable[tuple[str, torch.Tensor]], target: Any, version: int) -> SyncReport:
        import torch.multiprocessing
        from rlcore.sync import ChecksumPlan, Phases, verification_level, verify_checksums

        from rlcore_ray.transport import MappedSender

        t0 = time.perf_counter()
        phases = Phases()
        fleet = self._fleet_of(target)
        with phases("control"):
            if self._sender is None or fleet is not self._fleet:
                torch.multiprocessing.set_sharing_strategy("file_system")
                self._check_same_machine(fleet)
                # the transport's own checksum pass is left out: the replicas reply with the checksums of
                # what they hold after their loaders ran (read back, not of the bytes they were lent), which
                # also catches a write during the lend that reached a replica (one that did not is harmless)
                self._channel = FleetChannel(fleet)
                self._sender = MappedSender(self._channel, verify=False, timeout=self.timeout_s)
                self._fleet = fleet
            pairs = lendable(weights)
            names = [n for n, _ in pairs]
            before = fleet.weight_version
        pending = None
        if self.verify:
            with phases("sender_checksum"):
                key = (tuple(names), tuple(t.data_ptr() for _, t in pairs))
                if key != self._plan_key:  # built once for the parameters' addresses
                    self._plan, self._plan_key = ChecksumPlan([t for _, t in pairs]), key
                pending = self._plan.compute_async()  # queued: read after the replies
        self._channel.want_checksums = self.verify
        try:
            report = self._sender.send(pairs, version)
        except WeightSyncError as exc:  # a TransportError is one
            raise WeightSyncError(f"mapped push of version {version} failed: {exc}; the replicas stay on version "
                                  f"{before}", receiver_version=before) from exc
        fleet.note_version(version)
        transport_phases(phases, report.details)
        checks = [c for c in report.details["level"].split("+") if c == "coverage"]
        with phases("receiver_checksum"):
            shapes = tuple((n, tuple(t.shape)) for n, t in pairs)
            if shapes != self._covered:  # the layout changed: check it against what the replicas hold
                manifest = fleet.weight_manifest()
                try:
                    manifest.check(shapes)
                    manifest.check_complete(names)
                except WeightSyncError as exc:
                    raise WeightSyncError(f"mapped push of version {version}: {exc}", receiver_version=None) from exc
                self._covered = shapes
            checks.append("coverage")
            checked = 0
            if pending is not None:
                with phases("sender_checksum"):
                    sent = dict(zip(names, pending.values(), strict=True))
                if self._channel.replica_mismatch:
                    raise WeightSyncError(f"mapped push of version {version}: {self._channel.replica_mismatch}",
                                          receiver_version=None)
                held = dict(zip(names, self._channel.replica_sums or [], strict=False))
                bad = verify_checksums(sent, held)
                if bad:
                    raise WeightSyncError(
                        f"mapped push of version {version}: {len(bad)} of {len(sent)} tensors differ on the replicas "
                        f"after the push (e.g. {bad[:3]}); they hold unverified weights", receiver_version=None)
                checks.append("exact")
                checked = len(sent)
        level = verification_level(*set(checks))
        details = dict(report.details, level=level, phases=dict(phases.seconds))
        return SyncReport(version, len(pairs), 0, report.bytes, time.perf_counter() - t0, verified=self.verify,
                          checked=checked, method="mapped", details=details)

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
        self._sender = self._fleet = self._channel = self._plan = self._plan_key = self._covered = None


def lendable(weights: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The pairs of a mapped push, CPU parameters moved into shared memory first (in place:
    ``share_memory_()`` keeps the tensors, so the model and the optimizer still hold them; torch's
    ``file_system`` sharing, so the receiver opens them by name)."""
    import torch.multiprocessing

    pairs = list(weights)
    for _, t in pairs:
        if t.device.type == "cpu" and not t.untyped_storage().is_shared():
            torch.multiprocessing.set_sharing_strategy("file_system")
            t.share_memory_()
    return pairs


def transport_phases(phases: Any, details: dict[str, Any]) -> None:
    """Add a mapped transport push's own phases (the writer's, and the slowest replica's) to
    ``phases`` under :data:`rlcore.sync.PUSH_PHASES`: the wait for the reply, less the replica's
    work, is control (the round trip); settling the device and the replica's sync are waits."""
    sender, receiver = details.get("sender_phases", {}), details.get("receiver_phases", {})
    got = {k: float(v) for k, v in receiver.items()}
    work = {"copy": got.get("copy", 0.0) + got.get("load", 0.0), "wait": got.get("sync", 0.0),
            "commit": got.get("commit", 0.0), "receiver_checksum": got.get("checksum", 0.0) + got.get("verify", 0.0),
            "control": got.get("attach", 0.0)}
    replica_total = sum(work.values())
    for name, seconds in work.items():
        phases.seconds[name] += seconds
    phases.seconds["wait"] += float(sender.get("settle", 0.0))
    phases.seconds["control"] += sum(float(sender.get(k, 0.0)) for k in ("signature", "export", "publish"))
    phases.seconds["control"] += max(0.0, float(sender.get("wait", 0.0)) - replica_total)
    phases.seconds["sender_checksum"] += float(sender.get("checksum", 0.0))


def build_mapped(ctx: Any) -> MappedFleetSync:
    if bool(ctx.config.sync.verify):  # compile the checksum kernel at setup, not in the first push
        from rlcore.platforms import run_device
        from rlcore.sync import warm_checksum_kernels

        warm_checksum_kernels(run_device(ctx))
    return MappedFleetSync(verify=bool(ctx.config.sync.verify), timeout_s=float(ctx.config.cluster.rollout.timeout_s))
