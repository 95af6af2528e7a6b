"""One micro-batch's policy loss: the glue between a :class:`~rlcore.batch.PackedBatch` whose
step-level fields are filled (advantages, aggregation numerators, mismatch weights, reference
log-probs) and the :class:`~rlcore.algorithms.losses.TokenObjective`."""

from __future__ import annotations

from dataclasses import replace

import torch

from rlcore.algorithms.losses import TokenObjective, kl_penalty, masked_inputs
from rlcore.algorithms.mismatch import MismatchCorrection, token_weights
from rlcore.algorithms.spec import TokenInputs, TokenLoss
from rlcore.types.forward import LossRequest

#: the step-batch fields the trainer fills before the train pass
ROLLOUT = "old_logprobs"  #: behaviour log-probs from the rollout engine
ADVANTAGES = "advantages"
AGG_NUMERATOR = "agg_numerator"  #: the aggregation numerator (see aggregation.py)
CORRECTION = "mismatch_weight"  #: mismatch-correction weights (absent: no correction)
REF = "ref_logprobs"
#: ``algorithm.old_logprobs: current``: the ratio's denominator is the train forward's own
#: log-probs, detached; with one optimizer step per step's batch these are the log-probs a
#: recomputation would give, so the no-grad pass is skipped (no field holds them before the pass)
CURRENT = "current"

#: per-token statistics averaged over the step's loss tokens
TOKEN_MEAN_METRICS = ("clipfrac", "dual_clipfrac", "ratio", "approx_kl_behaviour", "entropy", "kl")


def token_inputs(mb, proximal: str, divisor: float, with_ref: bool) -> TokenInputs:
    """The micro-batch's :class:`TokenInputs`. Under :data:`CURRENT` ``old_logprobs`` is NaN and
    ``correction`` ``None`` until :func:`at_logprobs` fills both from the forward's log-probs (a
    head that skipped it gets a non-finite loss, which the trainer refuses)."""
    f = mb.fields
    if proximal == CURRENT:
        f = {**f, CURRENT: torch.full_like(f[ROLLOUT], float("nan"))}
    seq_index = mb.seq_index()
    mask = mb.loss_mask
    seq_tokens = mb.seq_sum(mask.to(torch.float32)).clamp_min(1.0)
    # divided in the log-probs' dtype where that is float64 (else float32, no float64 on a device
    # that may lack it): as exact as the autograd path's numerator·(1/divisor) in every dtype
    dtype = f[proximal].dtype
    num = f[AGG_NUMERATOR].to(torch.float64 if dtype == torch.float64 else torch.float32)
    weights = (num / divisor).to(dtype)
    return TokenInputs(
        old_logprobs=f[proximal], rollout_logprobs=f[ROLLOUT], advantages=f[ADVANTAGES], mask=mask,
        weights=weights, correction=f.get(CORRECTION),
        ref_logprobs=f.get(REF) if with_ref else None, seq_index=seq_index, seq_tokens=seq_tokens,
    )


def at_logprobs(x: TokenInputs, logprobs: torch.Tensor, correction: MismatchCorrection | None) -> TokenInputs:
    """``x`` for tokens whose forward gave ``logprobs`` (these tokens only, e.g. a head's chunk),
    under :data:`CURRENT`: the ratio's denominator is ``logprobs`` detached and the mismatch
    weights are computed from it (``correction`` is :attr:`MismatchCorrection.per_token`)."""
    lp = logprobs.detach()
    weights = None if correction is None else token_weights(lp, x.rollout_logprobs, x.mask, correction)
    return replace(x, old_logprobs=lp.to(x.rollout_logprobs.dtype), correction=weights)


def completion(proximal: str, correction: MismatchCorrection | None):
    """What :class:`~rlcore.types.LossRequest` ``complete`` holds: :func:`at_logprobs` under
    :data:`CURRENT`, else ``None`` (the inputs are whole before the forward)."""
    if proximal != CURRENT:
        return None
    return lambda x, logprobs: at_logprobs(x, logprobs, correction)


def seq_log_ratio(mb, logprobs: torch.Tensor, x: TokenInputs) -> torch.Tensor:
    """``[T]``: each token's sequence's mean ``logp − old`` over its loss tokens (detached)."""
    d = torch.where(x.mask, logprobs.detach() - x.old_logprobs.to(logprobs.dtype), torch.zeros_like(logprobs))
    return (mb.seq_sum(d) / x.seq_tokens.to(d.dtype))[x.seq_index]


def loss_request(mb, objective: TokenObjective, divisor: float, proximal: str,
                 correction: MismatchCorrection | None = None) -> LossRequest | None:
    """What a ``Cap.FUSED_LOSS`` head gets for this micro-batch's train forward, or ``None``
    for a sequence-level loss (its derivative needs the whole sequence's log-probs first: core
    keeps the plain path for it). ``correction``: the step's mismatch correction, which
    :data:`CURRENT` computes per token from the head's log-probs."""
    if objective.loss.sequence_level:
        return None
    return LossRequest(objective=objective, inputs=token_inputs(mb, proximal, divisor, with_ref=objective.kl_coef > 0),
                       complete=completion(proximal, correction))


def micro_batch_loss(mb, logprobs: torch.Tensor, entropy: torch.Tensor | None, objective: TokenObjective,
                     divisor: float, proximal: str, head_loss: torch.Tensor | None = None,
                     correction: MismatchCorrection | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """This micro-batch's share of the step loss and token-summed statistics (``_tokens`` holds
    the count, for exact averaging over the step). The loss is ``head_loss`` when the head
    formed it (``Cap.FUSED_LOSS``; ``logprobs``/``entropy`` are then detached and only feed the
    statistics), else the plain autograd path over ``logprobs``. ``correction``: as for
    :func:`loss_request`."""
    x = token_inputs(mb, proximal, divisor, with_ref=objective.kl_coef > 0)
    if proximal == CURRENT:
        x = at_logprobs(x, logprobs, correction)
    slr = seq_log_ratio(mb, logprobs, x) if objective.loss.sequence_level else None
    if head_loss is not None:
        if objective.loss.sequence_level:
            raise RuntimeError("a head returned a fused loss for a sequence-level policy loss, which core never requests")
        loss = head_loss
    else:
        per_token = objective.value(logprobs, entropy, x, slr)
        loss = (per_token * mb.fields[AGG_NUMERATOR].to(per_token.dtype)).sum() / divisor
    with torch.no_grad():
        # statistics over loss tokens only; summed with where, not ·mask (garbage there: 0·inf is NaN)
        lp, ent, xm, slr_m = masked_inputs(logprobs, entropy, x, slr)

        def total(v: torch.Tensor) -> float:
            return float(torch.where(x.mask, v, torch.zeros_like(v)).sum())

        stats = {k: total(v) for k, v in objective.loss.metrics(lp, xm, slr_m).items()}
        stats["entropy"] = total(ent) if ent is not None else 0.0
        stats["kl"] = total(kl_penalty(lp, xm.ref_logprobs, objective.kl_estimator)) if xm.ref_logprobs is not None \
            else 0.0
        stats["_tokens"] = float(x.mask.sum())
    return loss, stats


def closed_form(mb, logprobs: torch.Tensor, entropy: torch.Tensor | None, objective: TokenObjective,
                divisor: float, proximal: str, correction: MismatchCorrection | None = None) -> TokenLoss:
    """The same micro-batch loss in closed form: ``value.sum()`` equals
    :func:`micro_batch_loss`'s loss and ``d_logprobs``/``d_entropy`` its gradient."""
    x = token_inputs(mb, proximal, divisor, with_ref=objective.kl_coef > 0)
    if proximal == CURRENT:
        x = at_logprobs(x, logprobs, correction)
    slr = seq_log_ratio(mb, logprobs, x) if objective.loss.sequence_level else None
    return objective.closed_form(logprobs, entropy, x, slr)
