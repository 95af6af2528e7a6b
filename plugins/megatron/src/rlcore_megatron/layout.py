"""How a :class:`~rlcore.batch.PackedBatch` is laid out for megatron-core, and the maps back.

Two layouts (the engine's ``attention_path`` picks one; the engine module's docstring says why):
:class:`PaddedLayout`, one row per sequence, and :class:`ThdLayout`, ``[1, T]`` with
``PackedSeqParams`` for THD attention (Transformer Engine's, or :mod:`.varlen_attention`'s
without it). Both give megatron's
inputs, map its ``[s, b, h]`` output back onto the packed token axis, shift the token stream for
MTP within each sequence, and map per-token tensors to and from the rows MoE routers see.
"""

from __future__ import annotations

from typing import Any

import torch
from rlcore.batch import PackedBatch
from rlcore.errors import RLCoreError

from rlcore_megatron.weights import Parallel


class PackedLayout:
    """How a packed batch is laid out for megatron, and the maps back (see module docstring).
    ``to_rows``/``from_rows`` map packed per-token tensors to the rows MoE routers see."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    model_kwargs: dict[str, Any]
    router_tokens: int
    router_offset: int

    def to_packed(self, hidden_sbh: torch.Tensor) -> torch.Tensor: ...

    def shifted_input_ids(self, d: int) -> torch.Tensor: ...

    def mtp_embedding_kept(self, d: int) -> torch.Tensor:
        """``[s, b, 1]`` float: 1 where MTP depth ``d``'s token embedding is kept in MiMo's
        semantics (the token ``t + d`` exists in the same sequence and ``t`` is not the
        sequence's first position), 0 elsewhere."""
        batch = self.batch
        kept = torch.ones(batch.num_tokens, dtype=torch.bool)
        for _ in range(d):
            kept = batch.roll(kept, -1, fill=False)
        kept &= batch.position_ids().cpu() != 0
        return self._to_model_layout(kept.to(self.device)).transpose(0, 1)[..., None].float()

    def _to_model_layout(self, x: torch.Tensor) -> torch.Tensor: ...

    def to_rows(self, x: torch.Tensor) -> torch.Tensor: ...

    def from_rows(self, x: torch.Tensor) -> torch.Tensor: ...


class PaddedLayout(PackedLayout):
    """One row per sequence, ``[B, L]``; megatron runs ``[s, b]``, so router row ``s * B + b``."""

    def __init__(self, batch: PackedBatch, device: torch.device):
        lay = batch.layout
        self.batch = batch
        self.B = B = lay.num_seqs
        self.L = L = int(lay.padded_lens.max()) if B else 0
        seq, off = lay.seq_index(), lay.offsets()
        self.flat = (seq * L + off).to(device)  # packed t -> row-major [B, L] index
        self.rows = (off * B + seq).to(device)  # packed t -> router row ([s, b] order)
        self.pad_id = batch.pad_id
        self.device = device
        self.input_ids = self._scatter(batch.input_ids.to(device))
        self.position_ids = torch.arange(L, device=device).expand(B, L)
        self.attention_mask = torch.triu(torch.ones(L, L, dtype=torch.bool, device=device), diagonal=1)[None, None]
        self.model_kwargs = {}
        self.router_tokens = batch.num_tokens
        self.router_offset = 0

    def _scatter(self, ids: torch.Tensor) -> torch.Tensor:
        out = torch.full((self.B * self.L,), self.pad_id, dtype=torch.long, device=self.device)
        return out.index_copy(0, self.flat, ids).view(self.B, self.L)

    def _to_model_layout(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(self.B * self.L, dtype=x.dtype, device=self.device)
        return out.index_copy(0, self.flat, x).view(self.B, self.L)

    def to_packed(self, hidden_sbh: torch.Tensor) -> torch.Tensor:
        h = hidden_sbh.transpose(0, 1).reshape(self.B * self.L, -1)
        return h.index_select(0, self.flat)

    def shifted_input_ids(self, d: int) -> torch.Tensor:
        ids = self.batch.input_ids
        for _ in range(d):
            ids = self.batch.roll(ids, -1, fill=self.pad_id)
        return self._scatter(ids.to(self.device))

    def to_rows(self, x: torch.Tensor) -> torch.Tensor:
        fill = 0 if x.is_floating_point() else -1
        out = torch.full((self.B * self.L, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
        return out.index_copy(0, self.rows.to(x.device), x)

    def from_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_select(0, self.rows.to(x.device))


class ThdLayout(PackedLayout):
    """``[1, T]`` with ``PackedSeqParams(qkv_format="thd")`` (TE or :mod:`.varlen_attention`).
    Under sequence parallelism this rank's routers see tokens ``[rank * T/tp, (rank+1) * T/tp)``."""

    def __init__(self, batch: PackedBatch, device: torch.device, par: Parallel, sequence_parallel: bool):
        from megatron.core.packed_seq_params import PackedSeqParams

        lay = batch.layout
        self.batch = batch
        self.device = device
        self.input_ids = batch.input_ids.to(device)[None]
        self.position_ids = batch.position_ids().to(device)[None]
        self.attention_mask = None
        cu = lay.cu_seqlens.to(device=device, dtype=torch.int32)
        cu_p = lay.cu_seqlens_padded.to(device=device, dtype=torch.int32)
        max_len = int(lay.padded_lens.max()) if lay.num_seqs else 0
        self.model_kwargs = {"packed_seq_params": PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_p,
            cu_seqlens_kv_padded=cu_p, max_seqlen_q=max_len, max_seqlen_kv=max_len)}
        T = batch.num_tokens
        self.sp_group = par.tp_group if sequence_parallel and par.tp_size > 1 else None
        if self.sp_group is not None:
            if T % par.tp_size:
                raise RLCoreError(f"sequence parallelism needs T={T} divisible by tp={par.tp_size} (sequence_alignment)")
            self.router_tokens = T // par.tp_size
            self.router_offset = par.tp_rank * self.router_tokens
        else:
            self.router_tokens = T
            self.router_offset = 0

    def to_packed(self, hidden_sbh: torch.Tensor) -> torch.Tensor:
        return hidden_sbh[:, 0]

    def _to_model_layout(self, x: torch.Tensor) -> torch.Tensor:
        if self.sp_group is not None:  # this rank's slice of the sequence, as megatron scatters it
            x = x[self.router_offset:self.router_offset + self.router_tokens]
        return x[None]

    def shifted_input_ids(self, d: int) -> torch.Tensor:
        ids = self.batch.input_ids
        for _ in range(d):
            ids = self.batch.roll(ids, -1, fill=self.batch.pad_id)
        return ids.to(self.device)[None]

    def to_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x  # the RouterCall already covers exactly this rank's rows

    def from_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x


def make_layout(batch: PackedBatch, attention_path: str, device: torch.device, par: Parallel,
                sequence_parallel: bool) -> PackedLayout:
    """The layout of ``batch`` for the engine's attention path (``thd`` or ``padded``)."""
    if attention_path == "thd":
        return ThdLayout(batch, device, par, sequence_parallel)
    return PaddedLayout(batch, device)
