"""Delta weight pushes (``sync.delta``): send only what changed since the version the receiver
holds, verified as a full push is.

At RL learning rates in bf16 most elements of most tensors do not change from one step to the
next (the update is below half an ulp). :class:`DeltaEncoder`, the sender's side (the ``inproc``
sync's), keeps a **snapshot**: a copy of every tensor as last pushed, on the tensors' device, so
its memory cost is one copy of the model in the model's dtype; and the version the receiver
holds. Each push compares every tensor with its snapshot bit for bit (so ``-0.0`` differs from
``0.0``) and sends it as whichever is smallest:

* unchanged: nothing (the push names it in its ``unchanged`` list),
* ``rows`` (2-D tensors): the indices of the changed rows and those rows,
* ``elements``: the flat indices of the changed elements and their values,
* ``dense``: the whole tensor, under its own name.

Encoded tensors travel in the ordinary buckets under names no checkpoint has (:func:`delta_name`:
``<name>@delta.rows.index``, ``<name>@delta.rows.values``, ``<name>@delta.elements.index``,
``<name>@delta.elements.values``; indices int32, int64 from 2^31 on), so a receiver that does not
decode them refuses them as tensors it does not hold. A push is **full** (every tensor dense, as
without ``sync.delta``): at the first push (``first``); when the receiver is not on the encoder's
base version, or the tensors' names, shapes or dtypes changed (``base_mismatch``); after a failed
push (``after_failure``); every ``sync.delta_full_every``-th push (``periodic``); and when the
encoding would exceed ``sync.delta_max_ratio`` of the full push's bytes (``too_large``: decided
from the change counts, computed first, before anything is sent). The export is held for the push
(views of the parameters for the ``hf`` engine). The snapshot moves only once a push was verified;
a failed push forgets the base, so the next one is full.

The receiver's side (:class:`DeltaIntake`, the ``local`` rollout's) is told the base version and
the unchanged names first (``begin_delta``) and refuses a base it does not hold before anything
lands (a *lost delta*: it missed a push). It pairs each tensor's index and values (they may come
in different buckets: buckets are per dtype), checks them (:func:`check_delta`: dtypes, shapes,
indices strictly increasing and in range) and applies them (:func:`apply_delta`). A delta push is
complete when every tensor the receiver holds was sent dense, sent as a delta or named unchanged.

Verification is a full push's: coverage of every tensor the receiver holds, and ``exact``: the
receiver's checksums of all its tensors after the push against the sender's of all its current
tensors, so a corrupted delta or a missed element fails the push naming tensors, and nothing drifts.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from rlcore.errors import WeightSyncError

__all__ = ["DELTA_KINDS", "DELTA_TAG", "FULL_REASONS", "DeltaEncoder", "DeltaIntake", "DeltaPlan", "apply_delta",
           "check_delta", "delta_name", "parse_delta_name"]

#: what marks an encoded tensor's name (checkpoint names never hold an ``@``)
DELTA_TAG = "@delta."
DELTA_KINDS = ("rows", "elements")
#: why a push went full (``SyncReport.details["delta_reason"]``)
FULL_REASONS = ("first", "base_mismatch", "after_failure", "periodic", "too_large")
#: how many tensors of a push went each way (``details["delta_tensors_<kind>"]``)
COUNTED = ("unchanged", "rows", "elements", "dense")
_PARTS = ("index", "values")
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def delta_name(name: str, kind: str, part: str) -> str:
    """``<name>@delta.<kind>.<part>``: the name an encoded piece of ``name`` travels under."""
    return f"{name}{DELTA_TAG}{kind}.{part}"


def parse_delta_name(name: str) -> tuple[str, str, str] | None:
    """``(tensor, kind, part)`` of an encoded name; None for a checkpoint name. A name with the
    tag but no known kind or part is refused."""
    base, tag, rest = name.rpartition(DELTA_TAG)
    if not tag:
        return None
    kind, _, part = rest.partition(".")
    if not base or kind not in DELTA_KINDS or part not in _PARTS:
        raise WeightSyncError(f"malformed delta tensor name {name!r}: expected <name>{DELTA_TAG}<rows|elements>."
                              f"<index|values>", receiver_version=None)
    return base, kind, part


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _index_dtype(limit: int) -> torch.dtype:
    return torch.int32 if limit < 2**31 else torch.int64


def _changed(t: torch.Tensor, snap: torch.Tensor) -> torch.Tensor:
    """Where ``t``'s bytes differ from ``snap``'s (a bool tensor of ``t``'s shape)."""
    bits = _BITS.get(t.element_size())
    return t.view(bits) != snap.view(bits) if bits is not None else t != snap


@dataclass
class DeltaPlan:
    """One push as :meth:`DeltaEncoder.plan` made it: ``stream`` is what travels (``named`` itself
    for a full push); ``base`` the version a delta applies to (None: full, ``reason`` says why)."""

    named: list[tuple[str, torch.Tensor]]
    stream: list[tuple[str, torch.Tensor]]
    base: int | None
    reason: str | None
    model_bytes: int
    unchanged: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def full(self) -> bool:
        return self.base is None

    @property
    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every tensor of the trainer's, as coverage checks them (not the encoded pieces)."""
        return [(n, tuple(t.shape)) for n, t in self.named]

    def details(self) -> dict[str, Any]:
        """What ``SyncReport.details`` says of it (written to metrics by :mod:`rlcore.push`)."""
        out: dict[str, Any] = {"delta": "full" if self.full else "delta", "model_bytes": self.model_bytes,
                               "delta_seconds": self.seconds,
                               **{f"delta_tensors_{k}": int(self.counts.get(k, 0)) for k in COUNTED}}
        if self.full:
            out["delta_reason"] = self.reason
        return out


class DeltaEncoder:
    """The sender's side of ``sync.delta`` (see the module docstring). ``max_ratio``:
    ``sync.delta_max_ratio``; ``full_every``: ``sync.delta_full_every`` (0: never periodic)."""

    def __init__(self, max_ratio: float = 0.5, full_every: int = 20):
        self.max_ratio = float(max_ratio)
        self.full_every = int(full_every)
        #: every tensor as the receiver holds it (one copy of the model, on the tensors' device)
        self.snapshot: dict[str, torch.Tensor] = {}
        #: the version the receiver holds, as of the last verified push (None: the next push is full)
        self.base: int | None = None
        self._failed = False
        self._since_full = 0

    def _full_reason(self, named: list[tuple[str, torch.Tensor]], receiver_version: int) -> str | None:
        if self.base is None:
            return "after_failure" if self._failed else "first"
        if receiver_version != self.base or not self._same_layout(named):
            return "base_mismatch"
        if self.full_every and self._since_full + 1 >= self.full_every:
            return "periodic"
        return None

    def _same_layout(self, named: list[tuple[str, torch.Tensor]]) -> bool:
        """The snapshot has ``named``'s names, shapes, dtypes and devices."""
        snap = self.snapshot
        return len(named) == len(snap) and all(
            n in snap and snap[n].shape == t.shape and snap[n].dtype == t.dtype and snap[n].device == t.device
            for n, t in named)

    def plan(self, weights: Iterable[tuple[str, torch.Tensor]], receiver_version: int) -> DeltaPlan:
        """This push: full (why) or a delta from :attr:`base` (each tensor's encoding)."""
        t0 = time.perf_counter()
        named = [(n, t.detach()) for n, t in weights]
        model_bytes = sum(_nbytes(t) for _, t in named)
        reason = self._full_reason(named, receiver_version)
        kinds: list[str] = []
        if reason is None:
            kinds, encoded = self._choose(named)
            if encoded > self.max_ratio * model_bytes:
                reason = "too_large"
        if reason is not None:
            return DeltaPlan(named, named, None, reason, model_bytes, counts={"dense": len(named)},
                             seconds=time.perf_counter() - t0)
        stream: list[tuple[str, torch.Tensor]] = []
        unchanged = []
        for (name, t), kind in zip(named, kinds, strict=True):
            if kind == "unchanged":
                unchanged.append(name)
            elif kind == "dense":
                stream.append((name, t))
            else:
                stream += self._encode(name, t, kind)
        return DeltaPlan(named, stream, self.base, None, model_bytes, unchanged, dict(Counter(kinds)),
                         time.perf_counter() - t0)

    def _choose(self, named: list[tuple[str, torch.Tensor]]) -> tuple[list[str], int]:
        """Each tensor's smallest encoding and the push's encoded bytes, from the change counts
        (one read of them for the lot; the masks are not kept)."""
        if not named:
            return [], 0
        dev = named[0][1].device
        stats = []
        for name, t in named:
            diff = _changed(t, self.snapshot[name])
            rows = diff.any(dim=1).sum() if t.dim() == 2 else diff.new_zeros((), dtype=torch.int64)
            stats.append(torch.stack([diff.sum(), rows]).to(dev))
        counts = torch.stack(stats).tolist()
        kinds, total = [], 0
        for (_, t), (n_el, n_rows) in zip(named, counts, strict=True):
            if n_el == 0:
                kinds.append("unchanged")
                continue
            es = t.element_size()
            costs = {"elements": n_el * (_index_dtype(t.numel()).itemsize + es), "dense": _nbytes(t)}
            if t.dim() == 2:
                costs["rows"] = n_rows * (_index_dtype(t.shape[0]).itemsize + t.shape[1] * es)
            kind = min(("rows", "elements", "dense"), key=lambda k: costs.get(k, float("inf")))
            kinds.append(kind)
            total += costs[kind]
        return kinds, total

    def _encode(self, name: str, t: torch.Tensor, kind: str) -> list[tuple[str, torch.Tensor]]:
        diff = _changed(t, self.snapshot[name])
        if kind == "rows":
            index = diff.any(dim=1).nonzero().squeeze(1)
            values, limit = t.index_select(0, index), t.shape[0]
        else:
            index = diff.reshape(-1).nonzero().squeeze(1)
            values, limit = t.reshape(-1).index_select(0, index), t.numel()
        return [(delta_name(name, kind, "index"), index.to(_index_dtype(limit))),
                (delta_name(name, kind, "values"), values)]

    def committed(self, plan: DeltaPlan, version: int) -> None:
        """``plan`` was pushed as ``version`` and verified: the receiver holds ``plan.named`` now."""
        with torch.no_grad():
            if not self._same_layout(plan.named):
                self.snapshot = {n: t.clone(memory_format=torch.contiguous_format) for n, t in plan.named}
            else:  # the snapshot's layout holds: copy what changed into it (a full push: every tensor)
                keep = set(plan.unchanged)
                for n, t in plan.named:
                    if n not in keep:
                        self.snapshot[n].copy_(t)
        self._since_full = 0 if plan.full else self._since_full + 1
        self.base, self._failed = version, False

    def failed(self) -> None:
        """A push failed: what the receiver holds is not known any more (the next push is full)."""
        self.base, self._failed = None, True


def check_delta(dst: torch.Tensor, kind: str, index: torch.Tensor, values: torch.Tensor, name: str,
                receiver_version: int | None = None) -> None:
    """Refuse, before it lands, a delta for ``dst`` (the weight ``name``) that cannot be its own:
    index 1-D int32/int64, strictly increasing, in range; values of ``dst``'s dtype and shape."""
    limit = dst.shape[0] if kind == "rows" and dst.dim() else dst.numel()
    want = (index.numel(), *dst.shape[1:]) if kind == "rows" else (index.numel(),)
    why = None
    if kind == "rows" and dst.dim() != 2:
        why = f"rows of a {dst.dim()}-D tensor"
    elif index.dim() != 1 or index.dtype not in (torch.int32, torch.int64):
        why = f"index is {index.dtype} {tuple(index.shape)}, expected a 1-D int32 or int64 tensor"
    elif values.dtype != dst.dtype:
        why = f"values are {values.dtype}, the weight is {dst.dtype}"
    elif tuple(values.shape) != want:
        why = f"values of shape {tuple(values.shape)} for {index.numel()} indices, expected {want}"
    elif index.numel() and not bool((index[0] >= 0) & (index[-1] < limit) & (index[1:] > index[:-1]).all()):
        why = f"indices not strictly increasing in [0, {limit})"
    if why is not None:
        raise WeightSyncError(f"delta for weight {name!r} ({kind}) refused: {why}", receiver_version=receiver_version)


def apply_delta(dst: torch.Tensor, kind: str, index: torch.Tensor, values: torch.Tensor) -> None:
    """Write a checked delta into ``dst`` (rows, or flat elements)."""
    idx = index.to(device=dst.device, dtype=torch.int64)
    values = values.to(dst.device)
    with torch.no_grad():
        if kind == "rows":
            dst.index_copy_(0, idx, values)
        elif dst.is_contiguous():
            dst.view(-1).index_copy_(0, idx, values)
        else:
            dst.index_put_(torch.unravel_index(idx, dst.shape), values)


class DeltaIntake:
    """A receiver's side of one delta push of ``version`` from ``base_version``: the tensors it
    declares ``unchanged`` (each one ``holds``) and each encoded tensor's pieces until both came."""

    def __init__(self, version: int, base_version: int, unchanged: Iterable[str], holds: Mapping[str, Any],
                 receiver_version: int | None = None):
        self.version, self.base, self.receiver_version = version, base_version, receiver_version
        self.unchanged = frozenset(unchanged)
        self.holds = holds
        bad = sorted(self.unchanged - set(holds))
        self._fail_unless(not bad, f"declares unchanged {len(bad)} tensor(s) the receiver does not hold "
                                   f"(e.g. {bad[:3]})")
        self._parts: dict[str, dict[str, Any]] = {}
        self.arrived: set[str] = set()

    def _fail_unless(self, ok: bool, why: str) -> None:
        if not ok:
            raise WeightSyncError(f"delta push of version {self.version} (from {self.base}) {why}",
                                  receiver_version=self.receiver_version)

    def split(self, named: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[tuple[str, torch.Tensor]],
                                                                         list[tuple[str, str, str, torch.Tensor]]]:
        """``named``'s tensors sent whole, and its encoded pieces as ``(tensor, kind, part, piece)``;
        a tensor sent twice, or sent and declared unchanged, is refused."""
        dense, parts = [], []
        for name, t in named:
            parsed = parse_delta_name(name)
            base = name if parsed is None else parsed[0]
            self._fail_unless(base in self.holds or parsed is None, f"sent a delta for {base!r}, which the receiver "
                                                                    f"does not hold")
            self._fail_unless(base not in self.unchanged, f"sent {base!r}, which it declares unchanged")
            if parsed is None:
                self._fail_unless(name not in self.arrived, f"sent {name!r} twice")
                self.arrived.add(name)
                dense.append((name, t))
            else:
                parts.append((*parsed, t))
        return dense, parts

    def take(self, name: str, kind: str, part: str, piece: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Hold ``piece``; ``(index, values)`` once both pieces of ``name`` are here."""
        got = self._parts.setdefault(name, {"kind": kind})
        self._fail_unless(name not in self.arrived and got["kind"] == kind and part not in got,
                          f"sent {name!r} twice (or as two kinds of delta)")
        got[part] = piece
        if len(got) < 3:
            return None
        del self._parts[name]
        self.arrived.add(name)
        return got["index"], got["values"]

    def check_done(self) -> None:
        """Every encoded tensor came with both its pieces."""
        self._fail_unless(not self._parts, f"left {len(self._parts)} delta(s) without their index or values "
                                           f"(e.g. {sorted(self._parts)[:3]})")
