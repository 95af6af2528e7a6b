"""The packed batch: one THD layout carries a step from rollout to loss.

A step's samples (prompt + response token ids) are concatenated into one flat token axis. The
:class:`PackedLayout` is computed once and shared by everything per-token: input ids, labels,
the loss mask, behaviour log-probs, advantages and routed experts. ``pack``, ``unpack`` and
``roll`` live here and nowhere else.

Alignment conventions (see :mod:`rlcore.types`):

* ``input_ids[t]`` is the token at position ``t``; ``labels()[t]`` is the token it predicts,
  ``input_ids[t + 1]`` of the same sequence.
* *target fields* (log-probs, advantages) and ``loss_mask`` are label-aligned: the value at
  ``t`` is about the token ``t + 1``. :meth:`PackedBatch.pack` takes them indexed by the token
  they describe and shifts them once.
* *input fields* (routed experts) are indexed by the position whose forward produced them.
* Sequences are padded to a multiple of ``align`` (tensor/context-parallel engines need it);
  padding positions have ``pad_id``, mask False, and the fill value in every field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from rlcore.errors import BatchShapeError

__all__ = [
    "PackedBatch", "PackedLayout", "ROUTES_NATIVE", "compact_routes", "expand_routes", "route_id_dtype",
    "routes_of", "sample_routes",
]


def _as_tensor(x: Any, what: str) -> torch.Tensor:
    try:
        return torch.as_tensor(x)
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:  # ragged, text, ints beyond int64
        raise BatchShapeError(f"{what} is not a tensor of numbers: {exc}") from exc


def _as_1d_long(x: Any, what: str) -> torch.Tensor:
    t = _as_tensor(x, what)
    if t.dim() != 1:
        raise BatchShapeError(f"{what} must be 1-D token ids, got shape {tuple(t.shape)}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise BatchShapeError(f"{what} must be integer token ids, got {t.dtype}")
    if t.numel() and int(t.min()) < 0:
        raise BatchShapeError(f"{what} has negative token id {int(t.min())}")
    return t.to(torch.long)


def _default_fill(dtype: torch.dtype) -> int | float | bool:
    if dtype == torch.bool:
        return False
    if dtype.is_floating_point:
        return 0.0
    return -1


@dataclass
class PackedLayout:
    """Where each sequence lives on the packed token axis.

    ``cu_seqlens`` are the cumulative raw lengths ``[B + 1]`` (int32, as flash-attention and
    Megatron's ``PackedSeqParams`` take them); ``cu_seqlens_padded`` the cumulative lengths
    after each sequence was padded to a multiple of ``align`` (the last one may carry extra
    padding so the total is a multiple of ``align_total``). Positions are addressed through the
    padded offsets.
    """

    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    align: int = 1

    def __post_init__(self) -> None:
        if self.cu_seqlens.shape != self.cu_seqlens_padded.shape:
            raise BatchShapeError(
                f"cu_seqlens {tuple(self.cu_seqlens.shape)} and cu_seqlens_padded "
                f"{tuple(self.cu_seqlens_padded.shape)} must both be [num_seqs + 1]"
            )

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], align: int = 1, align_total: int = 1) -> PackedLayout:
        if align < 1 or align_total < 1:
            raise BatchShapeError(f"align ({align}) and align_total ({align_total}) must be >= 1")
        lens = torch.as_tensor(list(lengths), dtype=torch.int64)
        if lens.numel() and int(lens.min()) < 1:
            raise BatchShapeError("every packed sequence needs at least one token")
        padded = (lens + align - 1) // align * align
        if padded.numel() and align_total > 1:
            total = int(padded.sum())
            extra = (-total) % align_total
            padded[-1] += extra
        zero = torch.zeros(1, dtype=torch.int64)
        cu = torch.cat([zero, lens.cumsum(0)]).to(torch.int32)
        cu_p = torch.cat([zero, padded.cumsum(0)]).to(torch.int32)
        return cls(cu, cu_p, align)

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def seq_lens(self) -> torch.Tensor:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).to(torch.int64)

    @property
    def padded_lens(self) -> torch.Tensor:
        return (self.cu_seqlens_padded[1:] - self.cu_seqlens_padded[:-1]).to(torch.int64)

    @property
    def starts(self) -> torch.Tensor:
        """Padded start offset of each sequence on the token axis."""
        return self.cu_seqlens_padded[:-1].to(torch.int64)

    @property
    def total_tokens(self) -> int:
        return int(self.cu_seqlens_padded[-1]) if self.num_seqs else 0

    @property
    def max_seqlen(self) -> int:
        return int(self.seq_lens.max()) if self.num_seqs else 0

    def seq_index(self) -> torch.Tensor:
        """``[T]`` int64: the sequence each position belongs to (its padding included)."""
        return torch.repeat_interleave(torch.arange(self.num_seqs), self.padded_lens)

    def offsets(self) -> torch.Tensor:
        """``[T]`` int64: each position's offset within its sequence (restarts at 0)."""
        seq = self.seq_index()
        return torch.arange(self.total_tokens) - self.starts[seq]

    def valid(self) -> torch.Tensor:
        """``[T]`` bool: True on real tokens, False on alignment padding."""
        seq = self.seq_index()
        return self.offsets() < self.seq_lens[seq]

    def position_ids(self) -> torch.Tensor:
        """``[T]`` int64 positions restarting at 0 for every sequence (padding continues)."""
        return self.offsets()

    def padded_positions(self, seq: int) -> slice:
        return slice(int(self.cu_seqlens_padded[seq]), int(self.cu_seqlens_padded[seq + 1]))


@dataclass
class PackedBatch:
    """A step (or micro-batch) of packed sequences with every per-token field aligned to it.

    ``fields`` hold per-token tensors ``[T, ...]`` (``old_logprobs``, ``advantages``,
    ``ref_logprobs``, ``routes`` ...), ``seq_fields`` per-sequence tensors ``[B, ...]``
    (``reward``, ``group``, ``sample_index`` ...). ``token_offset``/``seq_offset`` locate a
    micro-batch inside the step batch it was split from.
    """

    layout: PackedLayout
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    seq_fields: dict[str, torch.Tensor] = field(default_factory=dict)
    pad_id: int = 0
    token_offset: int = 0
    seq_offset: int = 0

    def __post_init__(self) -> None:
        T = self.layout.total_tokens
        if self.input_ids.shape != (T,):
            raise BatchShapeError(f"input_ids must be [T={T}], got {tuple(self.input_ids.shape)}")
        if self.loss_mask.shape != (T,):
            raise BatchShapeError(f"loss_mask must be [T={T}], got {tuple(self.loss_mask.shape)}")
        for k, v in self.fields.items():
            if v.dim() == 0 or v.shape[0] != T:
                raise BatchShapeError(
                    f"per-token field {k!r} must have T={T} rows, got shape {tuple(v.shape)}"
                )
        B = self.layout.num_seqs
        for k, v in self.seq_fields.items():
            if v.dim() == 0 or v.shape[0] != B:
                raise BatchShapeError(
                    f"per-sequence field {k!r} must have B={B} rows, got shape {tuple(v.shape)}"
                )

    # ------------------------------------------------------------------ construction -----

    @classmethod
    def pack(
        cls,
        sequences: Sequence[Any],
        response_starts: Sequence[int],
        *,
        target_fields: Mapping[str, Sequence[Any]] | None = None,
        input_fields: Mapping[str, Sequence[Any]] | None = None,
        seq_fields: Mapping[str, Any] | None = None,
        align: int = 1,
        align_total: int = 1,
        pad_id: int = 0,
        response_masks: Sequence[Any | None] | None = None,
    ) -> PackedBatch:
        """Pack variable-length sequences.

        :param sequences: token ids per sequence (prompt followed by response).
        :param response_starts: index of each sequence's first response token; the loss mask
            covers the positions predicting tokens ``response_start .. len - 1``.
        :param target_fields: per sequence, a tensor about each token, either over the whole
            sequence (length ``L``) or over its response only (length ``L - response_start``);
            stored label-aligned (the value for token ``i`` lands at position ``i - 1``).
        :param input_fields: per sequence, a tensor ``[L, ...]`` or ``[L - 1, ...]`` indexed by
            input position (routes: the rollout engine reports every token but the last; the
            missing rows are filled with -1).
        :param seq_fields: per-sequence values, ``[B, ...]``.
        :param align: pad every sequence to a multiple of this (TP × CP × 2 for Megatron).
        :param align_total: pad the last sequence so the total is a multiple of this.
        :param response_masks: per sequence, ``None`` (every response token is a loss token) or a
            bool tensor over its response tokens (``L - response_start``), false on tokens the loss
            skips (a multi-turn sample's observations, which the model did not generate).
        """
        seqs = [_as_1d_long(s, f"sequences[{i}]") for i, s in enumerate(sequences)]
        if len(response_starts) != len(seqs):
            raise BatchShapeError(
                f"response_starts has {len(response_starts)} entries, expected one per sequence ({len(seqs)})"
            )
        lens = [s.numel() for s in seqs]
        for i, (rs, n) in enumerate(zip(response_starts, lens, strict=True)):
            if not 0 < rs <= n:
                raise BatchShapeError(
                    f"response_starts[{i}]={rs} must be in [1, {n}] for a sequence of {n} tokens"
                )
        layout = PackedLayout.from_lengths(lens, align=align, align_total=align_total)
        T = layout.total_tokens
        starts = layout.starts.tolist()

        input_ids = torch.full((T,), pad_id, dtype=torch.long)
        response = torch.zeros(T, dtype=torch.bool)
        masks = list(response_masks) if response_masks is not None else [None] * len(seqs)
        if len(masks) != len(seqs):
            raise BatchShapeError(f"response_masks has {len(masks)} entries, expected one per sequence ({len(seqs)})")
        for i, (s, st, rs, n, m) in enumerate(zip(seqs, starts, response_starts, lens, masks, strict=True)):
            input_ids[st : st + n] = s
            if m is None:
                response[st + rs : st + n] = True
                continue
            m = torch.as_tensor(m)
            if m.dtype != torch.bool or tuple(m.shape) != (n - rs,):
                raise BatchShapeError(f"response_masks[{i}] must be a bool tensor of the sequence's {n - rs} response "
                                      f"tokens, got {m.dtype} {tuple(m.shape)}")
            response[st + rs : st + n] = m
        probe = cls(layout, input_ids, response)  # token-aligned mask, rolled below
        loss_mask = probe.roll(response, -1, fill=False)

        fields: dict[str, torch.Tensor] = {}
        for name, per_seq in (target_fields or {}).items():
            token_aligned = cls._scatter_per_seq(
                name, per_seq, layout, lens, response_starts, kind="target"
            )
            fields[name] = probe.roll(token_aligned, -1)
        for name, per_seq in (input_fields or {}).items():
            fields[name] = cls._scatter_per_seq(name, per_seq, layout, lens, response_starts, kind="input")

        sf: dict[str, torch.Tensor] = {}
        for name, vals in (seq_fields or {}).items():
            sf[name] = torch.as_tensor(vals)
        return cls(layout, input_ids, loss_mask, fields, sf, pad_id=pad_id)

    @staticmethod
    def _scatter_per_seq(name, per_seq, layout, lens, response_starts, kind) -> torch.Tensor:
        if len(per_seq) != len(lens):
            raise BatchShapeError(
                f"field {name!r} has {len(per_seq)} entries, expected one per sequence ({len(lens)})"
            )
        values = [_as_tensor(v, f"field {name!r}[{i}]") for i, v in enumerate(per_seq)]
        for i, v in enumerate(values):
            if v.dim() == 0:
                raise BatchShapeError(f"field {name!r}[{i}] is a scalar; expected one row per token")
        first = values[0] if values else torch.zeros(0)
        trailing = tuple(first.shape[1:])
        out = torch.full((layout.total_tokens, *trailing), _default_fill(first.dtype), dtype=first.dtype)
        for i, (v, st, n, rs) in enumerate(zip(values, layout.starts.tolist(), lens, response_starts, strict=True)):
            if tuple(v.shape[1:]) != trailing:
                raise BatchShapeError(
                    f"field {name!r}[{i}] has trailing shape {tuple(v.shape[1:])}, expected {trailing}"
                )
            if kind == "target":
                if v.shape[0] == n:
                    out[st : st + n] = v
                elif v.shape[0] == n - rs:
                    out[st + rs : st + n] = v
                else:
                    raise BatchShapeError(
                        f"target field {name!r}[{i}] has {v.shape[0]} rows; expected {n} (whole "
                        f"sequence) or {n - rs} (response tokens)"
                    )
            else:
                if v.shape[0] == n:
                    out[st : st + n] = v
                elif v.shape[0] == n - 1:
                    out[st : st + n - 1] = v
                else:
                    raise BatchShapeError(
                        f"input field {name!r}[{i}] has {v.shape[0]} rows; expected {n} or {n - 1} "
                        f"(one per input position of a {n}-token sequence)"
                    )
        return out

    # --------------------------------------------------------------------- queries -------

    @property
    def num_tokens(self) -> int:
        return self.layout.total_tokens

    @property
    def num_seqs(self) -> int:
        return self.layout.num_seqs

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def position_ids(self) -> torch.Tensor:
        return self.layout.position_ids().to(self.device)

    def labels(self) -> torch.Tensor:
        """``[T]`` the token each position predicts (``pad_id`` where there is none)."""
        return self.roll(self.input_ids, -1, fill=self.pad_id)

    def seq_index(self) -> torch.Tensor:
        return self.layout.seq_index().to(self.device)

    # ----------------------------------------------------------------- transforms --------

    def roll(self, x: torch.Tensor, shifts: int = -1, fill: Any = None) -> torch.Tensor:
        """Shift ``x`` along the token axis within each sequence, never across a boundary.

        ``roll(x, -1)[t] == x[t + 1]`` when ``t + 1`` is in the same sequence, else ``fill``
        (the dtype's default: 0, False, or -1 for integers). Padding positions get ``fill``.
        """
        T = self.num_tokens
        if x.shape[0] != T:
            raise BatchShapeError(f"roll expects a tensor with T={T} rows, got {tuple(x.shape)}")
        if fill is None:
            fill = _default_fill(x.dtype)
        lay = self.layout
        seq = lay.seq_index()
        off = torch.arange(T) - lay.starts[seq]
        src_off = off - shifts
        ok = (off < lay.seq_lens[seq]) & (src_off >= 0) & (src_off < lay.seq_lens[seq])
        src = (lay.starts[seq] + src_off).clamp(0, max(T - 1, 0))
        ok = ok.to(x.device)
        src = src.to(x.device)
        out = x.index_select(0, src)
        mask = ok.view(-1, *([1] * (x.dim() - 1)))
        return torch.where(mask, out, torch.as_tensor(fill, dtype=x.dtype, device=x.device))

    def unpack(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Split a per-token tensor ``[T, ...]`` into one tensor per sequence (raw lengths)."""
        if x.shape[0] != self.num_tokens:
            raise BatchShapeError(f"unpack expects T={self.num_tokens} rows, got {tuple(x.shape)}")
        pieces = torch.split(x, self.layout.padded_lens.tolist(), dim=0)
        return [p[:n] for p, n in zip(pieces, self.layout.seq_lens.tolist(), strict=True)]

    def seq_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Per-sequence sum of a per-token tensor ``[T]`` → ``[B]`` (vectorised)."""
        out = torch.zeros(self.num_seqs, dtype=x.dtype, device=x.device)
        return out.index_add_(0, self.seq_index(), x)

    def with_fields(self, **fields: torch.Tensor) -> PackedBatch:
        new = dict(self.fields)
        new.update(fields)
        return replace(self, fields=new)

    def routes(self) -> torch.Tensor | None:
        """The routed experts this batch carries, ``[T, routed_layers, topk]`` int64 with ``-1``
        where a token routes natively, or ``None``. Read routes through this: the ``routes``
        field is stored compactly (:func:`compact_routes`)."""
        return routes_of(self.fields)

    def to(self, device: Any) -> PackedBatch:
        return replace(
            self,
            input_ids=self.input_ids.to(device),
            loss_mask=self.loss_mask.to(device),
            fields={k: v.to(device) for k, v in self.fields.items()},
            seq_fields={k: v.to(device) for k, v in self.seq_fields.items()},
        )

    def select_seqs(self, start: int, stop: int) -> PackedBatch:
        """The contiguous sequences ``[start, stop)`` as a batch of their own (views)."""
        lay = self.layout
        t0, t1 = int(lay.cu_seqlens_padded[start]), int(lay.cu_seqlens_padded[stop])
        r0 = int(lay.cu_seqlens[start])
        sub = PackedLayout(lay.cu_seqlens[start : stop + 1] - r0, lay.cu_seqlens_padded[start : stop + 1] - t0, lay.align)
        return PackedBatch(
            sub,
            self.input_ids[t0:t1],
            self.loss_mask[t0:t1],
            {k: v[t0:t1] for k, v in self.fields.items()},
            {k: v[start:stop] for k, v in self.seq_fields.items()},
            pad_id=self.pad_id,
            token_offset=self.token_offset + t0,
            seq_offset=self.seq_offset + start,
        )

    def micro_batches(self, max_tokens: int) -> list[PackedBatch]:
        """Split into micro-batches of whole sequences, each at most ``max_tokens`` (padded)
        tokens; a sequence longer than the budget gets a micro-batch of its own."""
        if max_tokens < 1:
            raise BatchShapeError(f"micro-batch token budget must be >= 1, got {max_tokens}")
        out: list[PackedBatch] = []
        lens = self.layout.padded_lens.tolist()
        start, used = 0, 0
        for i, n in enumerate(lens):
            if used and used + n > max_tokens:
                out.append(self.select_seqs(start, i))
                start, used = i, 0
            used += n
        if start < len(lens):
            out.append(self.select_seqs(start, len(lens)))
        return out

    def write_back(self, micro: PackedBatch, key: str, value: torch.Tensor) -> None:
        """Store a micro-batch's per-token ``value`` into this (step) batch's field ``key``."""
        t0 = micro.token_offset - self.token_offset
        t1 = t0 + micro.num_tokens
        if value.shape[0] != micro.num_tokens:
            raise BatchShapeError(
                f"batch update {key!r} must have the micro-batch's {micro.num_tokens} rows, got {tuple(value.shape)}"
            )
        cur = self.fields.get(key)
        if cur is None or tuple(cur.shape[1:]) != tuple(value.shape[1:]) or cur.dtype != value.dtype:
            cur = torch.full(
                (self.num_tokens, *value.shape[1:]), _default_fill(value.dtype), dtype=value.dtype, device=value.device
            )
            self.fields[key] = cur
        cur[t0:t1] = value.to(cur.device)


#: per-token fields of compact routes: expert ids (:func:`route_id_dtype`) and, per token and routed
#: layer, whether it routes natively (its ids are then meaningless)
ROUTES = "routes"
ROUTES_NATIVE = "routes_native"


def route_id_dtype(num_experts: int) -> torch.dtype:
    """The smallest dtype for expert ids: uint8 up to 256 experts, int16 up to 32768, else int32."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    return torch.int32


def compact_routes(routes: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, L, K]`` integer routes (``-1`` = route natively) → (ids ``[T, L, K]`` in
    :func:`route_id_dtype`, native ``[T, L]`` bool). Bytes per token: ``L·K·itemsize + L``
    (Qwen3-30B-A3B, 48 layers × top-8 of 128 experts: 432 B, against 768 B in int16). A native
    row's ids are ``num_experts`` where the dtype has room (an id out of range, refused loudly by
    any router that reads raw ids without the mask), else 0."""
    routes = routes.to(torch.int64)
    native = (routes < 0).any(dim=-1)
    dtype = route_id_dtype(num_experts)
    fill = num_experts if num_experts <= (255 if dtype == torch.uint8 else torch.iinfo(dtype).max) else 0
    ids = routes.masked_fill(native.unsqueeze(-1), fill).to(dtype)
    return ids, native


def expand_routes(ids: torch.Tensor, native: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`compact_routes`: int64 routes with ``-1`` rows where ``native``."""
    return ids.to(torch.int64).masked_fill(native.unsqueeze(-1), -1)


def routes_of(fields: Mapping[str, torch.Tensor], ids_key: str = ROUTES,
              native_key: str = ROUTES_NATIVE) -> torch.Tensor | None:
    """int64 routes with ``-1`` from a field mapping holding compact routes (ids + native mask),
    or plain signed routes with ``-1`` (no mask field); ``None`` when there are none."""
    ids = fields.get(ids_key)
    if ids is None:
        return None
    native = fields.get(native_key)
    if native is None:
        if ids.dtype == torch.uint8:
            raise BatchShapeError(f"field {ids_key!r} holds uint8 expert ids but no {native_key!r} mask says "
                                  f"which tokens route natively")
        return ids.to(torch.int64)
    return expand_routes(ids, native)


def sample_routes(routes: Any, layout: Any, seq_len: int, what: str) -> torch.Tensor:
    """One sample's routed experts from a rollout engine, checked and in ``layout`` order.

    ``routes`` is ``[rows, layers, topk]`` integer, ``rows`` being ``seq_len`` or ``seq_len - 1``
    (engines report every token but the last); ``layout`` a :class:`~rlcore.types.RouteLayout`.
    Returns ``[rows, layout.num_routed, topk]``, int16 when the expert ids fit, else int32; -1
    means "route natively". Raises :class:`BatchShapeError` naming ``what`` (the sample) for a
    wrong shape or dtype, an id outside ``[-1, num_experts)`` or an expert chosen twice for one
    token (a duplicate collapses in the routing map and silently changes the expert weights)."""
    try:
        t = torch.as_tensor(routes)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise BatchShapeError(f"{what}: routed experts are not a tensor of expert ids: {exc}") from exc
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise BatchShapeError(f"{what}: routed experts must be integer expert ids, got {t.dtype}")
    if t.dim() != 3 or t.shape[2] != layout.topk:
        raise BatchShapeError(f"{what}: routed experts must be [tokens, layers, topk={layout.topk}], "
                              f"got {tuple(t.shape)}")
    if t.shape[0] not in (seq_len, seq_len - 1):
        raise BatchShapeError(f"{what}: routed experts cover {t.shape[0]} tokens; the sample has {seq_len} "
                              f"(expected {seq_len} or {seq_len - 1} rows)")
    try:
        sel = layout.select(t.to(torch.int64))
    except ValueError as exc:
        raise BatchShapeError(f"{what}: {exc}") from exc
    if sel.numel():
        lo, hi = int(sel.min()), int(sel.max())
        if lo < -1 or hi >= layout.num_experts:
            bad = sel[(sel < -1) | (sel >= layout.num_experts)][:4].tolist()
            raise BatchShapeError(f"{what}: routed expert ids {bad} outside [0, {layout.num_experts}) "
                                  f"(-1 = route natively)")
        s = sel.sort(dim=-1).values
        dup = (s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)
        if bool(dup.any()):
            tok, layer = (int(x) for x in dup.any(dim=-1).nonzero()[0])
            raise BatchShapeError(f"{what}: token {tok} of routed layer {layer} lists an expert twice: "
                                  f"{sel[tok, layer].tolist()}")
    return sel.to(torch.int16 if layout.num_experts <= torch.iinfo(torch.int16).max else torch.int32)
