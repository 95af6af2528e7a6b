"""Source-mapped colocated sync: the receiver copies straight out of the trainer's parameters.

A bucketed push copies every byte twice, into a bucket by the trainer and out of it by the
replica, and on one GPU the two processes' kernels take turns, so it cannot pass half a
device-to-device copy (measured: docs/benchmarks/transport.md). Here the trainer
shares its parameters' storages with the replica once, and on every push the replica copies from
them into its own tensors: one copy, made by one process, with no bucket.

Protocol (sender ``S``, receiver ``R``; one push)::

    S: ("map", version, layout_id, layout | None, checksums | None)
    R: ("mapped", version, level, checked, phases)      # or ("error", text)

``layout`` is sent when the tensors moved since the last push (the first push, a parameter whose
storage was replaced) or the receiver failed: ``{"tensors": [(name, dtype, shape, key, byte
offset, nbytes)], "storages": {key: payload}}``, one payload per storage, made once per storage
(:func:`~rlcore_ray.transport.mapping.export_storage`). The receiver opens the storages it has not
opened yet, lets go of those the layout no longer names, and builds its copy program once.

**The lease.** From ``map`` until the reply, the receiver may read the trainer's parameters, so
the trainer must not write them: :meth:`MappedSender.send` returns only after the reply, which the
receiver sends only once every read has completed on the GPU (it synchronises first, also when it
fails). ``state`` is ``"lent"`` meanwhile; a push that times out leaves it ``"unknown"``, and then
:meth:`MappedSender.check_writable` (call it before an optimizer step) raises until
:meth:`MappedSender.reclaim` has seen the late reply. Before ``map`` the sender synchronises its
device, so that every write of the last step is complete before the receiver reads.

**Verification** (``verify``): the sender's checksum of every tensor (one kernel for all,
:class:`~rlcore.sync.ChecksumPlan`) is compared with the receiver's checksum of
what it now holds (``exact``); the receiver checks names and shapes against its manifest when a
layout arrives (``coverage``: the layout id proves that names and shapes did not change since).

Which tensors take this path: contiguous tensors of the trainer's own storage (CUDA on the
receiver's GPU, or shared CPU memory) with the receiver's tensor of the same name, dtype and shape
(``target.direct_destinations()``). A tensor without such a destination (a fused or differently
laid out parameter on the receiver) is handed to ``target.receive_bucket`` as a view of the
trainer's storage: still one copy, made by the receiver's loader. A tensor the trainer must first
compute (gathered over TP, renamed into a fused tensor, cast) has no storage worth sharing: it
is refused (a bucketed sync such as ``inproc`` moves it).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from rlcore.errors import WeightSyncError
from rlcore.sync import Bucket, ChecksumPlan, TensorMeta, WeightManifest, verification_level
from rlcore.types import SyncReport

from rlcore_ray.transport.mapping import CopyProgram, block_of, export_storage, open_storage, typed_view
from rlcore_ray.transport.protocol import Channel, ChannelClosed, Phases, TransportError, dtype_name, dtype_of


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mapping_refusal(name: str, t: torch.Tensor, device: torch.device) -> str | None:
    """Why ``t`` cannot be lent by storage (``None``: it can)."""
    if t.device.type != device.type or (device.type == "cuda" and t.device != device):
        return f"{name} is on {t.device}, the push on {device}"
    if not t.is_contiguous():
        return f"{name} is not contiguous (stride {tuple(t.stride())})"
    if t.is_sparse or t.layout != torch.strided:
        return f"{name} is not a strided tensor"
    return None


class MappedSender:
    """Lends the trainer's parameters to one colocated receiver (see the module docstring).

    ``send(weights, version)`` takes the same ``(name, tensor)`` pairs every push (a list or a
    mapping, e.g. the HF-named parameters), which must be the trainer's own storage, not tensors
    computed for the push. ``device`` defaults to the first tensor's.
    """

    def __init__(self, channel: Channel, *, verify: bool = True, timeout: float | None = 600.0,
                 device: torch.device | str | None = None):
        self.channel, self.verify, self.timeout = channel, bool(verify), timeout
        self.device = torch.device(device) if device is not None else None
        self.state = "idle"
        self._exports: dict[int, tuple[tuple, tuple, torch.UntypedStorage]] = {}  # storage ptr -> export
        self._signature: tuple | None = None
        self._layout: dict[str, Any] | None = None
        self._layout_id = 0
        self._receiver_layout: int | None = None
        self._checksums: ChecksumPlan | None = None
        self.exported_total = 0  # storages exported over this sender's life

    def check_writable(self) -> None:
        """Raise unless the receiver is certainly not reading the parameters (call before writing them)."""
        if self.state != "idle":
            raise TransportError(f"the trainer's parameters are {self.state} to the receiver (a push did not end "
                                 "with its reply); writing them now could change what it reads: call reclaim()")

    def reclaim(self, timeout: float | None = None) -> None:
        """Wait for the reply of a push that timed out; the parameters are writable again after it."""
        if self.state == "idle":
            return
        msg = self.channel.recv(timeout)
        if msg[0] not in ("mapped", "error"):
            raise TransportError(f"protocol error: expected the late reply of a mapped push, got {msg[0]!r}")
        self.state = "idle"
        if msg[0] == "error":
            self._receiver_layout = None

    def _build_layout(self, names: list[str], tensors: list[torch.Tensor], device: torch.device) -> tuple[dict, int]:
        refused = [r for n, t in zip(names, tensors, strict=True) if (r := mapping_refusal(n, t, device))]
        if refused:
            raise TransportError(f"{len(refused)} tensor(s) cannot be lent by storage, e.g. {refused[:3]}; push "
                                 "tensors computed for the push (gathered, fused, cast) with a bucketed sync "
                                 "(sync.name=inproc)")
        exports: dict[int, tuple[tuple, tuple, torch.UntypedStorage]] = {}
        new = 0
        entries = []
        for name, t in zip(names, tensors, strict=True):
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            ex = exports.get(ptr) or self._exports.get(ptr)
            if ex is None:
                key, payload = export_storage(storage)
                ex = (key, payload, storage)  # held: the storage must outlive the receiver's mapping
                new += 1
            exports[ptr] = ex
            entries.append((name, dtype_name(t.dtype), list(t.shape), ex[0], t.data_ptr() - ptr,
                            t.numel() * t.element_size()))
        self._exports = exports  # storages no longer named are let go (the receiver drops them too)
        self.exported_total += new
        storages = {ex[0]: ex[1] for ex in exports.values()}
        return {"tensors": entries, "storages": storages, "nbytes": sum(e[5] for e in entries),
                "num_storages": len(storages), "num_blocks": len({block_of(p) for p in storages.values()})}, new

    def send(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int) -> SyncReport:
        """Lend ``weights`` as ``version``; returns when the receiver committed it (its reads done)."""
        self.check_writable()
        t0 = time.perf_counter()
        phases = Phases()
        with phases("signature"):
            pairs = list(weights.items()) if isinstance(weights, Mapping) else list(weights)
            names = [n for n, _ in pairs]
            tensors = [t for _, t in pairs]  # read only through data_ptr/storage: no detach per push
            # size() rather than .shape: measured 10x cheaper per tensor, and this runs every push
            signature = (names, [t.data_ptr() for t in tensors], [t.size() for t in tensors],
                         [t.dtype for t in tensors])
        if not tensors:
            raise TransportError("a mapped push needs at least one tensor")
        device = self.device or tensors[0].device
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        new = 0
        if signature != self._signature:
            with phases("export"):
                self._layout, new = self._build_layout(names, tensors, device)
            self._signature, self._layout_id = signature, self._layout_id + 1
            self._checksums = None
        send_layout = self._receiver_layout != self._layout_id
        with phases("settle"):  # every write of the last step complete before anyone reads
            _synchronize(device)
        sums = None
        if self.verify:
            with phases("checksum"):
                if self._checksums is None:
                    self._checksums = ChecksumPlan(tensors)
                sums = self._checksums.compute()
        self._before_publish(tensors)
        self.state = "lent"
        try:
            with phases("publish"):
                self.channel.send(("map", int(version), self._layout_id, self._layout if send_layout else None, sums))
            with phases("wait"):
                msg = self.channel.recv(self.timeout)
        except ChannelClosed:  # the receiver is gone, and its reads with it
            self.state = "idle"
            self._receiver_layout = None
            raise
        except TransportError:  # silence: the receiver may still be reading
            self.state = "unknown"
            self._receiver_layout = None
            raise
        self.state = "idle"
        if msg[0] == "error":
            self._receiver_layout = None
            raise TransportError(f"the receiver failed version {version} (it aborted and keeps its previous "
                                 f"version; its reads are complete): {msg[1]}")
        if msg[0] != "mapped" or msg[1] != version:
            self.state = "unknown"
            raise TransportError(f"protocol error: expected ('mapped', {version}), got {msg[:2]!r}")
        self._receiver_layout = self._layout_id
        _, _, level, checked, receiver_phases = msg
        details = {"level": level, "transport": "mapped", "layout_sent": send_layout, "storages_exported": new,
                   "storages": self._layout["num_storages"], "blocks": self._layout["num_blocks"],
                   "checksum_backend": self._checksums.backend if self._checksums else None,
                   "sender_phases": phases.as_dict(), "receiver_phases": receiver_phases}
        return SyncReport(int(version), len(tensors), 0, self._layout["nbytes"], time.perf_counter() - t0, verified=self.verify,
                          checked=checked, method="transport-mapped", details=details)

    def _before_publish(self, tensors: list[torch.Tensor]) -> None:
        """Test seam: the last moment before the receiver may read (a trainer writing here breaks the lease)."""

    def close(self) -> None:
        self.check_writable()
        self._exports, self._layout, self._signature, self._checksums = {}, None, None, None


class MappedReceiver:
    """Serves mapped pushes into ``target``: a :class:`rlcore.types.BucketReceiver`, optionally with
    ``direct_destinations() -> {name: tensor}`` (its own tensors that a received tensor of the same
    name, dtype and shape is copied into byte for byte). Tensors without one are handed to
    ``target.receive_bucket`` as views of the trainer's storage (one bucket per storage), which
    must copy before returning. ``big_bytes``: copies at least this large go one by one; ``fused``:
    how the others go (``"auto"``, ``"foreach"`` or ``"triton"``, see :class:`~.mapping.CopyProgram`)."""

    def __init__(self, channel: Channel, *, manifest: WeightManifest | None = None, timeout: float | None = 600.0,
                 big_bytes: int = 16 << 20, fused: str = "auto"):
        self.channel, self.manifest, self.timeout, self.big_bytes = channel, manifest, timeout, big_bytes
        self.fused = fused
        self._opened: dict[tuple, torch.UntypedStorage] = {}
        self._layout_id: int | None = None
        self._names: list[str] = []
        self._program: CopyProgram | None = None
        self._loads: list[Bucket] = []
        self._checks: ChecksumPlan | None = None  # the tensors the target's loader copies, at their source
        self._copy_checks: ChecksumPlan | None = None  # the direct copies, checksummed as they land
        self._direct: list[int] = []  # positions in _names of each kind
        self._loaded: list[int] = []
        self._dst_signature: list[int] = []
        self._sources: list[torch.Tensor] = []
        self.device = torch.device("cpu")
        self.opened_total = 0  # storages opened over this receiver's life

    def serve(self, target: Any, pushes: int | None = None) -> list[dict[str, Any]]:
        """Serve pushes until ``("close",)``, the channel closing, or ``pushes`` of them."""
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
            if msg[0] != "map":
                raise TransportError(f"protocol error: expected map from the sender, got {msg[0]!r}")
            try:
                done.append(self.serve_one(target, msg))
            except (WeightSyncError, TransportError) as exc:  # told to the sender; keep serving
                done.append({"version": msg[1], "error": f"{type(exc).__name__}: {exc}"})
        return done

    def _attach(self, layout: dict[str, Any], target: Any, phases: Phases) -> None:
        entries = layout["tensors"]
        manifest = self.manifest
        if manifest is None and callable(getattr(target, "weight_manifest", None)):
            manifest = target.weight_manifest()
        if manifest is not None:
            manifest.check([(e[0], e[2]) for e in entries])
            manifest.check_complete([e[0] for e in entries])
        with phases("open"):
            opened = {}
            for key, payload in layout["storages"].items():
                opened[key] = self._opened.get(key)
                if opened[key] is None:
                    opened[key] = open_storage(payload)
                    self.opened_total += 1
            self._opened = opened  # storages the layout no longer names are let go here
        self.device = next(iter(opened.values())).device
        sources = [typed_view(opened[key], off, shape, dtype_of(dt)) for _, dt, shape, key, off, _ in entries]
        self._names = [e[0] for e in entries]
        self._plan(target, sources, phases)

    def _plan(self, target: Any, sources: list[torch.Tensor], phases: Phases) -> None:
        with phases("plan"):
            dests = target.direct_destinations() if callable(getattr(target, "direct_destinations", None)) else {}
            pairs, direct, loaded, by_storage = [], [], [], {}
            for i, (name, src) in enumerate(zip(self._names, sources, strict=True)):
                dst = dests.get(name)
                if (dst is not None and dst.shape == src.shape and dst.dtype == src.dtype and dst.is_contiguous()
                        and dst.device == src.device):
                    pairs.append((dst, src))
                    direct.append(i)
                else:  # the target's loader copies it (fused or re-laid-out parameters)
                    by_storage.setdefault(src.untyped_storage().data_ptr(), []).append((name, src))
                    loaded.append(i)
            self._program = CopyProgram(pairs, self.big_bytes, self.fused)
            # a verified push copies the direct tensors and checksums what landed in one pass (each
            # byte read once); the loader's tensors are checksummed at their source
            self._copy_checks = ChecksumPlan.copying(pairs) if pairs else None
            self._direct, self._loaded = direct, loaded
            self._dst_signature = self._destinations_now(target)
            self._loads = []
            for items in by_storage.values():
                base = items[0][1].untyped_storage()
                buf = typed_view(base, 0, (base.nbytes(),), torch.uint8)
                metas = [TensorMeta(n, tuple(s.shape), s.dtype, s.data_ptr() - base.data_ptr(),
                                    s.numel() * s.element_size()) for n, s in items]
                self._loads.append(Bucket(len(self._loads), metas[0].dtype, buf, metas))
            self._checks = ChecksumPlan([sources[i] for i in loaded])
            self._sources = sources

    def _destinations_now(self, target: Any) -> list[int | None]:
        """Where the target's direct destinations are now (asked every push: an engine that
        released and re-allocated its weights has them elsewhere, and the plan must follow)."""
        if not callable(getattr(target, "direct_destinations", None)):
            return []
        dests = target.direct_destinations()
        return [d.data_ptr() if (d := dests.get(n)) is not None else None for n in self._names]

    def serve_one(self, target: Any, msg: tuple) -> dict[str, Any]:
        _, version, layout_id, layout, sums = msg
        phases = Phases()
        begun = False
        try:
            if layout is not None:
                self._layout_id = None
                with phases("attach"):
                    self._attach(layout, target, phases)
                self._layout_id = layout_id
            elif layout_id != self._layout_id:
                raise TransportError(f"protocol error: layout {layout_id} was never sent (this side has "
                                     f"{self._layout_id})")
            elif self._destinations_now(target) != self._dst_signature:
                self._plan(target, self._sources, phases)  # the target moved its tensors (slept and woke)
            target.begin_update(version)
            begun = True
            with phases("copy"):
                landed = None
                if sums is not None and self._copy_checks is not None:
                    landed = self._copy_checks.compute_async()  # copy + checksum, read in "verify"
                else:
                    self._program.run()
            with phases("load"):
                for bucket in self._loads:
                    target.receive_bucket(bucket)
            with phases("sync"):  # every read of the trainer's storage complete
                _synchronize(self.device)
            verified = False
            if sums is not None:
                with phases("verify"):
                    got = [0] * len(self._names)
                    for i, value in zip(self._direct, landed.values() if landed is not None else [], strict=True):
                        got[i] = value
                    for i, value in zip(self._loaded, self._checks.compute(), strict=True):
                        got[i] = value
                bad = [n for n, a, b in zip(self._names, got, sums, strict=True) if a != b]
                if bad:
                    raise WeightSyncError(f"version {version}: {len(bad)} tensor(s) arrived with other bytes than "
                                          f"the sender's checksum, e.g. {bad[:3]} (written while lent, or copied "
                                          f"from the wrong place)", receiver_version=None)
                verified = True
            with phases("commit"):
                target.commit_update(version)
        except BaseException as exc:
            try:
                _synchronize(self.device)  # the reply certifies that no read of the sender is in flight
                if begun:
                    target.abort_update()
            finally:
                self.channel.send(("error", f"{type(exc).__name__}: {exc}"))
            raise
        has_manifest = self.manifest is not None or callable(getattr(target, "weight_manifest", None))
        level = verification_level(*(["coverage"] if has_manifest else []), *(["exact"] if verified else []))
        checked = len(self._names) if verified else 0
        self.channel.send(("mapped", version, level, checked, phases.as_dict()))
        return {"version": version, "tensors": len(self._names), "level": level, "phases": phases.as_dict(),
                "program": self._program.stats(), "loader_buckets": len(self._loads),
                "checksum_backend": (self._copy_checks or self._checks).backend, "opened_total": self.opened_total}

    def close(self) -> None:
        self._opened, self._program, self._loads, self._checks, self._copy_checks = {}, None, [], None, None
        self._sources = []
        self._layout_id = None
