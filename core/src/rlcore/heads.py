"""The ``reference`` forward_fn: per-token log-probs and entropy in fp32, chunked over tokens.

It is the semantics every other head (``fused``) must match, written for clarity and bounded
memory rather than speed:

* only unmasked tokens are computed (masked ones cost nothing and get 0);
* logits are formed in fp32 (``hidden.float() @ weight.float().T``), divided by the temperature
  (a float or a per-token tensor), and the softmax statistics are fp32;
* padding rows of the vocabulary (ids ``>= vocab.vocab_size``) are excluded;
* tokens are processed in chunks of ``chunk_tokens`` under activation checkpointing, so at most
  one ``[chunk, V_local]`` block of logits exists at a time, in forward and in backward;
* under vocab sharding each rank computes ``(max, Σexp, Σexp·(z-max), target logit)`` for its
  rows; the maxima are combined with one MAX all-reduce and the rest with one packed SUM
  all-reduce; the hidden-state gradient is summed over the group (or reduce-scattered under
  sequence parallelism).

Entropy uses ``H = log S - W / S`` with ``W = Σ e^{z-m} (z - m)``, which has no cancellation.
``Σπ²`` (when asked) is ``Q / S²`` with ``Q = Σ e^{2(z-m)}`` summed in the same all-reduce: with
``m`` the global max every term is at most 1, and a rank's shard cannot overflow the sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from rlcore.distributed import (
    all_reduce_max,
    copy_to_group,
    gather_from_sequence_parallel,
    group_size,
    reduce_from_group,
)
from rlcore.errors import BatchShapeError
from rlcore.types import HeadInput, HeadOutput, VocabShard

__all__ = ["ReferenceHead", "check_head_input", "reference_logprobs"]


def check_head_input(inp: HeadInput) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Validate a :class:`HeadInput` (errors say the expected shape) for any forward_fn.

    Returns ``(hidden, mask)``: hidden ``[T, H]`` (gathered over the group when sequence
    parallel) and the loss mask as ``[T]`` bool on hidden's device, or ``None`` when every
    position counts (so a head need not build and scan an all-True mask).
    """
    h, w = inp.hidden, inp.weight
    if h.dim() != 2:
        raise BatchShapeError(f"hidden must be [T, H], got {tuple(h.shape)}")
    if w.dim() != 2 or w.shape[1] != h.shape[1]:
        raise BatchShapeError(f"weight must be [V_local, H={h.shape[1]}], got {tuple(w.shape)}")
    if w.shape[0] != inp.vocab.rows:
        raise BatchShapeError(
            f"weight has {w.shape[0]} rows but the vocab shard says [{inp.vocab.start}, {inp.vocab.end}) "
            f"= {inp.vocab.rows} rows"
        )
    if inp.sequence_parallel:
        h = gather_from_sequence_parallel(h, inp.vocab.group)
    T = h.shape[0]
    if inp.labels.shape != (T,):
        raise BatchShapeError(f"labels must be [T={T}], got {tuple(inp.labels.shape)}")
    mask = inp.loss_mask
    if mask is not None and mask.shape != (T,):
        raise BatchShapeError(f"loss_mask must be [T={T}], got {tuple(mask.shape)}")
    temp = inp.temperature
    if isinstance(temp, torch.Tensor) and temp.dim() > 0 and temp.shape != (T,):
        raise BatchShapeError(f"per-token temperature must be [T={T}], got {tuple(temp.shape)}")
    return h, (None if mask is None else mask.to(device=h.device, dtype=torch.bool))


def _chunk_stats(
    h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, inv_temp: torch.Tensor,
    start: int, group, compute_entropy: bool, compute_sum_sq: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    z = (h.float() @ w.float().t()) * inv_temp[:, None]  # [c, V_valid] fp32
    if z.shape[1] > 0:
        m_local = z.max(dim=1).values
    else:
        m_local = torch.full((z.shape[0],), float("-inf"), device=z.device)
    m = all_reduce_max(m_local, group)
    zs = z - m[:, None]
    e = torch.exp(zs)
    s = e.sum(dim=1)
    wsum = (e * zs).sum(dim=1) if compute_entropy else torch.zeros_like(s)
    local = (labels >= start) & (labels < start + z.shape[1])
    idx = (labels - start).clamp(0, max(z.shape[1] - 1, 0))
    tgt = zs.gather(1, idx[:, None]).squeeze(1) if z.shape[1] > 0 else torch.zeros_like(s)
    tgt = torch.where(local, tgt, torch.zeros_like(tgt))
    rows = [s, wsum, tgt]
    if compute_sum_sq:  # Σπ² = Σ e^{2(z-m)} / S², no gradient (an estimator's input, not a loss term)
        rows.append((e.detach() ** 2).sum(dim=1))
    stats = reduce_from_group(torch.stack(rows), group)
    S, W, Z = stats[0], stats[1], stats[2]
    log_s = torch.log(S)
    logprob = Z - log_s
    entropy = (log_s - W / S).clamp_min(0.0) if compute_entropy else torch.zeros_like(logprob)
    sum_sq = (stats[3] / S.detach() ** 2).detach() if compute_sum_sq else torch.zeros_like(logprob).detach()
    return logprob, entropy, sum_sq


def reference_logprobs(inp: HeadInput, chunk_tokens: int = 2048) -> HeadOutput:
    """The reference semantics of a forward_fn (see module docstring)."""
    h, mask = check_head_input(inp)
    if mask is None:
        mask = torch.ones(h.shape[0], dtype=torch.bool, device=h.device)
    vocab: VocabShard = inp.vocab
    group = vocab.group
    if group_size(group) > 1 and not inp.sequence_parallel:
        h = copy_to_group(h, group)
    T = h.shape[0]
    idx = mask.nonzero().squeeze(1)
    labels = inp.labels.index_select(0, idx)
    bad = (labels < 0) | (labels >= vocab.vocab_size)
    if bool(bad.any()):
        raise BatchShapeError(
            f"labels at unmasked positions must be in [0, {vocab.vocab_size}); found "
            f"{labels[bad][:4].tolist()}"
        )
    temp = inp.temperature
    if isinstance(temp, torch.Tensor) and temp.dim() > 0:
        inv_temp = 1.0 / temp.to(h.device, torch.float32).index_select(0, idx)
    else:
        t = float(temp)
        if t <= 0:
            raise ValueError(f"temperature must be > 0, got {t}")
        inv_temp = torch.full((idx.numel(),), 1.0 / t, device=h.device)
    w_valid = inp.weight[: vocab.valid_rows]
    hs = h.index_select(0, idx)
    lps, ents, sqs = [], [], []
    for lo in range(0, idx.numel(), max(1, chunk_tokens)):
        hi = min(lo + chunk_tokens, idx.numel())
        args = (hs[lo:hi], w_valid, labels[lo:hi], inv_temp[lo:hi], vocab.start, group, inp.compute_entropy,
                inp.compute_sum_pi_squared)
        if torch.is_grad_enabled() and (hs.requires_grad or w_valid.requires_grad):
            lp, ent, sq = checkpoint(_chunk_stats, *args, use_reentrant=False)
        else:
            lp, ent, sq = _chunk_stats(*args)
        lps.append(lp)
        ents.append(ent)
        sqs.append(sq)
    zeros = torch.zeros(T, dtype=torch.float32, device=h.device)
    sum_sq = None
    if idx.numel():
        logprobs = zeros.index_put((idx,), torch.cat(lps))
        entropy = zeros.index_put((idx,), torch.cat(ents)) if inp.compute_entropy else None
        if inp.compute_sum_pi_squared:
            sum_sq = zeros.index_put((idx,), torch.cat(sqs)).detach()
    else:
        logprobs = zeros + h.sum() * 0.0  # keeps the graph connected
        entropy = zeros.clone() if inp.compute_entropy else None
        sum_sq = zeros.clone() if inp.compute_sum_pi_squared else None
    return HeadOutput(logprobs=logprobs, entropy=entropy, sum_pi_squared=sum_sq)


@dataclass
class ReferenceHead:
    """The built-in ``reference`` forward_fn."""

    chunk_tokens: int = 2048

    def __call__(self, inp: HeadInput) -> HeadOutput:
        return reference_logprobs(inp, self.chunk_tokens)
