"""Weight-sync helpers every transport shares: the flattened bucket builder and checksums.

:func:`iter_buckets` streams ``(name, tensor)`` pairs into flattened ``uint8`` buckets of at
most ``bucket_bytes``: tensors of one dtype per bucket (so every offset is aligned for that
dtype, the layout SGLang's ``FlattenedTensorBucket.empty`` recomputes for the NCCL path), each
offset aligned to ``align_bytes``, a tensor never split (one larger than a bucket travels alone),
and tensors sharing a ``keep_together`` key never split across buckets. Only one bucket per dtype
is open at a time, so memory stays at about ``bucket_bytes`` × dtypes whatever the model size.

:func:`tensor_checksum` (:mod:`rlcore.checksums`, imported here for the callers that have always
found it here) is a 62-bit checksum of a tensor's raw bytes. A sender that verifies passes
``checksums=`` (a :class:`~rlcore.checksums.ChecksumSlots`) to :func:`iter_buckets`: each bucket is
then filled by one fused copy-and-checksum launch (the bytes are read once), the checksums stay on
the device (``Bucket.slots``) and are read back once at the end of the push, so no bucket waits
for the GPU and no pending checksum keeps a bucket alive. ``Bucket.checksums()`` computes a
bucket's checksums on their own (one kernel and one wait).
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# re-exported for syncs in plugins (rlcore.checksums is not public): tensor_checksum, warm_checksum_kernels
from rlcore.checksums import ChecksumPlan, ChecksumSlots, tensor_checksum, warm_checksum_kernels  # noqa: F401
from rlcore.errors import BucketError, WeightSyncError

__all__ = [
    "Bucket", "ChecksumPlan", "ChecksumSlots", "LEVEL_CHECKS", "PUSH_PHASES", "Phases", "SentChecksums", "TensorMeta",
    "WeightManifest", "iter_buckets", "prune_versions", "sync_level", "tensor_checksum", "verification_level",
    "verify_checksums", "warm_checksum_kernels",
]


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor sits in a bucket: ``offset`` and ``nbytes`` in bytes."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class Bucket:
    """A flattened bucket: ``buffer`` is ``uint8 [nbytes]``; ``metas`` locate each tensor."""

    index: int
    dtype: torch.dtype
    buffer: torch.Tensor
    metas: list[TensorMeta] = field(default_factory=list)
    #: the slot of each tensor's checksum in the ``checksums`` given to :func:`iter_buckets` (None without)
    slots: list[int] | None = None
    #: the buffer was allocated for this bucket alone and its sender never writes it again
    #: (:func:`iter_buckets` without an ``allocator``): a receiver may keep views of it instead of
    #: copying them out (the local rollout's staged update does: one copy fewer per push)
    receiver_may_keep: bool = False

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.metas]

    def view(self, meta: TensorMeta) -> torch.Tensor:
        return self.buffer[meta.offset : meta.offset + meta.nbytes].view(meta.dtype).view(meta.shape)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, view)`` for every tensor in the bucket (views share the buffer)."""
        for m in self.metas:
            yield m.name, self.view(m)

    def checksums(self) -> dict[str, int]:
        """:func:`tensor_checksum` of each tensor, computed together (on a GPU: one kernel for the
        bucket and one wait, not a few kernels and a wait per tensor)."""
        named = list(self.tensors())
        return dict(zip((n for n, _ in named), ChecksumPlan([t for _, t in named]).compute(), strict=True))


Allocator = Callable[[int, torch.device], torch.Tensor]


def _default_allocator(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


class _OpenBucket:
    def __init__(self, dtype: torch.dtype, capacity: int, device: torch.device, alloc: Allocator,
                 defer: bool = False, checksums: ChecksumSlots | None = None):
        self.dtype = dtype
        self.buffer = alloc(capacity, device)
        self.metas: list[TensorMeta] = []
        self.used = 0
        self.checksums = checksums
        self.defer = defer or checksums is not None
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.slots: list[int] | None = None

    def fits(self, nbytes: int, align: int) -> bool:
        return _round_up(self.used, align) + nbytes <= self.buffer.numel()

    def add(self, name: str, t: torch.Tensor, align: int) -> None:
        off = _round_up(self.used, align)
        nbytes = t.numel() * t.element_size()
        dst = self.buffer[off : off + nbytes].view(t.dtype).view(t.shape)
        if self.defer:
            self.pending.append((dst, t))
        else:
            dst.copy_(t, non_blocking=False)
        self.metas.append(TensorMeta(name, tuple(t.shape), t.dtype, off, nbytes))
        self.used = off + nbytes

    def flush(self) -> None:
        """The deferred copies, fused (one ``_foreach_copy_`` launch per bucket on a GPU; with
        ``checksums``, one copy-and-checksum launch whose sums stay on the device)."""
        if self.checksums is not None:
            self.slots = self.checksums.copy(self.pending)
        elif self.pending:
            torch._foreach_copy_([d for d, _ in self.pending], [s for _, s in self.pending])
        self.pending = []


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    *,
    align_bytes: int | None = None,
    keep_together: Callable[[str], str] | None = None,
    device: torch.device | str | None = None,
    allocator: Allocator | None = None,
    group_by_dtype: bool = True,
    defer_copies: bool = False,
    checksums: ChecksumSlots | None = None,
) -> Iterator[Bucket]:
    """Stream named tensors into flattened, dtype-grouped, aligned buckets.

    :param named_tensors: ``(name, tensor)`` pairs in any order (typically an engine's
        ``export_hf_weights()``), consumed lazily.
    :param bucket_bytes: capacity of a bucket; a tensor (or ``keep_together`` group) larger
        than this gets a bucket of exactly its size.
    :param align_bytes: alignment of every offset (default: the dtype's item size, i.e. packed
        contiguously, which is what SGLang's NCCL flattened path expects).
    :param keep_together: maps a name to a group key; consecutive tensors with one key go into
        the same bucket (e.g. the q/k/v or gate/up pieces of one fused vLLM parameter).
    :param device: where buckets live (default: each tensor's device).
    :param allocator: ``(nbytes, device) -> uint8 tensor`` to place buckets in, e.g. shared
        memory for another process; the default allocates a fresh buffer per bucket, so a
        consumer may keep a bucket while the next one is built (``Bucket.receiver_may_keep``).
    :param group_by_dtype: one open bucket per dtype (the default, SGLang's flattened layout);
        ``False`` keeps a single open bucket for all dtypes (each offset still aligned to its
        tensor's item size, ``Bucket.dtype`` is then the first tensor's), so at most one buffer
        is being filled at a time: what a fixed pool of buffers needs.
    :param defer_copies: copy a bucket's tensors when it is emitted, all at once
        (``torch._foreach_copy_``: on a GPU one launch per bucket instead of one per tensor); the
        source tensors stay referenced until then, i.e. up to one more bucket of memory when
        the stream yields fresh tensors (gathers) rather than views of parameters.
    :param checksums: where to put each tensor's checksum (the sender's side of ``exact``): the
        copies are deferred as with ``defer_copies`` and made by
        :meth:`~rlcore.checksums.ChecksumSlots.copy` (copy and checksum in one pass, nothing
        waits for the device); ``Bucket.slots`` says where each tensor's value is, read with
        ``checksums.values()`` once the stream is done.

    Buckets are yielded as soon as they are full; the rest are flushed at the end in the order
    their dtypes first appeared. ``Bucket.index`` counts yielded buckets.
    """
    if bucket_bytes < 1:
        raise BucketError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    if align_bytes is not None and align_bytes < 1:
        raise BucketError(f"align_bytes must be >= 1 (or None for the dtype's item size), got {align_bytes}")
    alloc = allocator or _default_allocator
    open_buckets: dict[torch.dtype | None, _OpenBucket] = {}
    counter = 0

    def emit(ob: _OpenBucket) -> Bucket:
        nonlocal counter
        ob.flush()
        b = Bucket(counter, ob.dtype, ob.buffer[: ob.used], ob.metas, ob.slots, receiver_may_keep=allocator is None)
        counter += 1
        return b

    def place(group: list[tuple[str, torch.Tensor]]) -> Iterator[Bucket]:
        dtype = group[0][1].dtype
        # every offset must also be a multiple of the item size, or the tensor cannot be viewed
        align = math.lcm(align_bytes or 1, group[0][1].element_size())
        need = 0
        for _, t in group:
            need = _round_up(need, align) + t.numel() * t.element_size()
        dev = torch.device(device) if device is not None else group[0][1].device
        if need > bucket_bytes:  # oversize: a bucket of its own, the open one stays open
            ob = _OpenBucket(dtype, need, dev, alloc, defer_copies, checksums)
            for name, t in group:
                ob.add(name, t, align)
            yield emit(ob)
            return
        slot_key = dtype if group_by_dtype else None
        ob = open_buckets.get(slot_key)
        if ob is not None:
            probe = ob.used
            for _, t in group:
                probe = _round_up(probe, align) + t.numel() * t.element_size()
            if probe > ob.buffer.numel():
                yield emit(ob)
                ob = None
        if ob is None:
            ob = _OpenBucket(dtype, bucket_bytes, dev, alloc, defer_copies, checksums)
            open_buckets[slot_key] = ob
        for name, t in group:
            ob.add(name, t, align)

    pending: list[tuple[str, torch.Tensor]] = []
    pending_key: object = object()
    for name, t in named_tensors:
        if not isinstance(t, torch.Tensor):
            raise BucketError(f"weight {name!r} is a {type(t).__name__}, expected a torch.Tensor")
        if t.layout != torch.strided or t.device.type == "meta":
            raise BucketError(f"weight {name!r} is a {t.layout} tensor on {t.device}; buckets carry dense tensors "
                              f"with data (export it with .to_dense() or materialise it first)")
        t = t.detach()
        key = keep_together(name) if keep_together else name
        if pending and (key != pending_key or t.dtype != pending[0][1].dtype):
            yield from place(pending)
            pending = []
        pending_key = key
        pending.append((name, t))
    if pending:
        yield from place(pending)
    for ob in list(open_buckets.values()):
        if ob.metas:
            yield emit(ob)
    open_buckets.clear()


class SentChecksums:
    """The sender's side of ``exact`` for a bucketed push, with no read of a bucket after its fill:
    pass :attr:`slots` to :func:`iter_buckets` (each bucket is filled by one copy-and-checksum
    launch, :meth:`~rlcore.checksums.ChecksumSlots.copy`), :meth:`record` every bucket as it is
    sent, and read every value at once with :meth:`values` (one wait for the device per push,
    not one per bucket). Kept across pushes: the device slots are reused.

    Example::

        sent = SentChecksums()
        for bucket in iter_buckets(weights, bucket_bytes, checksums=sent.start()):
            sent.record(bucket)
            send(bucket)
        expected = sent.values()  # {name: tensor_checksum of what was sent}
    """

    def __init__(self) -> None:
        self.slots = ChecksumSlots()
        self._named: list[tuple[str, int]] = []

    def start(self) -> ChecksumSlots:
        """A new push: forget the last one's slots (kept on the device, zeroed); returns the slots."""
        self.slots.reset()
        self._named = []
        return self.slots

    def record(self, bucket: Bucket) -> None:
        """Note ``bucket``'s tensors and their slots (it must come from ``iter_buckets(checksums=self.slots)``)."""
        if bucket.slots is None:
            raise BucketError(f"bucket {bucket.index} was built without checksums: pass checksums=SentChecksums.slots "
                              f"to iter_buckets")
        self._named += zip(bucket.names, bucket.slots, strict=True)

    def add(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Checksum tensors sent as they are, without a bucket (queued: nothing waits)."""
        self._named += zip((n for n, _ in named), self.slots.checksum([t for _, t in named]), strict=True)

    def values(self) -> dict[str, int]:
        """``{name: checksum}`` of every recorded tensor (waits for the queued fills once)."""
        if not self._named:
            return {}
        values = self.slots.values([slot for _, slot in self._named])
        return dict(zip((name for name, _ in self._named), values, strict=True))


#: the phases of a push a sync reports in ``SyncReport.details["phases"]`` (host seconds each), written
#: to the run's metrics as ``sync/<phase>_s`` (rlcore.push): control messages and round trips, the
#: sender's checksums (what is not fused into its copies), the copies (bucket fill and landing, or
#: the receiver's copy), waiting for the device or the receiver, the receiver's checksums and the
#: comparison, and the commit
PUSH_PHASES = ("control", "sender_checksum", "copy", "wait", "receiver_checksum", "commit")


class Phases:
    """Host wall time per phase of one push (``with phases("copy"):`` accumulates)."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PUSH_PHASES, 0.0)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0


def verify_checksums(sent: Mapping[str, int], received: Mapping[str, int]) -> list[str]:
    """Names whose checksum differs or is missing on the receiving side (empty = all good)."""
    bad = [n for n, c in sent.items() if received.get(n) != c]
    return bad


# ------------------------------------------------------------------ verification ----------
#
# What a push's ``SyncReport`` says about the engine, in ``details["level"]`` (checks joined by
# "+", weakest first; "none" when nothing was checked):
#
# * ``coverage``: every tensor the engine holds arrived, each name and shape checked against what
#   the engine holds *before* it was loaded (a wrong shape, an unknown name or a missing tensor
#   fails the push, naming the tensor). Tied heads: the engine's tied output layer is covered by
#   its embedding and rebuilt from it on every push.
# * ``exact``: checksums of what the engine holds after its loaders ran equal the trainer's, tensor
#   by tensor: read back from the receiving parameters (where one trainer tensor is a slice of a
#   fused engine parameter, e.g. vLLM's ``qkv_proj``, the checksum of that slice), not of the bytes
#   the receiver was handed, so a loader that stores nothing fails (core's inproc/disk syncs ask
#   the receiver's ``weight_checksums()``, of the weights it holds after the push).
# * ``probe``: the engine's log-probs on a probe sequence match the training engine's within a
#   dtype tolerance (where bytes cannot be read back, e.g. vLLM's GPU transports).

#: the checks a level may contain, in the order they are written
LEVEL_CHECKS = ("coverage", "exact", "probe")


def verification_level(*checks: str) -> str:
    """``"coverage+exact"`` from the checks that passed (any order); ``"none"`` if none did."""
    unknown = set(checks) - set(LEVEL_CHECKS)
    if unknown:
        raise ValueError(f"unknown verification checks {sorted(unknown)}; known: {LEVEL_CHECKS}")
    got = [c for c in LEVEL_CHECKS if c in checks]
    return "+".join(got) if got else "none"


def check_after_push(target: Any, shapes: list[tuple[str, tuple[int, ...]]], sent: Mapping[str, int] | None,
                     version: int, method: str, *, holder: str = "the receiver",
                     holds: str = "it holds") -> tuple[int, str]:
    """Check what ``target`` holds after a ``method`` push of ``version``; returns ``(tensors
    checked, level)``. ``coverage``: every pushed name and shape against the target's
    ``weight_manifest()`` (when it has one); ``exact``: the target's ``weight_checksums()`` against
    ``sent`` (``None``: not verified). A failure is a :class:`WeightSyncError` naming ``holder``
    (the receiver, or a fleet's replicas) and saying ``holds`` unverified weights."""
    checks = []
    manifest = target.weight_manifest() if callable(getattr(target, "weight_manifest", None)) else None
    if manifest is not None:
        try:
            manifest.check(shapes)
            manifest.check_complete(n for n, _ in shapes)
        except WeightSyncError as exc:
            raise WeightSyncError(f"{method} push of version {version}: {exc}", receiver_version=None) from exc
        checks.append("coverage")
    if sent is None:
        return 0, verification_level(*checks)
    bad = verify_checksums(sent, target.weight_checksums(sent.keys()))
    if bad:
        raise WeightSyncError(
            f"{method} push of version {version}: {len(bad)} of {len(sent)} tensors differ on {holder} after "
            f"the push (e.g. {bad[:3]}); {holds} unverified weights",
            receiver_version=None,
        )
    checks.append("exact")
    return len(sent), verification_level(*checks)


def prune_versions(directory: Path, version: int, keep: int) -> None:
    """Delete ``directory/v<n>`` for every ``n <= version - keep`` (disk syncs keep the newest)."""
    for d in Path(directory).glob("v*"):
        try:
            v = int(d.name[1:])
        except ValueError:
            continue
        if v <= version - keep:
            shutil.rmtree(d, ignore_errors=True)


#: checkpoint names of an output layer that may be tied to the input embedding
TIED_HEAD_NAMES = ("lm_head.weight",)


class WeightManifest:
    """The tensors an engine holds, in HF checkpoint names: ``{name: shape}``; ``optional`` names
    (a tied output layer) may be left out of a push. Checks a push against it before loading."""

    def __init__(self, shapes: Mapping[str, Iterable[int]], optional: Iterable[str] = (), where: str = "engine"):
        self.shapes = {n: tuple(int(s) for s in shape) for n, shape in shapes.items()}
        self.optional = frozenset(optional)
        self.where = where

    def refusal(self, name: str, shape: Iterable[int]) -> str | None:
        """Why ``name`` with ``shape`` must not be loaded (``None`` if it may)."""
        shape = tuple(int(s) for s in shape)
        want = self.shapes.get(name)
        if want is None:
            if name in self.optional:
                return None
            close = [n for n in self.shapes if n.rsplit(".", 1)[-1] == name.rsplit(".", 1)[-1]][:2]
            return (f"weight {name!r} {shape}: the {self.where} holds no tensor of that name "
                    f"({len(self.shapes)} tensors{', e.g. ' + ', '.join(map(repr, close)) if close else ''})")
        if want != shape:
            return f"weight {name!r}: received shape {shape}, the {self.where} holds {want}"
        return None

    def check(self, named_shapes: Iterable[tuple[str, Iterable[int]]]) -> None:
        """Raise :class:`WeightSyncError` naming every refused tensor (before anything is loaded)."""
        bad = [r for n, s in named_shapes if (r := self.refusal(n, s)) is not None]
        if bad:
            more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
            raise WeightSyncError(f"refused {len(bad)} tensor(s) before loading: " + "; ".join(bad[:5]) + more,
                                  receiver_version=None)

    def missing(self, received: Iterable[str]) -> list[str]:
        """Required names that did not arrive (sorted)."""
        got = set(received)
        return sorted(n for n in self.shapes if n not in got and n not in self.optional)

    def check_complete(self, received: Iterable[str]) -> None:
        miss = self.missing(received)
        if miss:
            raise WeightSyncError(
                f"partial push: {len(miss)} of {len(self.shapes)} tensors the {self.where} holds did not arrive "
                f"(e.g. {miss[:5]}); a push must carry every weight", receiver_version=None)

    def checked(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass ``weights`` through, refusing each tensor before it goes on (so before a bucket
        holding it is built) and, when the stream ends, raising if it was partial: the last
        bucket is then never sent."""
        seen: list[str] = []
        for name, t in weights:
            why = self.refusal(name, t.shape)
            if why is not None:
                raise WeightSyncError(f"refused before loading: {why}", receiver_version=None)
            seen.append(name)
            yield name, t
        self.check_complete(seen)

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path, where: str = "engine") -> WeightManifest:
        """Names and shapes from a HF directory's safetensors headers (no tensor data is read).
        An output layer is optional when ``config.json`` ties it to the embedding."""
        root = Path(model_dir)
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise WeightSyncError(f"no *.safetensors files in {root}: cannot tell which weights the {where} holds",
                                  receiver_version=None)
        shapes: dict[str, tuple[int, ...]] = {}
        for f in files:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            for name, entry in header.items():
                if name != "__metadata__":
                    shapes[name] = tuple(entry["shape"])
        cfg_path = root / "config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        tied = bool(cfg.get("tie_word_embeddings", cfg.get("text_config", {}).get("tie_word_embeddings", True)))
        return cls(shapes, optional=TIED_HEAD_NAMES if tied else (), where=where)


def sync_level(report: object) -> str:
    """The verification level a :class:`~rlcore.types.SyncReport` states (``details["level"]``);
    a sync that states none reports ``"unstated"`` when it says verified, else ``"none"``."""
    details = getattr(report, "details", None) or {}
    level = details.get("level")
    if level:
        return str(level)
    return "unstated" if getattr(report, "verified", False) else "none"
