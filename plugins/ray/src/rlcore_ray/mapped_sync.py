"""``sync.name: mapped``: the writer's parameters lent to its colocated rollout replicas.

The default way into a fleet of replicas (``inproc`` through :class:`~rlcore_ray.fleet.RolloutFleet`)
copies every byte into a bucket, then into Ray's object store, then into each replica. Here the
writer trainer rank lends its parameters' storages instead (:class:`~rlcore_ray.transport.MappedSender`:
CUDA IPC handles on a GPU, named shared memory on CPU), once; on every push each replica copies
straight out of them (:class:`~rlcore_ray.transport.MappedReceiver`, serving inside the replica
actor), and the writer holds no bucket at all. One control message goes to every replica at once
(:class:`FleetChannel`); the push returns when every replica has replied, i.e. finished reading,
so the optimizer step that follows cannot change bytes a replica is still reading (the lease of
:mod:`rlcore_ray.transport.mapped`). After the replies, the writer checks what every replica now
holds against the checksums of what it lent (``coverage+exact``, as ``inproc`` does), and the
replicas against each other.

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
        self.box.reply = None
        try:
            self.receiver.serve_one(target, msg)
        except Exception as exc:  # noqa: BLE001 - the reply carries it to the writer
            if self.box.reply is None:
                return ("error", f"{type(exc).__name__}: {exc}")
        return self.box.reply if self.box.reply is not None else ("error", "the replica sent no reply")


class FleetChannel:
    """One :class:`~rlcore_ray.transport.Channel` to every replica of a fleet: a message is one
    remote call per replica, and the replies merge into one (an error names each replica that
    failed; a dead or silent replica is the fleet's :class:`~rlcore.errors.RolloutError`)."""

    def __init__(self, fleet: Any):
        self.fleet = fleet
        self._refs: list[Any] | None = None

    def send(self, msg: tuple) -> None:
        if msg[0] == "close":
            return
        self._refs = [r.mapped_push.remote(msg) for r in self.fleet.replicas]

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
        return ("mapped", replies[0][1], verification_level(*passed), min(int(r[3]) for r in replies), phases)


class MappedFleetSync:
    """The ``mapped`` weight sync (see the module docstring)."""

    def __init__(self, verify: bool = True, timeout_s: float = 600.0):
        self.verify = bool(verify)
        self.timeout_s = float(timeout_s)
        self._sender: Any = None  # a MappedSender to the fleet, made at the first push
        self._fleet: Any = None

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

    @staticmethod
    def _lendable(weights: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        pairs = list(weights)
        for _, t in pairs:
            if t.device.type == "cpu" and not t.untyped_storage().is_shared():
                t.share_memory_()  # in place: the parameter now lives in shared memory
        return pairs

    def push(self, weights: Iterable[tuple[str, torch.Tensor]], target: Any, version: int) -> SyncReport:
        import torch.multiprocessing
        from rlcore.sync import check_after_push, tensor_checksum

        from rlcore_ray.transport import MappedSender

        t0 = time.perf_counter()
        fleet = self._fleet_of(target)
        if self._sender is None or fleet is not self._fleet:
            torch.multiprocessing.set_sharing_strategy("file_system")
            self._check_same_machine(fleet)
            # the transport's own checksum pass is left out: the checksums below are taken before the
            # lend and compared with what every replica committed, which also catches a write
            # during the lend that reached a replica (one that did not is harmless)
            self._sender = MappedSender(FleetChannel(fleet), verify=False, timeout=self.timeout_s)
            self._fleet = fleet
        pairs = self._lendable(weights)
        before = fleet.weight_version
        sent = {n: tensor_checksum(t) for n, t in pairs} if self.verify else None
        try:
            report = self._sender.send(pairs, version)
        except WeightSyncError as exc:  # a TransportError is one
            raise WeightSyncError(f"mapped push of version {version} failed: {exc}; the replicas stay on version "
                                  f"{before}", receiver_version=before) from exc
        fleet.note_version(version)
        # what every replica holds now, against what was lent (and the replicas against each other)
        checked, level = check_after_push(fleet, [(n, tuple(t.shape)) for n, t in pairs], sent, version, "mapped",
                                          holder="the replicas", holds="they hold")
        details = dict(report.details, level=level)
        return SyncReport(version, len(pairs), 0, report.bytes, time.perf_counter() - t0, verified=self.verify,
                          checked=checked, method="mapped", details=details)

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
        self._sender = self._fleet = None


def build_mapped(ctx: Any) -> MappedFleetSync:
    return MappedFleetSync(verify=bool(ctx.config.sync.verify), timeout_s=float(ctx.config.cluster.rollout.timeout_s))
